"""What a checkpoint holds, independent of the layout that wrote it, and each layout's view of it.

Every tensor is stored as its full *flattened* 1-D logical tensor under one DCP key:

=========================  ==================================================================
key                        content
=========================  ==================================================================
``model.<key>``            each entry of the unwrapped module's ``state_dict()`` (params in
                           their dtype, buffers); tied params are stored once (``aliases``)
``master.<param>``         the fp32 master of a bf16/fp16 param (ZeRO masters, or a fused
                           optimizer's ``master_param``); absent for fp32 params
``optim.<param>.<state>``  elementwise optimizer state (``exp_avg``, ``exp_avg_sq``,
                           ``momentum_buffer``, ...), full logical size
=========================  ==================================================================

and a small pickled ``meta`` (shapes, dtypes, per-param scalar state such as ``step``, the
param groups' hyperparameters and member names, the loss-scaler state, ``extra``). A ZeRO rank
contributes only its :class:`~shardkit.parallel.checkpoint.pieces.FlatPiece` of each key, so
every element is written once; DataParallel and single-process runs contribute full tensors,
which DCP deduplicates. A tp rank contributes its slices as chunks of the dense tensors (see
[Note: TP slices in the checkpoint]); a pipeline rank its blocks, keyed by block index. On load each rank asks DCP for the pieces ITS layout needs, into
temporaries; nothing is written into the model or optimizer until every read succeeded.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..compose import ParallelModel
from ..data_parallel import DataParallel
from ..zero import ShardedDataParallel, ZeroOptimizer
from ..zero.pipeline_sharded import PipelineShardedDataParallel
from .pieces import FlatPiece
from .tp import TPSlice, tp_size, tp_slices

__all__ = ["Layout", "layout_of", "save_content", "merge_meta", "merge_model_meta", "dcp_state"]

#: group entries that select an implementation, not a hyperparameter: never restored from a
#: checkpoint (a FusedAdamW checkpoint loads into torch.optim.AdamW and back)
_IMPL_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable", "backend", "master_weights"})


@dataclass
class Layout:
    """How this process holds the model.

    Attributes:
        kind: ``"zero"``, ``"data_parallel"`` or ``"module"`` (a plain, TP-converted or
            pipeline-stage module, whose optimizer is a ``torch.optim.Optimizer``).
        module: the unwrapped module whose ``state_dict`` keys name the checkpoint's tensors
            (with a pipeline: this rank's blocks keyed by block index).
        sdp: the ZeRO wrapper, or None.
        distributed: whether collectives run (over the world).
        rank, size: the GLOBAL rank and world size: the roles (the one metadata writer, each
            rank's share of the checksums) are per process, whatever the dp × tp × pp layout.
        stage: the ZeRO stage, or None.
        axes: ``{"dp", "tp", "pp"}`` sizes (recorded in the manifest and meta).
        tp: this rank's tp-sharded parameters and their place in the dense tensors.
        whole: whether this rank holds every parameter of the model (False under a pipeline).
    """

    kind: str
    module: nn.Module
    sdp: ShardedDataParallel | None
    distributed: bool
    rank: int
    size: int
    stage: int | None
    axes: dict[str, int] = field(default_factory=lambda: {"dp": 1, "tp": 1, "pp": 1})
    tp: dict[nn.Parameter, TPSlice] = field(default_factory=dict)
    whole: bool = True

    @property
    def names(self) -> dict[nn.Parameter, str]:
        """Param -> its first name (as ``named_parameters()``; tied params share it)."""
        names: dict[nn.Parameter, str] = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(p, n)  # insertion order = model order (consolidate indexes by it)
        return names

    def full_numel(self, p: torch.Tensor) -> int:
        """Elements of ``p``'s dense tensor (its tp slice's full tensor, or ``p`` itself)."""
        s = self.tp.get(p)
        return s.full_numel if s is not None else p.numel()

    def full_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        s = self.tp.get(p)
        return s.full_shape if s is not None else tuple(p.shape)

    def pieces(self, p: torch.Tensor, offset: int, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``t`` (local flat elements ``[offset, offset + numel)`` of ``p``) as chunks of the
        dense flattened tensor (see [Note: TP slices in the checkpoint])."""
        s = self.tp.get(p)
        return s.pieces(offset, t) if s is not None else [(offset, t)]


def _world() -> tuple[bool, int, int]:
    on = dist.is_initialized()
    return on, (dist.get_rank() if on else 0), (dist.get_world_size() if on else 1)


def layout_of(model: Any, optimizer: Any) -> Layout:
    """Classify ``model``/``optimizer`` and check they match (TypeError/ValueError naming them).

    ``model`` may be a :class:`~shardkit.parallel.ParallelModel` (any dp × tp × pp layout), a
    ZeRO wrapper (also :class:`PipelineShardedDataParallel`), a DataParallel or a plain module.
    """
    if isinstance(model, ParallelModel):
        ctx = model.ctx
        axes = {"dp": ctx.size("dp_cp"), "tp": ctx.size("tp"), "pp": ctx.size("pp")} if ctx is not None else None
        if model.pipeline is not None and model.strategy is None:
            # ddp (or no dp) under a pipeline: the stages are a ModuleList whose positional keys
            # repeat on every pp rank; key this rank's blocks by block index instead, as the
            # ZeRO wrapper does (the unsplit nn.Sequential(*blocks)'s keys, disjoint over pp)
            return _plain(model.pipeline.held_blocks(), optimizer, "module", axes, whole=False)
        return layout_of(model.module, optimizer) if axes is None else _with_axes(layout_of(model.module, optimizer), axes)
    if isinstance(model, ShardedDataParallel):
        if not isinstance(optimizer, ZeroOptimizer) or optimizer.sdp is not model:
            raise TypeError("optimizer: a ShardedDataParallel model needs its own ZeroOptimizer")
        pp = model.pipeline_ctx.size("pp") if isinstance(model, PipelineShardedDataParallel) else 1
        on, rank, size = _world()
        # cp ranks hold replicas too: the checkpoint's dp counts every replica ([Note: the dp_cp group])
        axes = {"dp": model.ctx.size("dp_cp"), "tp": model.ctx.size("tp"), "pp": pp}
        return Layout("zero", model.module, model, on, rank, size, model.stage, axes, tp_slices(model.module), pp == 1)
    if isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"optimizer: a ZeroOptimizer needs its ShardedDataParallel model, got {type(model).__name__}")
    if isinstance(model, DataParallel):
        axes = {"dp": model.ctx.size("dp_cp"), "tp": model.ctx.size("tp"), "pp": model.ctx.size("pp")}
        if axes["pp"] > 1:
            raise ValueError("model: a DataParallel over one pipeline stage; pass the ParallelModel that parallelize() returned")
        return _plain(model.module, optimizer, "data_parallel", axes)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a ParallelModel, got {type(model).__name__}")
    return _plain(model, optimizer, "module", None)


