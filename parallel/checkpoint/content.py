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
which DCP deduplicates. On load each rank asks DCP for the pieces ITS layout needs, into
temporaries; nothing is written into the model or optimizer until every read succeeded.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel import DataParallel
from ..zero import ShardedDataParallel, ZeroOptimizer
from ..zero.pipeline_grads import PipelineShardedDataParallel
from .pieces import FlatPiece

__all__ = ["Layout", "layout_of", "save_content", "LoadPlan", "plan_load", "apply_load"]

#: group entries that select an implementation, not a hyperparameter: never restored from a
#: checkpoint (a FusedAdamW checkpoint loads into torch.optim.AdamW and back)
_IMPL_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable", "backend", "master_weights"})


@dataclass
class Layout:
    """How this process holds the model: ``kind`` is ``"zero"``, ``"data_parallel"`` or
    ``"module"``; ``distributed`` whether collectives run (over the world); ``rank``/``size``
    the dp rank and size."""

    kind: str
    module: nn.Module
    sdp: ShardedDataParallel | None
    distributed: bool
    rank: int
    size: int
    stage: int | None

    @property
    def names(self) -> dict[nn.Parameter, str]:
        """Param -> its first name (as ``named_parameters()``; tied params share it)."""
        names: dict[nn.Parameter, str] = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(p, n)  # insertion order = model order (consolidate indexes by it)
        return names


def layout_of(model: nn.Module, optimizer: Any) -> Layout:
    """Classify ``model``/``optimizer`` and check they match (TypeError/ValueError naming them)."""
    if isinstance(model, PipelineShardedDataParallel):
        # the writer/reader roles follow the dp rank, which every pp rank has: they would collide
        raise TypeError(
            "model: checkpoints of ZeRO under a pipeline (parallelize(pp=..., dp='zero1'|'zero2')) are not "
            "supported yet; save model.full_state_dict() on every pp rank instead"
        )
    if isinstance(model, ShardedDataParallel):
        if not isinstance(optimizer, ZeroOptimizer) or optimizer.sdp is not model:
            raise TypeError("optimizer: a ShardedDataParallel model needs its own ZeroOptimizer")
        size, rank = model.ctx.size("dp"), model.ctx.rank("dp")
        return Layout("zero", model.module, model, size > 1 or dist.is_initialized(), rank, size, model.stage)
    if isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"optimizer: a ZeroOptimizer needs its ShardedDataParallel model, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a ZeroOptimizer or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(model, DataParallel):
        size, rank = model.ctx.size("dp"), model.ctx.rank("dp")
        if dist.is_initialized() and size != dist.get_world_size():
            raise ValueError(f"model: the dp axis ({size}) must span the world ({dist.get_world_size()}) to checkpoint")
        return Layout("data_parallel", model.module, None, dist.is_initialized(), rank, size, None)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    on = dist.is_initialized()
    return Layout("module", model, None, on, dist.get_rank() if on else 0, dist.get_world_size() if on else 1, None)


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

    def piece(self, key: str, numel: int, offset: int, t: torch.Tensor) -> None:
        self.pieces.setdefault(key, (numel, []))[1].append((offset, t.reshape(-1)))


def _param_buckets(sdp: ShardedDataParallel) -> list[Any]:
    """Every bucket holding params: stage 3 also shards frozen params, in buckets of their own,
    and their full storage is freed between uses."""
    return sdp.param_buckets


def _bucket_params(sdp: ShardedDataParallel) -> set[nn.Parameter]:
    return {p for sb in _param_buckets(sdp) for p in sb.grad_bucket.params}


def model_meta(layout: Layout) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, str]]:
    """``{key: (shape, dtype)}`` of the module's state_dict and ``{alias: canonical key}`` of tied params."""
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
        shapes[k] = (tuple(v.shape), str(v.dtype).removeprefix("torch."))
    return shapes, aliases


