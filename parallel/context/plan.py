"""Context-parallel plans: which modules attend over the sequence shards, and which turn token
indices into positions.

[Note: what a cp plan changes]
Under context parallelism a model runs on this rank's ``S/cp`` tokens and, outside attention,
nothing needs to change: embeddings, norms, MLPs and the head work per token. Three things do:

* **attention** (style ``"attention"``): every ``F.scaled_dot_product_attention`` call made
  inside the module's forward becomes :func:`~shardkit.parallel.context.context_parallel_attention`
  over ``ctx.group("cp")`` (a ``TorchFunctionMode`` active while the module runs, as PyTorch's
  own ``context_parallel`` does for SDPA). The call's ``is_causal``, ``scale`` and GQA heads are
  kept, and so is its ``dropout_p`` in ``mode="ulysses"`` (ring and hybrid refuse attention
  dropout: their blockwise kernels have none); an explicit ``attn_mask`` is refused
  (``ValueError``): a mask built for ``S/cp`` local tokens means nothing over the full
  sequence. TinyGPT, HF GPT-2 and Llama (``attn_implementation="sdpa"``, the default) call SDPA
  this way when the batch has no padding mask; right-padded batches need none (with
  ``ignore_index`` targets on the padding, a causal model's real tokens never see it). An
  ``attention_mask=`` passed to the model itself is refused on every rank by a hook on the
  model, all-ones or not: Hugging Face drops an all-ones mask, so a rank whose shard has no
  padding would otherwise enter the ring while its peer refused, and wait until the timeout.
* **positions** (style ``"positions"``): a model numbers its tokens ``0 .. t-1`` from its input
  length, which under cp is the local ``S/cp``. The module that consumes those numbers (a
  learned position table such as TinyGPT's ``pos_emb`` or GPT-2's ``wpe``, or Llama's
  ``rotary_emb``, via its ``position_ids``) gets each local index ``i`` replaced by the
  position in the full sequence of this rank's ``i``-th token
  (:func:`~shardkit.parallel.context.shard_positions`). Indices ``>= S/cp`` (a KV cache, an
  offset) are refused.
* **dropout**: every dropout module of the model draws from this cp rank's own stream while it
  trains, as Ulysses' attention dropout does ([Note: dropout under context parallelism]).

Plans are data, like the TP plans: ``{module pattern: style}`` with ``*`` matching one name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from shardkit.comm import CommStats, ParallelContext
from shardkit.kernels.runtime import Backend

from .attention import MODES, ContextParallelMode, check_ulysses_size, context_parallel_attention
from .sequence_layout import LAYOUTS, SequenceLayout, shard_positions
from .sequence_rng import add_cp_dropout_hooks

__all__ = [
    "ContextParallelOptions",
    "ContextParallelStyle",
    "STYLES",
    "context_parallelize",
    "gpt_cp_plan",
    "hf_gpt2_cp_plan",
    "llama_cp_plan",
    "plan_modules",
]

ContextParallelStyle = Literal["attention", "positions"]
#: The styles, see [Note: what a cp plan changes].
STYLES: tuple[str, ...] = ("attention", "positions")


def gpt_cp_plan() -> dict[str, ContextParallelStyle]:
    """The cp plan of :class:`shardkit.models.TinyGPT`.

    Example:
        >>> context_parallelize(TinyGPT(59), ctx, gpt_cp_plan())
    """
    return {"blocks.*.attn": "attention", "pos_emb": "positions"}


def hf_gpt2_cp_plan() -> dict[str, ContextParallelStyle]:
    """The cp plan of a Hugging Face ``GPT2LMHeadModel``.

    Example:
        >>> context_parallelize(GPT2LMHeadModel(cfg), ctx, hf_gpt2_cp_plan())
    """
    return {"transformer.h.*.attn": "attention", "transformer.wpe": "positions"}


def llama_cp_plan() -> dict[str, ContextParallelStyle]:
    """The cp plan of a Hugging Face ``LlamaForCausalLM`` (rotary positions, GQA).

    Example:
        >>> context_parallelize(LlamaForCausalLM(cfg), ctx, llama_cp_plan())
    """
    return {"model.layers.*.self_attn": "attention", "model.rotary_emb": "positions"}


@dataclass(frozen=True)
class ContextParallelOptions:
    """How :func:`~shardkit.parallel.parallelize` splits sequences over ``ctx``'s cp axis.

    Attributes:
        plan: ``{module pattern: "attention" | "positions"}`` (:func:`gpt_cp_plan`,
            :func:`hf_gpt2_cp_plan`, :func:`llama_cp_plan`).
        mode: ``"ring"``, ``"ulysses"`` or ``"hybrid"``
            (:func:`~shardkit.parallel.context.context_parallel_attention`).
        layout: ``"zigzag"`` or ``"contiguous"`` ([Note: sequence layouts]).
        backend: ring mode's attention kernels (``"auto"``: Triton on CUDA, torch on CPU).
        ulysses_size: with ``mode="hybrid"``, the cp ranks of each all-to-all group (a divisor of
            cp; the ring runs across the groups).

    Example:
        >>> parallelize(model, ctx, cp={"plan": gpt_cp_plan(), "mode": "ulysses"})
        >>> parallelize(model, ctx, cp={"plan": gpt_cp_plan(), "mode": "hybrid", "ulysses_size": 2})
    """

    plan: Mapping[str, str]
    mode: ContextParallelMode = "ring"
    layout: SequenceLayout = "zigzag"
    backend: Backend = "auto"
    ulysses_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Mapping) or not self.plan:
            raise TypeError(f"cp: plan must be a non-empty mapping of module patterns to styles, got {self.plan!r}")
        bad = {k: v for k, v in self.plan.items() if v not in STYLES}
        if bad:
            raise ValueError(f"cp: plan styles must be one of {STYLES}, got {bad}")
        if self.mode not in MODES:
            raise ValueError(f"cp: mode must be one of {MODES}, got {self.mode!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"cp: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.backend not in ("auto", "triton", "torch"):
            raise ValueError(f"cp: backend must be 'auto', 'triton' or 'torch', got {self.backend!r}")
        try:
            check_ulysses_size(self.mode, self.ulysses_size, cp=1)  # the divisor is checked against the ctx
        except (TypeError, ValueError) as e:
            raise type(e)(f"cp: {e}") from None

    @classmethod
    def of(cls, value: ContextParallelOptions | Mapping[str, Any]) -> ContextParallelOptions:
        """Options from themselves or a dict of their fields (unknown keys are named).

        Example:
            >>> ContextParallelOptions.of({"plan": gpt_cp_plan(), "mode": "ulysses"}).layout
            'zigzag'
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"cp must be ContextParallelOptions or a dict of its fields, got {type(value).__name__}")
        unknown = set(value) - {"plan", "mode", "layout", "backend", "ulysses_size"}
        if unknown:
            raise ValueError(f"cp: unknown option(s) {sorted(unknown)}; options are plan, mode, layout, backend, ulysses_size")
        if "plan" not in value:
            raise ValueError("cp: 'plan' is required, e.g. {'plan': gpt_cp_plan()}")
        return cls(**value)