def _with_axes(layout: Layout, axes: dict[str, int]) -> Layout:
    layout.axes = axes
    return layout


def _plain(module: nn.Module, optimizer: Any, kind: str, axes: dict[str, int] | None, whole: bool = True) -> Layout:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a ZeroOptimizer or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    on, rank, size = _world()
    slices = tp_slices(module)
    if axes is None:  # a plain module: replicated over the world, or tp-sharded over all of it
        tp = tp_size(module)
        axes = {"dp": size // tp, "tp": tp, "pp": 1}
    return Layout(kind, module, None, on, rank, size, None, axes, slices, whole)


def _elementwise(v: Any, numel: int) -> bool:
    """A state entry with one value per element of its parameter (``exp_avg``), not a scalar."""
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() == numel


def _scalar(v: Any) -> Any:
    return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v


@dataclass
class Local:
    """One rank's contribution: DCP entries and the small metadata merged over ranks."""

    entries: dict[str, Any] = field(default_factory=dict)
    pieces: dict[str, tuple[int, list[tuple[int, torch.Tensor]]]] = field(default_factory=dict)
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)
    elementwise: dict[str, list[str]] = field(default_factory=dict)
    groups: list[tuple[dict[str, Any], list[str]]] = field(default_factory=list)
    shapes: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    transposed: list[str] = field(default_factory=list)

    def piece(self, layout: Layout, p: torch.Tensor, key: str, offset: int, t: torch.Tensor) -> None:
        """Add ``t`` (local flat elements ``[offset, ...)`` of ``p``) to ``key``'s dense chunks."""
        for o, chunk in layout.pieces(p, offset, t.reshape(-1)):
            self.pieces.setdefault(key, (layout.full_numel(p), []))[1].append((o, chunk))

    def whole(self, layout: Layout, p: torch.Tensor, key: str, t: torch.Tensor) -> None:
        """Add all of ``t`` (shaped like ``p``): a full entry, or ``p``'s tp slice as chunks."""
        if p in layout.tp:
            self.piece(layout, p, key, 0, t.detach())
        else:
            self.entries[key] = t.detach().reshape(-1)

    def meta(self) -> Local:
        """This rank's metadata only (what the ranks all-gather)."""
        return Local(
            scalars=self.scalars,
            elementwise=self.elementwise,
            groups=self.groups,
            shapes=self.shapes,
            aliases=self.aliases,
            order=self.order,
            transposed=self.transposed,
        )