def save_content(layout: Layout, optimizer: Any) -> Local:
    """This rank's DCP entries (pieces it owns, full tensors otherwise) and its metadata."""
    out = Local()
    names = layout.names
    shapes, aliases = model_meta(layout)
    sdp = layout.sdp
    owned = _bucket_params(sdp) if sdp is not None else set()
    for k, v in layout.module.state_dict(keep_vars=True).items():
        if k in shapes and not (isinstance(v, nn.Parameter) and v in owned):
            out.entries[f"model.{k}"] = v.detach().reshape(-1)
    if sdp is not None:
        _zero_content(sdp, optimizer, names, out)
    else:
        _plain_content(optimizer, names, out)
    return out


def _zero_content(sdp: ShardedDataParallel, opt: ZeroOptimizer, names: dict[nn.Parameter, str], out: Local) -> None:
    st = opt.state_dict()
    masters = st["master"] + [None] * (len(_param_buckets(sdp)) - len(st["master"]))
    for sb, master in zip(_param_buckets(sdp), masters):
        if sb.flat_param.dtype == torch.float32:
            master = None  # fp32 params are their own master (offload keeps a CPU copy of them too)
        local = sb.local_param_shard()
        for seg in sb.segments:
            p = sb.grad_bucket.params[seg.index]
            lo = seg.flat_offset - sb.start
            out.piece(f"model.{names[p]}", p.numel(), seg.tensor_offset, local.narrow(0, lo, seg.numel))
            if master is not None:
                out.piece(f"master.{names[p]}", p.numel(), seg.tensor_offset, master.narrow(0, lo, seg.numel))
    slots = opt.shard_slots()
    numel = {n: p.numel() for p, n in names.items()}
    inner = st["optimizer"]
    for i, (name, start, n) in enumerate(slots):
        for k, v in inner["state"].get(i, {}).items():
            if _elementwise(v, n):
                out.piece(f"optim.{name}.{k}", numel[name], start, v)
                out.elementwise.setdefault(name, []).append(k)
            else:
                out.scalars.setdefault(name, {})[k] = _scalar(v)
    for g in inner["param_groups"]:
        out.groups.append(({k: v for k, v in g.items() if k != "params"}, [slots[i][0] for i in g["params"]]))


def _plain_content(opt: torch.optim.Optimizer, names: dict[nn.Parameter, str], out: Local) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        if p not in names:
            raise ValueError(f"optimizer: holds a parameter (shape {tuple(p.shape)}) that is not in the model")
    sd = opt.state_dict()
    for i, p in enumerate(params):
        name = names[p]
        for k, v in sd["state"].get(i, {}).items():
            if k == "master_param":
                out.entries[f"master.{name}"] = v.detach().reshape(-1)
            elif _elementwise(v, p.numel()):
                out.entries[f"optim.{name}.{k}"] = v.detach().reshape(-1)
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
    """The dict handed to DCP: plain tensors and :class:`FlatPiece` carriers."""
    return {**local.entries, **{k: FlatPiece(n, chunks) for k, (n, chunks) in local.pieces.items()}}


