"""Declarative tensor-parallel plans: ``tensor_parallelize(model, ctx, plan)``.

A plan is data (torchtitan's layer plans): ``{module-name pattern: style}``. A pattern is a
dotted module name where ``*`` matches one name component (``"blocks.*.attn.qkv"``). Styles:

* :class:`Colwise` — an ``nn.Linear`` becomes a :class:`ColumnParallelLinear` (``fused_chunks=3``
  for a fused ``[q; k; v]`` projection);
* :class:`Rowwise` — an ``nn.Linear`` becomes a :class:`RowParallelLinear`;
* both with ``transposed=True`` take a Hugging Face ``Conv1D`` (GPT-2), whose weight is stored
  ``[in, out]`` (``y = x W + b``): the column split is then along the weight's dim 1 and the
  row split along dim 0. The converted layer holds the ``nn.Linear`` layout ``[out, in]``;
  :func:`shard_state_dict` / :func:`gather_state_dict` transpose to and from the checkpoint's;
* :class:`VocabParallel` — an ``nn.Embedding`` becomes a :class:`VocabParallelEmbedding`;
* :class:`VocabParallelHead` — an LM head ``nn.Linear(d, V, bias=False)`` becomes a
  :class:`VocabParallelLMHead` returning this rank's logits shard (feed it to
  ``vocab_parallel_cross_entropy``), optionally sharing the weight of a vocab-parallel embedding
  (tied embeddings);
* :class:`Heads` — divides an attention module's integer attributes (``n_heads``; HF GPT-2's
  ``num_heads``, ``split_size``, ``embed_dim``) by tp, so its unmodified forward runs this rank's
  heads, and checks head counts read from its ``config`` (HF Llama's ``num_key_value_heads``).

:func:`tensor_parallelize` validates the whole plan first — every pattern matches a module of the
right type, every split dimension is divisible by tp — and raises a ``ValueError`` naming the
pattern or dimension before converting anything (and before any collective). Conversion slices
the model's current weights (``from_dense``), so a TP model built from a dense model (same seed
on every rank) computes what the dense model computes.

:func:`shard_state_dict` / :func:`gather_state_dict` convert a dense state dict to this rank's
shards and back, with the same plan.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.comm import CommStats, ParallelContext

from .functions import copy_to_tp_region, gather_along, gather_from_sequence_region, scatter_to_sequence_region
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .rng import add_tp_rng_region_, set_tp_rng_stream
from .sequence_parallel import make_sequence_parallel_, share_sequence_parallel_grads

__all__ = [
    "Colwise",
    "Rowwise",
    "ScatterSequence",
    "SequenceParallel",
    "VocabParallel",
    "VocabParallelHead",
    "Heads",
    "VocabParallelLMHead",
    "tensor_parallelize",
    "plan_modules",
    "gpt_plan",
    "shard_state_dict",
    "gather_state_dict",
]


@dataclass(frozen=True)
class Colwise:
    """Split an ``nn.Linear``'s output features (weight rows) over tp; ``transposed``: a HF
    ``Conv1D`` (weight ``[in, out]``, split along dim 1)."""

    fused_chunks: int = 1
    gather_output: bool = False
    transposed: bool = False
    sequence_parallel: bool = False  # input: sequence shards, all-gathered (reduce-scattered back)


@dataclass(frozen=True)
class Rowwise:
    """Split an ``nn.Linear``'s input features (weight columns) over tp; ``transposed``: a HF
    ``Conv1D`` (weight ``[in, out]``, split along dim 0)."""

    input_is_parallel: bool = True
    transposed: bool = False
    sequence_parallel: bool = False  # output: reduce-scattered into sequence shards


@dataclass(frozen=True)
class VocabParallel:
    """Split an ``nn.Embedding``'s rows (the vocabulary) over tp, padded to a multiple of tp."""


@dataclass(frozen=True)
class VocabParallelHead:
    """Split an LM head's vocabulary over tp; ``tied_to`` names the embedding sharing its weight."""

    tied_to: str | None = None
    sequence_parallel: bool = False  # input: sequence shards, all-gathered before the head


