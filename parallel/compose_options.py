"""``parallelize``'s options and argument checks: :class:`PipelineOptions` and ``validate``
(every check before any collective: ValueError/TypeError naming the argument)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import ParallelContext

from .loss_scaler import DynamicLossScaler
from .strategy_names import DP_STRATEGIES

__all__ = ["PipelineOptions", "axis_size", "validate"]


@dataclass(frozen=True)
class PipelineOptions:
    """How to pipeline (the arguments of :class:`~shardkit.parallel.PipelineParallel`).

    Attributes:
        microbatches: micro-batches per step (any value >= 1).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``.
        virtual_stages: stages per rank (interleaved only).
        split: ``"layers"``, ``"params"``, ``"time"`` or explicit stage sizes.
        split_example: the first block's input for one micro-batch (required with
            ``split="time"``, which times the blocks on it), or ``(input, target)`` to time the
            loss with the last block.

    Example:
        >>> PipelineOptions(microbatches=8, schedule="interleaved", virtual_stages=2)
    """

    microbatches: int = 4
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split: Any = "layers"
    split_example: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None


def validate(
    model: Any,
    ctx: Any,
    loss_fn: Any,
    tp_plan: Any,
    pp: Any,
    dp: Any,
    blocks: Any,
    checkpointing: Any,
    loss_scaler: Any,
    autocast: Any,
) -> PipelineOptions:
    """Every check, before any collective (ValueError/TypeError naming the argument)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if ctx is None and dp != "none":
        raise ValueError(f"dp={dp!r} needs a ParallelContext (ctx=None is one process: dp='none')")
    if ctx is not None and not isinstance(ctx, ParallelContext):
        raise TypeError(f"ctx must be a ParallelContext or None, got {type(ctx).__name__}")
    if dp == "none" and axis_size(ctx, "dp") > 1:
        raise ValueError(f"dp='none' but ctx has a dp axis of size {axis_size(ctx, 'dp')}: pick 'ddp' or a ZeRO stage")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if dp not in DP_STRATEGIES:
        raise ValueError(f"dp must be one of {list(DP_STRATEGIES)}, got {dp!r}")
    if checkpointing not in (False, True, "cpu"):
        raise ValueError(f"checkpointing must be False, True or 'cpu', got {checkpointing!r}")
    if blocks is not None and not callable(blocks):
        raise TypeError(f"blocks must be callable (model -> sequence of blocks) or None, got {type(blocks).__name__}")
    tp, pp_size = axis_size(ctx, "tp"), axis_size(ctx, "pp")
    if tp > 1 and tp_plan is None:
        raise ValueError(f"tp_plan is required: ctx has a tp axis of size {tp}")
    if tp_plan is not None and not isinstance(tp_plan, Mapping):
        raise TypeError(f"tp_plan must be a mapping of module patterns to styles, got {type(tp_plan).__name__}")
    if pp_size > 1 and pp is None:
        raise ValueError(f"pp is required (PipelineOptions or a dict): ctx has a pp axis of size {pp_size}")
    if pp is not None and pp_size == 1:
        raise ValueError("pp: the context's pp axis has size 1; build it with pp > 1 to pipeline")
    opts = PipelineOptions()
    if pp is not None:
        if isinstance(pp, Mapping):
            unknown = set(pp) - set(PipelineOptions.__dataclass_fields__)
            if unknown:
                raise ValueError(f"pp: unknown option(s) {sorted(unknown)}; known: {list(PipelineOptions.__dataclass_fields__)}")
            opts = PipelineOptions(**pp)
        elif isinstance(pp, PipelineOptions):
            opts = pp
        else:
            raise TypeError(f"pp must be PipelineOptions, a dict or None, got {type(pp).__name__}")
        if blocks is None and not isinstance(model, (nn.Sequential, nn.ModuleList)):
            raise ValueError(f"blocks is required to pipeline a {type(model).__name__} (model -> [embedding, *blocks, head])")
    if checkpointing and pp_size == 1 and blocks is None:
        raise ValueError("checkpointing without a pipeline needs blocks= (which modules to recompute)")
    if pp_size > 1 and dp == "zero3":
        raise ValueError(
            f"dp='zero3' with pp={pp_size}: ZeRO-3's per-unit parameter gathers would have to be issued per "
            "micro-batch inside the pipeline schedule; use dp='zero1' or 'zero2' (or 'ddp') with pipeline parallelism"
        )
    if pp_size > 1 and dp.startswith("zero") and ctx.world_size != dist.get_world_size():
        raise ValueError(f"ctx: dp={dp!r} with pp needs the context to span the world, got {ctx.world_size} ranks")
    if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
        raise TypeError(f"loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler).__name__}")
    if tp > 1 and loss_scaler is not None and not dp.startswith("zero"):
        raise ValueError(
            "loss_scaler (fp16) with tp needs a ZeRO dp strategy (its finalize agrees the overflow over "
            "dp and tp); use bf16 or fp32, or dp='zero1'/'zero2'/'zero3' with tp"
        )
    if pp_size > 1 and autocast is not None:
        raise ValueError(
            "autocast is not applied inside pipeline stages yet; pipeline in fp32, bf16 params, or fp16 params "
            "(model.half()) with loss_scaler= (fp32 masters in the optimizer)"
        )
    return opts


def axis_size(ctx: ParallelContext | None, axis: str) -> int:
    """The size of ``axis`` (1 without a context: one process).

    Example:
        >>> axis_size(None, "tp")
        1
    """
    return 1 if ctx is None else ctx.size(axis)
