"""Activation checkpointing per block, on ``torch.utils.checkpoint`` (non-reentrant).

[Note: what a checkpointed block keeps]
A checkpointed block's forward runs under ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``: the tensors its ops would save for backward are dropped and recomputed
by re-running the block's forward when backward first needs them; only the block's *inputs* are
kept (saved through the ordinary saved-tensor mechanism by the checkpoint itself). With
``offload_to_cpu`` the forward runs inside ``torch.autograd.graph.save_on_cpu(pin_memory=True)``,
which is the innermost saved-tensor hook around those inputs (the checkpoint's own hook is
innermost inside the block), so the kept inputs move to pinned CPU memory and come back for the
recomputation; on a CPU device they are copied (pointless, but the same code path).

The non-reentrant checkpoint keeps the autograd graph's structure, so ``torch.autograd.grad``
with any inputs works, and so does the pipeline's split backward (ZB-H1): the input-gradient
pass and the weight-gradient pass each recompute the block once (run the weight pass under one
``torch.utils.checkpoint.GraphExecGroup`` so its several autograd calls share one
recomputation). Random ops (dropout) replay the forward's RNG state.

The block is patched in place (an instance ``forward`` bound to the block), so
``state_dict()`` keys, hooks and ``named_parameters()`` are unchanged — no wrapper module with a
``_checkpoint_wrapped_module.`` prefix. Under ``torch.no_grad()`` the block runs plainly.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_blocks", "is_checkpointed"]

Which = Callable[[int, nn.Module], bool] | Sequence[int] | int | None
_ATTR = "_shardkit_checkpoint"  # on a patched block: "cpu" or True


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fwd = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return fwd(*args, **kwargs)
    if getattr(self, _ATTR) == "cpu":
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        with save_on_cpu(pin_memory=True, device_type=dev.type if dev.type != "cpu" else "cuda"):
            return checkpoint(fwd, *args, use_reentrant=False, **kwargs)
    return checkpoint(fwd, *args, use_reentrant=False, **kwargs)


def _blocks_of(model_or_blocks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(model_or_blocks, (nn.Sequential, nn.ModuleList)):
        return list(model_or_blocks)
    if isinstance(model_or_blocks, nn.Module):
        found: list[nn.Module] = []
        inside: list[str] = []
        for name, mod in model_or_blocks.named_modules():
            if isinstance(mod, nn.ModuleList) and not any(name.startswith(p + ".") for p in inside):
                inside.append(name)
                found += list(mod)
        if not found:
            raise ValueError(
                f"model_or_blocks: {type(model_or_blocks).__name__} holds no nn.ModuleList of blocks; "
                "pass the blocks themselves (e.g. model.layers)"
            )
        return found
    if isinstance(model_or_blocks, Sequence) and all(isinstance(b, nn.Module) for b in model_or_blocks):
        return list(model_or_blocks)
    raise TypeError(f"model_or_blocks must be an nn.Module or a sequence of modules, got {type(model_or_blocks).__name__}")


def _selected(blocks: list[nn.Module], which: Which) -> list[bool]:
    n = len(blocks)
    if which is None:
        return [True] * n
    if isinstance(which, bool):
        raise TypeError("which must be None, an int, a sequence of block indices or a callable, got a bool")
    if isinstance(which, int):
        if which < 1:
            raise ValueError(f"which={which}: an int selects every which-th block and must be >= 1")
        return [i % which == 0 for i in range(n)]
    if callable(which):
        return [bool(which(i, b)) for i, b in enumerate(blocks)]
    picked = list(which)
    bad = [i for i in picked if not isinstance(i, int) or not -n <= i < n]
    if bad:
        raise ValueError(f"which: block indices {bad} out of range for {n} blocks")
    chosen = {i % n for i in picked}
    return [i in chosen for i in range(n)]


def checkpoint_blocks(
    model_or_blocks: nn.Module | Sequence[nn.Module],
    *,
    offload_to_cpu: bool = False,
    which: Which = None,
) -> list[nn.Module]:
    """Checkpoint blocks in place: keep only each block's inputs, recompute the rest in backward.

    See [Note: what a checkpointed block keeps]. Gradients are those of the unmodified model
    (bit-identical in fp32 with deterministic ops); the forward of every selected block runs
    once more during backward. Calling it again changes the setting of the blocks it selects.

    Args:
        model_or_blocks: an ``nn.Sequential``/``nn.ModuleList`` or sequence of blocks, or a model
            whose blocks are the children of its (outermost) ``nn.ModuleList`` attributes, e.g.
            a GPT with ``self.layers = nn.ModuleList(...)``.
        offload_to_cpu: keep the saved block inputs in pinned CPU memory
            (``torch.autograd.graph.save_on_cpu``) instead of on the device.
        which: the blocks to checkpoint: ``None`` (all), an int ``k`` (blocks ``0, k, 2k, ...``),
            a sequence of block indices, or ``which(index, block) -> bool``.

    Returns:
        The blocks now checkpointed, in order.

    Raises:
        TypeError: ``model_or_blocks`` or ``which`` of an unsupported type.
        ValueError: a model without an ``nn.ModuleList``, ``k < 1``, or an index out of range.

    Example:
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)])
        >>> len(checkpoint_blocks(model, which=2))
        4
        >>> model(torch.randn(32, 64, requires_grad=True)).sum().backward()   # recomputes 4 blocks
    """
    if not isinstance(offload_to_cpu, bool):
        raise TypeError(f"offload_to_cpu must be a bool, got {type(offload_to_cpu).__name__}")
    blocks = _blocks_of(model_or_blocks)
    out = []
    for block, on in zip(blocks, _selected(blocks, which), strict=True):
        if not on:
            continue
        setattr(block, _ATTR, "cpu" if offload_to_cpu else True)
        # bound to this block: copy.deepcopy rebinds a method to the copy, so copies stay right
        block.forward = types.MethodType(_checkpointed_forward, block)
        out.append(block)
    return out


def is_checkpointed(block: nn.Module) -> bool | str:
    """``False``, ``True`` or ``"cpu"`` (checkpointed with CPU-offloaded inputs).

    Example:
        >>> is_checkpointed(checkpoint_blocks([nn.Linear(2, 2)], offload_to_cpu=True)[0])
        'cpu'
    """
    fwd = block.__dict__.get("forward")
    if isinstance(fwd, types.MethodType) and fwd.__func__ is _checkpointed_forward:
        return getattr(block, _ATTR)
    return False