@dataclass(frozen=True)
class SequenceParallel:
    """Run a module with replicated parameters (LayerNorm, RMSNorm) on sequence shards, its
    gradients summed over tp (:func:`~shardkit.parallel.tensor.make_sequence_parallel_`)."""


@dataclass(frozen=True)
class ScatterSequence:
    """The module's first input enters the sequence-parallel region: each rank keeps its
    ``s/tp`` tokens (dim ``seq_dim``); the backward all-gathers the gradient."""

    seq_dim: int = -2


@dataclass(frozen=True)
class Heads:
    """Give an attention module this rank's heads: divide its integer attribute ``attr`` (a head
    count, required unless None) and each of ``if_present`` that it has (per-rank widths such as
    HF GPT-2's ``split_size``) by tp; check that every ``module.config.<name>`` in
    ``config_heads`` (e.g. ``num_key_value_heads``) is divisible by tp. The config is only read:
    HF shares one config object between all layers and the model."""

    attr: str | None = "n_heads"
    if_present: tuple[str, ...] = ()
    config_heads: tuple[str, ...] = ()


Style = Colwise | Rowwise | VocabParallel | VocabParallelHead | Heads | SequenceParallel | ScatterSequence


class VocabParallelLMHead(nn.Module):
    """``logits_shard = X W_rᵀ``: the column-parallel LM head over a padded vocabulary.

    Rank ``r`` holds rows ``[r Vs, (r+1) Vs)`` of the ``[V, D]`` weight (zero past ``V``), the
    layout of :class:`VocabParallelEmbedding`, whose weight it can share (``embedding=``).

    Args:
        weight: this rank's ``[Vs, D]`` parameter (shared with a tied embedding, or its own).
        vocab_size: the real vocabulary size ``V`` (pass it to ``vocab_parallel_cross_entropy``).
        ctx: the parallel context.
        stats: optional CommStats (the backward all-reduce of the input gradient).

    Example:
        >>> head = VocabParallelLMHead(emb.weight, vocab_size=50257, ctx=ctx)   # tied
        >>> loss = vocab_parallel_cross_entropy(head(h), y, ctx=ctx, vocab_size=head.vocab_size)
    """

    def __init__(
        self,
        weight: nn.Parameter,
        *,
        vocab_size: int,
        ctx: ParallelContext,
        stats: CommStats | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.weight, self.vocab_size, self.group, self.stats = weight, vocab_size, ctx.group("tp"), stats
        self.ctx = ctx
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` -> ``[..., Vs]`` (this rank's vocabulary columns)."""
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"VocabParallelLMHead: input must have last dimension {self.weight.shape[1]}, got shape {tuple(x.shape)}"
            )
        if self.sequence_parallel:  # [b, s/tp, D] -> [b, s, D]; the gradient is reduce-scattered back
            y = F.linear(gather_from_sequence_region(x, group=self.group, stats=self.stats), self.weight)
        else:
            y = F.linear(copy_to_tp_region(x, group=self.group, stats=self.stats), self.weight)
        if self.group.size() > 1:  # vocabulary shards: [Note: tensor-parallel RNG streams]
            set_tp_rng_stream(sharded=True)
        return y


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + ".".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")) + "$")


def _match(model: nn.Module, plan: dict[str, Style]) -> dict[str, tuple[str, Style]]:
    """``{module name: (pattern, style)}``; each pattern must match at least one module."""
    names = [n for n, _ in model.named_modules() if n]
    found: dict[str, tuple[str, Style]] = {}
    for pattern, style in plan.items():
        regex = _pattern_regex(pattern)
        hits = [n for n in names if regex.match(n)]
        if not hits:
            raise ValueError(f"TP plan pattern {pattern!r} names no module of {type(model).__name__}")
        for n in hits:
            if n in found:
                raise ValueError(f"module {n!r} is matched by two TP plan patterns: {found[n][0]!r} and {pattern!r}")
            found[n] = (pattern, style)
    return found


def _features(module: nn.Module, style: Style) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or (``transposed``) a HF ``Conv1D``."""
    if getattr(style, "transposed", False):
        return tuple(module.weight.shape)  # Conv1D: weight [in, out]
    return module.in_features, module.out_features


def _as_linear(module: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` sharing a HF ``Conv1D``'s values: weight ``[in, out]`` seen as ``[out, in]``."""
    n_in, n_out = module.weight.shape
    linear = nn.Linear(n_in, n_out, bias=module.bias is not None, device="meta")  # no init work
    linear.weight = nn.Parameter(module.weight.detach().t(), requires_grad=False)
    linear.bias = None if module.bias is None else nn.Parameter(module.bias.detach(), requires_grad=False)
    return linear


def _check(name: str, pattern: str, module: nn.Module, style: Style, tp: int) -> None:
    where = f"TP plan {pattern!r} -> {name}"
    transposed = getattr(style, "transposed", False)
    if transposed:
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(
                f"{where}: {type(style).__name__}(transposed=True) needs a Conv1D-like module (weight [in, out]), "
                f"got {type(module).__name__}"
            )
    elif isinstance(style, (Colwise, Rowwise, VocabParallelHead)) and not isinstance(module, nn.Linear):
        hint = (
            " (a Hugging Face Conv1D stores weight [in, out]: use transposed=True)" if type(module).__name__ == "Conv1D" else ""
        )
        raise ValueError(f"{where}: {type(style).__name__} needs an nn.Linear, got {type(module).__name__}{hint}")
    if isinstance(style, Colwise) and _features(module, style)[1] % (tp * style.fused_chunks):
        raise ValueError(
            f"{where}: out_features={_features(module, style)[1]} is not divisible by tp * fused_chunks = {tp} * {style.fused_chunks}"
        )
    if isinstance(style, Rowwise) and _features(module, style)[0] % tp:
        raise ValueError(f"{where}: in_features={_features(module, style)[0]} is not divisible by the tp size {tp}")
    if isinstance(style, VocabParallel) and not isinstance(module, nn.Embedding):
        raise ValueError(f"{where}: VocabParallel needs an nn.Embedding, got {type(module).__name__}")
    if isinstance(style, VocabParallelHead) and module.bias is not None:
        raise ValueError(f"{where}: VocabParallelHead supports heads without bias")
    if isinstance(style, Heads):
        values = {}
        if style.attr is not None:
            if not isinstance(getattr(module, style.attr, None), int):
                raise ValueError(f"{where}: Heads needs an int attribute {style.attr!r}")
            values[style.attr] = getattr(module, style.attr)
        values.update({a: getattr(module, a) for a in style.if_present if isinstance(getattr(module, a, None), int)})
        config = getattr(module, "config", None)
        for a in style.config_heads:
            if not isinstance(getattr(config, a, None), int):
                raise ValueError(f"{where}: Heads needs an int {a!r} in the module's config")
            values[a] = getattr(config, a)
        for a, value in values.items():
            if value % tp:
                raise ValueError(f"{where}: {a}={value} is not divisible by the tp size {tp}")


def plan_modules(model: nn.Module, plan: dict[str, Style], tp: int) -> dict[str, tuple[str, Style]]:
    """Resolve and validate ``plan`` against ``model`` for ``tp`` ranks; a pure function.

    Returns:
        ``{module name: (pattern, style)}`` for every module the plan touches.

    Raises:
        ValueError: as :func:`tensor_parallelize`.

    Example:
        >>> sorted(plan_modules(TinyGPT(59, n_layers=1), gpt_plan(), 2))[:2]
        ['blocks.0.attn', 'blocks.0.attn.proj']
    """
    matched = _match(model, plan)
    modules = dict(model.named_modules())
    for name, (pattern, style) in matched.items():
        _check(name, pattern, modules[name], style, tp)
        if isinstance(style, VocabParallelHead) and style.tied_to is not None:
            tied = matched.get(style.tied_to)
            if tied is None or not isinstance(tied[1], VocabParallel):
                raise ValueError(f"TP plan {pattern!r}: tied_to={style.tied_to!r} must name a module planned VocabParallel()")
            # a plan that ties an untied model would silently train another model
            if modules[name].weight is not modules[style.tied_to].weight:
                raise ValueError(
                    f"TP plan {pattern!r}: tied_to={style.tied_to!r} but {name}.weight is not {style.tied_to}.weight "
                    "(the model's head is untied: use the plan's tie_embeddings=False)"
                )
        elif isinstance(style, VocabParallelHead) and isinstance(getattr(modules[name], "weight", None), nn.Parameter):
            shared = [
                n for n, (_, st) in matched.items() if isinstance(st, VocabParallel) and modules[n].weight is modules[name].weight
            ]
            if shared:
                raise ValueError(
                    f"TP plan {pattern!r}: {name}.weight is {shared[0]}.weight (tied) but the plan has tied_to=None "
                    f"(use tied_to={shared[0]!r}, e.g. the plan's tie_embeddings=True)"
                )
    return matched


def tensor_parallelize(
    model: nn.Module, ctx: ParallelContext, plan: dict[str, Style], *, stats: CommStats | None = None
) -> nn.Module:
    """Convert ``model``'s modules in place according to ``plan`` (see the module docstring).

    Args:
        model: the dense model, built identically (same seed) on every rank.
        ctx: the parallel context (the tp axis is used).
        plan: ``{pattern: style}``.
        stats: optional CommStats passed to every converted layer.

    Returns:
        ``model`` (modified in place).

    Raises:
        ValueError: a pattern that names no module, a style on the wrong module type, a split
            dimension not divisible by tp, a tied head whose embedding is not in the plan —
            all before any module is converted.

    Example:
        >>> model = tensor_parallelize(TinyGPT(59, n_heads=4), ctx, gpt_plan())
        >>> loss = vocab_parallel_cross_entropy(model(idx), y, ctx=ctx, vocab_size=59)
    """
    tp = ctx.size("tp")
    matched = plan_modules(model, plan, tp)
    modules = dict(model.named_modules())
    converted: dict[str, nn.Module] = {}
    order = sorted(matched, key=lambda n: isinstance(matched[n][1], VocabParallelHead))  # embeddings first
    for name in order:
        _, style = matched[name]
        module = modules[name]
        if isinstance(style, Heads):
            for a in ((style.attr,) if style.attr else ()) + style.if_present:
                if isinstance(getattr(module, a, None), int):
                    setattr(module, a, getattr(module, a) // tp)
            continue
        if isinstance(style, ScatterSequence):
            module.register_forward_pre_hook(
                functools.partial(_scatter_sequence, group=ctx.group("tp"), seq_dim=style.seq_dim, stats=stats)
            )
            continue
        if getattr(style, "transposed", False):
            module = _as_linear(module)
        if isinstance(style, SequenceParallel):  # in place: names and state_dict keys unchanged
            make_sequence_parallel_(module, ctx=ctx, stats=stats)
            continue
        if isinstance(style, Colwise):
            new = ColumnParallelLinear.from_dense(
                module,
                ctx=ctx,
                fused_chunks=style.fused_chunks,
                gather_output=style.gather_output,
                sequence_parallel=style.sequence_parallel,
                stats=stats,
            )
        elif isinstance(style, Rowwise):
            new = RowParallelLinear.from_dense(
                module, ctx=ctx, input_is_parallel=style.input_is_parallel, sequence_parallel=style.sequence_parallel, stats=stats
            )
        elif isinstance(style, VocabParallel):
            new = VocabParallelEmbedding.from_dense(module, ctx=ctx, stats=stats)
        else:
            if style.tied_to is not None:
                weight = converted[style.tied_to].weight
            else:
                weight = VocabParallelEmbedding.from_dense(nn.Embedding.from_pretrained(module.weight.detach()), ctx=ctx).weight
            new = VocabParallelLMHead(
                weight, vocab_size=module.out_features, ctx=ctx, stats=stats, sequence_parallel=style.sequence_parallel
            )
        if getattr(style, "transposed", False):  # [Note: Conv1D weights in checkpoints] (parallel/checkpoint/content.py)
            new.weight._dense_transposed = True
        converted[name] = new
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    # dropout between a column- and a row-parallel layer (or on sequence shards) gets a mask per
    # rank: a region in each module holding such layers ([Note: tensor-parallel RNG streams])
    if tp > 1:
        holders: dict[str, list[Style]] = {}
        for name, (_, style) in matched.items():
            if isinstance(style, (Colwise, Rowwise)):
                holders.setdefault(name.rpartition(".")[0], []).append(style)
        for parent, styles in holders.items():
            cols = [st for st in styles if isinstance(st, Colwise)]
            # the holder's input: sequence shards if its column layers gather them; with row
            # layers only, the shard a column layer elsewhere made
            sharded_input = any(st.sequence_parallel for st in cols) if cols else any(st.input_is_parallel for st in styles)
            add_tp_rng_region_(model.get_submodule(parent) if parent else model, ctx=ctx, sharded_input=sharded_input)
    # sequence-parallel layers (built by hand or by the plan): one gradient all-reduce per backward
    share_sequence_parallel_grads(model, stats=stats)
    return model


def _scatter_sequence(
    module: nn.Module, args: tuple, *, group: dist.ProcessGroup, seq_dim: int, stats: CommStats | None
) -> tuple:
    """ScatterSequence's forward pre-hook: the first input becomes this rank's sequence chunk."""
    x = scatter_to_sequence_region(args[0], group=group, seq_dim=seq_dim, stats=stats)
    if group.size() > 1:  # sequence shards from here: [Note: tensor-parallel RNG streams]
        set_tp_rng_stream(sharded=True)
    return (x, *args[1:])


def gpt_plan(*, tie_embeddings: bool = True, sequence_parallel: bool = False) -> dict[str, Style]:
    """The TP plan of a GPT-2-layout model (shardkit's TinyGPT): attention heads and the MLP split
    Megatron-style, the vocabulary split in the embedding and the LM head.

    Positions, LayerNorms and biases of row-parallel layers stay replicated. With
    ``sequence_parallel`` the activations between the blocks' linears are sequence shards
    (``[b, s/tp, d]``): the first block's input is scattered, the LayerNorms run on shards
    (their gradients summed over tp), column-parallel inputs are all-gathered and row-parallel
    outputs reduce-scattered (the same bytes as the two all-reduces), and the head gathers the
    sequence back; the sequence length must be divisible by tp.

    Example:
        >>> gpt_plan()["blocks.*.attn.qkv"]
        Colwise(fused_chunks=3, gather_output=False, transposed=False, sequence_parallel=False)
    """
    sp = sequence_parallel
    plan: dict[str, Style] = {
        "tok_emb": VocabParallel(),
        "blocks.*.attn": Heads("n_heads"),
        "blocks.*.attn.qkv": Colwise(fused_chunks=3, sequence_parallel=sp),
        "blocks.*.attn.proj": Rowwise(sequence_parallel=sp),
        "blocks.*.mlp.fc": Colwise(sequence_parallel=sp),
        "blocks.*.mlp.proj": Rowwise(sequence_parallel=sp),
        "head": VocabParallelHead(tied_to="tok_emb" if tie_embeddings else None, sequence_parallel=sp),
    }
    if sp:
        plan.update({"blocks.0": ScatterSequence(), "blocks.*.ln1": SequenceParallel(), "blocks.*.ln2": SequenceParallel()})
        plan["ln_f"] = SequenceParallel()
    return plan


def _shard_dim(style: Style, param: str) -> int | None:
    """The dimension ``param`` of a module with ``style`` is split along (None: replicated)."""
    if isinstance(style, Colwise):
        return 0
    if isinstance(style, Rowwise):
        return 1 if param == "weight" else None
    if isinstance(style, (VocabParallel, VocabParallelHead)):
        return 0
    return None


def _styles_by_param(keys: list[str], plan: dict[str, Style]) -> dict[str, Style]:
    regexes = [(_pattern_regex(p), s) for p, s in plan.items() if not isinstance(s, Heads)]
    out = {}
    for key in keys:
        module = key.rpartition(".")[0]
        for regex, style in regexes:
            if regex.match(module):
                out[key] = style
    return out


def _fused_order(style: Style, n: int, tp: int) -> torch.Tensor | None:
    """Row permutation taking [chunk, rank, per] (dense) to [rank, chunk, per] (rank-major)."""
    if not isinstance(style, Colwise) or style.fused_chunks == 1:
        return None
    k = style.fused_chunks
    return torch.arange(n).view(k, tp, n // (k * tp)).transpose(0, 1).reshape(-1)


def _split_entries(
    sd: dict[str, torch.Tensor], plan: dict[str, Style]
) -> Iterator[tuple[str, torch.Tensor, Style | None, int | None]]:
    """``(key, tensor, style, dim)`` of each state-dict entry under ``plan``: the style that
    converts its module and the dimension it is split along (None: replicated)."""
    styles = _styles_by_param(list(sd), plan)
    for key, t in sd.items():
        style = styles.get(key)
        yield key, t, style, None if style is None else _shard_dim(style, key.rpartition(".")[2])


def shard_state_dict(dense_sd: dict[str, torch.Tensor], plan: dict[str, Style], ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """This rank's shards of a dense state dict, keyed like the tensor-parallelized model's.

    Only this rank's slice of each split tensor is copied; vocabulary-split tensors are padded
    with zero rows to a multiple of tp (as :class:`VocabParallelEmbedding`).

    Example:
        >>> tp_model.load_state_dict(shard_state_dict(torch.load("dense.pt"), gpt_plan(), ctx))
    """
    tp, r = ctx.size("tp"), ctx.rank("tp")
    out = {}
    for key, t, style, dim in _split_entries(dense_sd, plan):
        if dim is None:
            out[key] = t
            continue
        if getattr(style, "transposed", False) and t.dim() == 2:
            t = t.t()  # a Conv1D checkpoint's [in, out] -> the converted layer's [out, in]
        order = _fused_order(style, t.shape[0], tp)
        if order is not None:
            t = t[order]
        if isinstance(style, (VocabParallel, VocabParallelHead)):
            per = -(-t.shape[0] // tp)
            t = torch.cat([t, t.new_zeros(per * tp - t.shape[0], *t.shape[1:])])
        elif t.shape[dim] % tp:
            raise ValueError(f"{key}: dimension {dim} of size {t.shape[dim]} is not divisible by the tp size {tp}")
        out[key] = t.chunk(tp, dim)[r].clone()
    return out


def gather_state_dict(
    tp_sd: dict[str, torch.Tensor], plan: dict[str, Style], ctx: ParallelContext, *, vocab_sizes: dict[str, int] | None = None
) -> dict[str, torch.Tensor]:
    """The dense state dict from every tp rank's shards (all-gathers over tp; call on every rank).

    Args:
        tp_sd: this rank's state dict of a model converted with ``plan``.
        plan: the plan it was converted with.
        ctx: the parallel context.
        vocab_sizes: ``{key: V}`` for vocabulary-split tensors, whose zero padding is dropped
            (default: keep the padded rows).

    Example:
        >>> dense_sd = gather_state_dict(model.state_dict(), gpt_plan(), ctx, vocab_sizes={"tok_emb.weight": 59, "head.weight": 59})
    """
    tp = ctx.size("tp")
    out = {}
    for key, t, style, dim in _split_entries(tp_sd, plan):
        if dim is None:
            out[key] = t
            continue
        full = gather_along(t.detach(), dim, ctx.group("tp")) if tp > 1 else t
        order = _fused_order(style, full.shape[0], tp)
        if order is not None:
            full = full[torch.argsort(order)]
        if vocab_sizes and key in vocab_sizes:
            full = full[: vocab_sizes[key]]
        if getattr(style, "transposed", False) and full.dim() == 2:
            full = full.t().contiguous()  # back to the Conv1D checkpoint's [in, out]
        out[key] = full
    return out