def _param_buckets(sdp: ShardedDataParallel) -> list[Any]:
    """Every bucket holding params: stage 3 also shards frozen params, in buckets of their own,
    and their full storage is freed between uses."""
    return sdp.param_buckets


def _bucket_params(sdp: ShardedDataParallel) -> set[nn.Parameter]:
    return {p for sb in _param_buckets(sdp) for p in sb.grad_bucket.params}


def model_meta(layout: Layout) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, str]]:
    """``{key: (dense shape, dtype)}`` of the module's state_dict and ``{alias: canonical key}``
    of tied params (on this rank: under a pipeline, of its blocks only)."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for k, v in layout.module.state_dict(keep_vars=True).items():
        if not isinstance(v, torch.Tensor):
            continue
        if id(v) in first:
            aliases[k] = first[id(v)]
            continue
        first[id(v)] = k
        shapes[k] = (layout.full_shape(v), str(v.dtype).removeprefix("torch."))
    return shapes, aliases


def transposed_keys(module: nn.Module) -> list[str]:
    """The state_dict keys whose tensors are held transposed relative to the module the user
    built: a Hugging Face ``Conv1D`` weight (``[in, out]``) that a TP plan turned into a linear
    layer (``[out, in]``).

    [Note: Conv1D weights in checkpoints]
    A checkpoint stores each parameter dense in the layout the run holds it, so a TP-converted
    ``Conv1D`` weight is stored ``[out, in]`` while the same model at tp 1 (or in Hugging Face's
    hands) holds ``[in, out]``. The meta lists these keys (``"transposed"``): ``shardkit
    consolidate`` and ``fp32_state_dict`` give them back in the module's own layout, and a load
    into a run that holds a listed key the other way round is refused by name (a square weight
    would otherwise load transposed without any shape error).

    Example:
        >>> transposed_keys(tensor_parallelize(gpt2, ctx, hf_gpt2_plan(gpt2)))[:1]
        ['transformer.h.0.attn.c_attn.weight']
    """
    return [k for k, v in module.state_dict(keep_vars=True).items() if getattr(v, "_dense_transposed", False)]


def merge_model_meta(locals_: list[Local]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Every rank's ``(shapes, aliases, param order)`` merged: the union (pipeline ranks hold
    disjoint blocks), keys in block order when they are keyed by block index."""
    shapes: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    order: list[str] = []
    for loc in locals_:
        shapes.update(loc.shapes)
        order += loc.order
    for loc in locals_:  # a copy of a tied param another rank stores under its own key is no alias
        aliases.update({a: c for a, c in loc.aliases.items() if a not in shapes})
    order = list(dict.fromkeys(order))
    if all(n.split(".", 1)[0].isdigit() for n in order):
        order.sort(key=lambda n: int(n.split(".", 1)[0]))  # stable: model order within a block
    return shapes, aliases, order


def save_content(layout: Layout, optimizer: Any) -> Local:
    """This rank's DCP entries (pieces it owns, full tensors otherwise) and its metadata."""
    out = Local()
    names = layout.names
    out.shapes, out.aliases = model_meta(layout)
    out.transposed = transposed_keys(layout.module)
    out.order = list(dict.fromkeys(names.values()))
    sdp = layout.sdp
    owned = _bucket_params(sdp) if sdp is not None else set()
    # Under ZeRO, what every dp rank holds whole (buffers, params outside the buckets) is written
    # by dp rank 0 alone: buffers such as BatchNorm's running statistics may differ between the
    # replicas, and DCP would otherwise keep each key from whichever rank its dedup picks, mixing
    # ranks within one module. DeepSpeed saves rank 0's too.
    replica_lead = sdp is None or sdp.ctx.rank("dp_cp") == 0
    for k, v in layout.module.state_dict(keep_vars=True).items():
        if k in out.shapes and not (isinstance(v, nn.Parameter) and v in owned) and replica_lead:
            out.whole(layout, v, f"model.{k}", v)
    if sdp is not None:
        _zero_content(layout, optimizer, names, out)
    else:
        _plain_content(layout, optimizer, names, out)
    return out