# ---- load --------------------------------------------------------------------------------------
@dataclass
class LoadPlan:
    """What to read (``request``, temporaries only) and how to apply it afterwards."""

    request: dict[str, Any] = field(default_factory=dict)
    model: dict[str, torch.Tensor] = field(default_factory=dict)
    masters: list[torch.Tensor | None] = field(default_factory=list)
    master_from_ckpt: list[list[bool]] = field(default_factory=list)
    optim_state: dict[int, dict[str, Any]] = field(default_factory=dict)
    shards: list[torch.Tensor] = field(default_factory=list)  # stage 3: each param bucket's local shard
    errors: list[str] = field(default_factory=list)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def plan_load(layout: Layout, optimizer: Any, meta: dict[str, Any], saved: dict[str, tuple[int, ...]]) -> LoadPlan:
    """Validate the checkpoint against this layout and allocate the temporaries to read into.

    ``saved`` maps DCP keys to their stored size. Problems go to ``plan.errors`` (the caller
    agrees them over the ranks before any rank reads).
    """
    plan = LoadPlan()
    err = plan.errors.append
    shapes, _ = model_meta(layout)
    sharded = _bucket_params(layout.sdp) if layout.sdp is not None and layout.sdp.stage == 3 else set()
    by_name = dict(layout.module.state_dict(keep_vars=True))
    for k, (shape, dtype) in shapes.items():
        if k not in meta["shapes"]:
            err(f"model key {k!r}: not in the checkpoint (meta.pt lists {len(meta['shapes'])} model keys)")
        elif tuple(meta["shapes"][k][0]) != shape:
            err(f"model key {k!r}: shape {tuple(meta['shapes'][k][0])} in the checkpoint, {shape} in the model")
        elif f"model.{k}" not in saved:
            err(f"DCP key 'model.{k}': missing from the checkpoint's .metadata")
        elif by_name[k] not in sharded:
            plan.model[k] = torch.empty(shape, dtype=_dtype(dtype)).reshape(-1)
            plan.request[f"model.{k}"] = plan.model[k]
    for k in meta["shapes"]:
        if k not in shapes:
            err(f"checkpoint key 'model.{k}': the model has no such parameter or buffer")
    names = layout.names
    groups = meta["optim"]["groups"]
    if layout.sdp is not None:
        mine = [(g, [s[0] for s in _zero_group_slots(optimizer, gi)]) for gi, g in enumerate(optimizer.param_groups)]
    else:
        mine = [(g, [names.get(p, "?") for p in g["params"]]) for g in optimizer.param_groups]
    if len(mine) != len(groups):
        err(f"optimizer: {len(mine)} param groups here, {len(groups)} in the checkpoint (meta.pt)")
    else:
        for gi, ((_, ns), saved_g) in enumerate(zip(mine, groups)):
            exact = layout.sdp is None
            extra = set(ns) - set(saved_g["params"])
            if extra or (exact and set(ns) != set(saved_g["params"])):
                diff = sorted(extra or set(saved_g["params"]) - set(ns))
                err(f"optimizer: param group {gi} holds {diff[:3]} here but not in the checkpoint, or vice versa")
    if plan.errors:
        return plan
    if sharded:  # stage 3: only this rank's pieces of the params, into copies of its shards
        names = layout.names
        for sb in _param_buckets(layout.sdp):
            tmp = sb.local_param_shard().clone()
            for seg in sb.segments:
                p = sb.grad_bucket.params[seg.index]
                key = f"model.{names[p]}"
                _request_piece(plan, key, p.numel(), seg.tensor_offset, tmp.narrow(0, seg.flat_offset - sb.start, seg.numel))
            plan.shards.append(tmp)
    if layout.sdp is not None:
        _plan_zero(layout, optimizer, meta, saved, names, plan)
    else:
        _plan_plain(optimizer, meta, saved, names, plan)
    return plan


def _zero_group_slots(opt: ZeroOptimizer, gi: int) -> list[tuple[str, int, int]]:
    slots = opt.shard_slots()
    sizes = [len(g["params"]) for g in opt.param_groups]
    start = sum(sizes[:gi])
    return slots[start : start + sizes[gi]]


def _request_piece(plan: LoadPlan, key: str, numel: int, offset: int, t: torch.Tensor) -> None:
    cur = plan.request.get(key)
    chunks = list(cur._chunks) if isinstance(cur, FlatPiece) else []
    plan.request[key] = FlatPiece(numel, [*chunks, (offset, t)])


def _check(plan: LoadPlan, saved: dict[str, tuple[int, ...]], key: str, numel: int) -> bool:
    if key not in saved:
        plan.errors.append(f"DCP key {key!r}: missing from the checkpoint's .metadata")
        return False
    if tuple(saved[key]) != (numel,):
        plan.errors.append(f"DCP key {key!r}: {tuple(saved[key])} in the checkpoint, ({numel},) here")
        return False
    return True