@dataclass(frozen=True)
class _Settings:
    ctx: ParallelContext
    mode: ContextParallelMode
    layout: SequenceLayout
    backend: Backend
    stats: CommStats | None
    ulysses_size: int | None = None


class _AttentionOverShards(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :func:`context_parallel_attention`."""

    def __init__(self, settings: _Settings, where: str) -> None:
        super().__init__()
        self.settings, self.where = settings, where
        self.calls = 0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._attend(*args, **kwargs)

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None:
            raise ValueError(
                f"{self.where}: context parallelism got an explicit attn_mask (shape {tuple(attn_mask.shape)}); it "
                "supports causal or full attention only: drop the padding mask (right-padded batches with "
                "ignore_index targets need none) or use cp=1"
            )
        s = self.settings
        if dropout_p and s.mode != "ulysses":
            raise ValueError(
                f"{self.where}: attention dropout (dropout_p={dropout_p}) under context parallelism needs "
                f"mode='ulysses'; the {s.mode} mode's blockwise attention has none: use mode='ulysses' or set the "
                "model's attention dropout to 0"
            )
        self.calls += 1
        if query.shape[2] == 1:
            raise ValueError(
                f"{self.where}: one token per cp rank: Hugging Face models drop the causal flag for a one-token "
                "query, so the attention would not be causal; give each rank at least 2 tokens"
            )
        device = query.device.type
        if torch.is_autocast_enabled(device):  # SDPA's own autocast cast, which this call bypasses
            dtype = torch.get_autocast_dtype(device)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ValueError(f"{self.where}: {query.shape[1]} query heads over {key.shape[1]} key heads without enable_gqa")
        return context_parallel_attention(
            query, key, value, ctx=s.ctx, mode=s.mode, causal=bool(is_causal), layout=s.layout, scale=scale,
            backend=s.backend, stats=s.stats, ulysses_size=s.ulysses_size, dropout_p=dropout_p,
        )  # fmt: skip


def _attention_hooks(module: nn.Module, name: str, settings: _Settings) -> list[RemovableHandle]:
    modes: list[_AttentionOverShards] = []

    def enter(mod: nn.Module, args: Any) -> None:
        mode = _AttentionOverShards(settings, name)
        mode.__enter__()
        modes.append(mode)

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        mode = modes.pop()
        mode.__exit__(None, None, None)
        if mode.calls == 0 and isinstance(out, (torch.Tensor, tuple)):  # it returned, without attending over cp
            raise ValueError(
                f"{name}: the cp plan marks it 'attention', but its forward made no F.scaled_dot_product_attention "
                "call, so it attended over this rank's tokens only; a Hugging Face model needs "
                "attn_implementation='sdpa' (not 'eager')"
            )

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]


def _global_positions(mod: nn.Module, local: torch.Tensor, settings: _Settings, length: int, where: str) -> torch.Tensor:
    cp = settings.ctx.size("cp")
    if local.numel() and (int(local.min()) < 0 or int(local.max()) >= length):
        raise ValueError(
            f"{where}: context parallelism maps this rank's local token indices 0..{length - 1} to positions in "
            f"the full sequence, got indices up to {int(local.max())}: pass position_ids of the local tokens "
            "(0..t-1, the model's default) or none; a KV cache or a position offset is not supported"
        )
    table = shard_positions(length * cp, cp=cp, rank=settings.ctx.rank("cp"), layout=settings.layout, device=local.device)
    if isinstance(mod, nn.Embedding) and length * cp > mod.num_embeddings:
        raise ValueError(
            f"{where}: the full sequence has {length * cp} tokens ({length} on each of cp={cp} ranks) but the "
            f"position table holds {mod.num_embeddings}"
        )
    return table[local]


def _position_hook(module: nn.Module, name: str, settings: _Settings) -> list[RemovableHandle]:
    def remap(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "position_ids" in kwargs:  # rotary embeddings: forward(x, position_ids)
            ids = kwargs["position_ids"]
            kwargs = {**kwargs, "position_ids": _global_positions(mod, ids, settings, ids.shape[-1], name)}
            return args, kwargs
        index = 1 if len(args) > 1 and not isinstance(mod, nn.Embedding) else 0
        if len(args) <= index or not isinstance(args[index], torch.Tensor):
            raise ValueError(f"{name}: a 'positions' module takes the positions as its first argument or position_ids")
        ids = args[index]
        mapped = _global_positions(mod, ids, settings, ids.shape[-1], name)
        return (*args[:index], mapped, *args[index + 1 :]), kwargs

    return [module.register_forward_pre_hook(remap, with_kwargs=True)]


def plan_modules(model: nn.Module, plan: Mapping[str, str]) -> dict[str, tuple[nn.Module, str]]:
    """``{module name: (module, style)}`` for a cp plan's patterns (``*`` matches one name).

    Raises:
        ValueError: an unknown style, or a pattern that names no module of ``model``.

    Example:
        >>> sorted(plan_modules(TinyGPT(59, n_layers=2), gpt_cp_plan()))
        ['blocks.0.attn', 'blocks.1.attn', 'pos_emb']
    """
    names = dict(model.named_modules())
    found: dict[str, tuple[nn.Module, str]] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"cp plan: style {style!r} of {pattern!r} is not one of {STYLES}")
        parts = pattern.split(".")
        hits = [
            n for n in names if n and len(n.split(".")) == len(parts) and all(p in ("*", q) for p, q in zip(parts, n.split(".")))
        ]
        if not hits:
            raise ValueError(f"cp plan pattern {pattern!r} names no module of {type(model).__name__}")
        for n in hits:
            found[n] = (names[n], style)
    return found


def context_parallelize(
    model: nn.Module,
    ctx: ParallelContext,
    plan: Mapping[str, str],
    *,
    mode: ContextParallelMode = "ring",
    layout: SequenceLayout = "zigzag",
    backend: Backend = "auto",
    stats: CommStats | None = None,
    ulysses_size: int | None = None,
) -> list[RemovableHandle]:
    """Make ``model`` run on this cp rank's tokens (see [Note: what a cp plan changes]), in place.

    Afterwards ``model(shard_sequence(ids, ctx))`` returns this rank's part of
    ``model(ids)``'s output: the same values, for the same tokens. Parameters are untouched (no
    copies, same names); their gradients from the shards must be summed over cp (the dp
    strategies do, over ``ctx.group("dp_cp")``).

    Args:
        model: the model; built the same on every cp rank.
        ctx: the context; its ``cp`` axis holds the sequence.
        plan: ``{module pattern: "attention" | "positions"}``, e.g. :func:`gpt_cp_plan`.
        mode, layout, backend, ulysses_size: as
            :func:`~shardkit.parallel.context.context_parallel_attention` (the layout must be
            the one the inputs were sharded with). ``mode="hybrid"`` creates its groups here
            (:meth:`ParallelContext.cp_split`: every rank of the world calls this).
        stats: optional :class:`~shardkit.comm.CommStats` for the attention's transfers.

    Returns:
        The hook handles (``handle.remove()`` on each undoes the plan).

    Raises:
        ValueError: an unknown style or mode, a pattern that names no module, or a model that
            already carries a cp plan.

    Example:
        >>> ctx = ParallelContext.from_env(cp=2)
        >>> context_parallelize(model, ctx, gpt_cp_plan(), mode="ulysses")
        >>> logits = gather_sequence(model(shard_sequence(ids, ctx)), ctx)   # == model(ids), unparallelized
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(ctx, ParallelContext):
        raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a mapping of module patterns to styles, got {type(plan).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    check_ulysses_size(mode, ulysses_size, ctx.size("cp"))
    found = plan_modules(model, plan)
    if ctx.size("cp") == 1:  # the plan is valid; nothing to change on one rank
        return []
    if _refuse_attention_mask in model._forward_pre_hooks.values():
        raise ValueError(
            f"{type(model).__name__}: a cp plan is already applied to this model (context_parallelize, or "
            "parallelize(cp=...)); applying it twice would map the positions twice. Remove the first one's "
            "hooks (the handles it returned) or apply it once"
        )
    if mode == "hybrid":  # the groups now, on every rank: a pipeline later runs some layers on some ranks only
        assert ulysses_size is not None
        ctx.cp_split(ulysses_size)
    settings = _Settings(ctx, mode, layout, backend, stats, ulysses_size)
    handles: list[RemovableHandle] = [model.register_forward_pre_hook(_refuse_attention_mask, with_kwargs=True)]
    handles += add_cp_dropout_hooks(model, ctx.group("cp"))  # [Note: dropout under context parallelism]
    for name, (module, style) in found.items():
        hook = _attention_hooks if style == "attention" else _position_hook
        handles += hook(module, name, settings)
    return handles


def _refuse_attention_mask(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """An ``attention_mask=`` given to the model is refused on every rank alike, before any
    transfer: inside, Hugging Face drops an all-ones mask, so a rank whose shard has no padding
    would enter the ring while a rank with padding refused its mask, and wait for it until the
    group's timeout."""
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            f"{type(model).__name__}: context parallelism attends over the whole sequence with a causal mask; pass "
            "no attention_mask (right-padded batches with ignore_index targets need none; left padding is not "
            "supported under cp)"
        )