def _zero_content(layout: Layout, opt: ZeroOptimizer, names: dict[nn.Parameter, str], out: Local) -> None:
    sdp = layout.sdp
    st = opt.state_dict()
    masters = st["master"] + [None] * (len(_param_buckets(sdp)) - len(st["master"]))
    for sb, master in zip(_param_buckets(sdp), masters):
        if sb.flat_param.dtype == torch.float32:
            master = None  # fp32 params are their own master (offload keeps a CPU copy of them too)
        local = sb.local_param_shard()
        for seg in sb.segments:
            p = sb.grad_bucket.params[seg.index]
            lo = seg.flat_offset - sb.start
            out.piece(layout, p, f"model.{names[p]}", seg.tensor_offset, local.narrow(0, lo, seg.numel))
            if master is not None:
                out.piece(layout, p, f"master.{names[p]}", seg.tensor_offset, master.narrow(0, lo, seg.numel))
    slots = opt.shard_slots()
    by_name = {n: p for p, n in names.items()}
    inner = st["optimizer"]
    for i, (name, start, n) in enumerate(slots):
        for k, v in inner["state"].get(i, {}).items():
            if _elementwise(v, n):
                out.piece(layout, by_name[name], f"optim.{name}.{k}", start, v)
                out.elementwise.setdefault(name, []).append(k)
            else:
                out.scalars.setdefault(name, {})[k] = _scalar(v)
    # members from the optimizer's resolved groups, not from this rank's shard slots: a zero-size
    # param holds no slot anywhere, yet torch.optim (and so a load without ZeRO) has it in its group
    for g, members in zip(inner["param_groups"], opt.group_members(), strict=True):
        out.groups.append(({k: v for k, v in g.items() if k != "params"}, [names[p] for p in members]))


def _plain_content(layout: Layout, opt: torch.optim.Optimizer, names: dict[nn.Parameter, str], out: Local) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        if p not in names:
            raise ValueError(f"optimizer: holds a parameter (shape {tuple(p.shape)}) that is not in the model")
    sd = opt.state_dict()
    for i, p in enumerate(params):
        name = names[p]
        for k, v in sd["state"].get(i, {}).items():
            if k == "master_param":
                out.whole(layout, p, f"master.{name}", v)
            elif _elementwise(v, p.numel()):
                out.whole(layout, p, f"optim.{name}.{k}", v)
                out.elementwise.setdefault(name, []).append(k)
            else:
                out.scalars.setdefault(name, {})[k] = _scalar(v)
    for g in opt.param_groups:
        out.groups.append(({k: v for k, v in g.items() if k != "params"}, [names[p] for p in g["params"]]))


def merge_meta(locals_: list[Local], order: list[str]) -> dict[str, Any]:
    """Merge every rank's optimizer metadata (rank 0's hyperparameters; member names in model order)."""
    rank_of = {n: i for i, n in enumerate(order)}
    scalars: dict[str, dict[str, Any]] = {}
    elementwise: dict[str, list[str]] = {}
    members: dict[int, set[str]] = defaultdict(set)
    for loc in locals_:
        for n, s in loc.scalars.items():
            scalars.setdefault(n, s)
        for n, ks in loc.elementwise.items():
            elementwise.setdefault(n, ks)
        for gi, (_, ns) in enumerate(loc.groups):
            members[gi].update(ns)
    groups = [
        {"hyper": hyper, "params": sorted(members[gi], key=rank_of.__getitem__)}
        for gi, (hyper, _) in enumerate(locals_[0].groups)
    ]
    return {"groups": groups, "scalars": scalars, "elementwise": elementwise}


def dcp_state(local: Local) -> dict[str, Any]:
    """The dict handed to DCP: plain tensors and :class:`FlatPiece` carriers (a key whose every
    element on this rank is tp padding has no chunk: left out)."""
    return {**local.entries, **{k: FlatPiece(n, chunks) for k, (n, chunks) in local.pieces.items() if chunks}}