def _plan_zero(layout: Layout, opt: ZeroOptimizer, meta: dict, saved: dict, names: dict, plan: LoadPlan) -> None:
    masters_saved = set(meta["masters"])
    offloaded = layout.sdp.offload is not None
    for sb in layout.sdp.sharded_buckets:
        # low-precision params have an fp32 master: on the device, or off it with offload
        # (sb.master is then None, but the saved master must still win over the rounded params)
        if sb.master is None and not (offloaded and sb.flat_param.dtype != torch.float32):
            plan.masters.append(None)
            plan.master_from_ckpt.append([])
            continue
        tmp = torch.empty(sb.shard, dtype=torch.float32, device=sb.local_param_shard().device)
        flags = []
        for seg in sb.segments:
            p = sb.grad_bucket.params[seg.index]
            key = f"master.{names[p]}"
            use = names[p] in masters_saved and _check(plan, saved, key, p.numel())
            if use:
                _request_piece(plan, key, p.numel(), seg.tensor_offset, tmp.narrow(0, seg.flat_offset - sb.start, seg.numel))
            flags.append(use)
        plan.masters.append(tmp)
        plan.master_from_ckpt.append(flags)
    numel = {n: p.numel() for p, n in names.items()}
    scalars, elementwise = meta["optim"]["scalars"], meta["optim"]["elementwise"]
    for i, (name, start, n) in enumerate(opt.shard_slots()):
        if name not in scalars and name not in elementwise:
            continue  # no state yet (saved before its first step)
        state = {k: _clone(v) for k, v in scalars.get(name, {}).items()}
        for k in elementwise.get(name, []):
            key = f"optim.{name}.{k}"
            if _check(plan, saved, key, numel[name]):
                state[k] = torch.empty(n, dtype=torch.float32, device=layout.sdp.ctx.device)
                _request_piece(plan, key, numel[name], start, state[k])
        plan.optim_state[i] = state


def _plan_plain(opt: torch.optim.Optimizer, meta: dict, saved: dict, names: dict, plan: LoadPlan) -> None:
    scalars, elementwise = meta["optim"]["scalars"], meta["optim"]["elementwise"]
    keeps_master = bool(getattr(opt, "master_weights", False))
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        name = names[p]
        if name not in scalars and name not in elementwise:
            continue
        state = {k: _clone(v) for k, v in scalars.get(name, {}).items()}
        for k in elementwise.get(name, []):
            key = f"optim.{name}.{k}"
            if _check(plan, saved, key, p.numel()):
                state[k] = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
                plan.request[key] = state[k]
        if keeps_master and p.dtype != torch.float32 and name in meta["masters"]:
            key = f"master.{name}"
            if _check(plan, saved, key, p.numel()):
                state["master_param"] = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
                plan.request[key] = state["master_param"]
        plan.optim_state[i] = state


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


def _hyper(group: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    return {**group, **{k: v for k, v in saved.items() if k in group and k not in _IMPL_KEYS}}


@torch.no_grad()
def apply_load(layout: Layout, optimizer: Any, meta: dict[str, Any], plan: LoadPlan) -> None:
    """Copy the read temporaries into the model, then the masters and optimizer state."""
    target = layout.module.state_dict(keep_vars=True)
    shapes, _ = model_meta(layout)
    for k, flat in plan.model.items():
        target[k].copy_(flat.view(shapes[k][0]))
    if plan.shards:
        # offload_params: the shards are host memory a staging copy may still read (CUDA)
        layout.sdp._shards.host_writable()
        for sb, tmp in zip(_param_buckets(layout.sdp), plan.shards):
            sb.local_param_shard().copy_(tmp)
    groups = meta["optim"]["groups"]
    if layout.sdp is not None:
        masters = []
        for sb, tmp, flags in zip(layout.sdp.sharded_buckets, plan.masters, plan.master_from_ckpt):
            if tmp is None:
                masters.append(None)
                continue
            base = sb.local_param_shard().float()  # no saved master (fp32 or plain-optimizer run): from the param
            for seg, use in zip(sb.segments, flags):
                if use:
                    lo = seg.flat_offset - sb.start
                    base.narrow(0, lo, seg.numel).copy_(tmp.narrow(0, lo, seg.numel))
            masters.append(base)
        inner = optimizer.optimizer.state_dict()
        inner = {
            "state": plan.optim_state,
            "param_groups": [_hyper(g, s["hyper"]) for g, s in zip(inner["param_groups"], groups)],
        }
        optimizer.load_state_dict({"zero": optimizer.state_dict()["zero"], "optimizer": inner, "master": masters})
    else:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = {i: {k: _shaped(v, params[i]) for k, v in s.items()} for i, s in plan.optim_state.items()}
        cur = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": [_hyper(g, s["hyper"]) for g, s in zip(cur, groups)]})


def _shaped(v: Any, p: torch.Tensor) -> Any:
    return v.view(p.shape) if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == p.numel() else v
