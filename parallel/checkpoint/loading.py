"""Loading a checkpoint into this process's layout: validate, read into temporaries, apply.

Each rank asks DCP for the pieces ITS layout needs (a ZeRO rank its flat shards, a tp rank its
slice of each dense tensor, a pipeline rank its blocks), into temporaries; nothing is written
into the model or optimizer until every read succeeded.

[Note: names across pipeline splits]
Under a pipeline the keys are the unsplit ``nn.Sequential(*blocks)``'s (``"<block>.<name>"``),
so a checkpoint loads into another pp split of the same blocks. A parameter tied across stages
(an embedding and the head) has one copy per pp rank, each saved under its own key; a layout
that holds both in one module (pp 1) sees one of them as an alias, and a layout that holds a
copy whose key the checkpoint only lists as an alias (saved at pp 1) reads the canonical key:
:func:`ckpt_name` maps either way (the copies are equal: the pipeline keeps them in sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .content import _IMPL_KEYS, Layout, _bucket_params, _param_buckets, model_meta
from .pieces import FlatPiece

__all__ = ["LoadPlan", "plan_load", "apply_load", "ckpt_name"]


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


def ckpt_name(meta: dict[str, Any], name: str) -> str:
    """The checkpoint's name for this layout's key ``name`` (see [Note: names across pipeline splits])."""
    if name in meta["shapes"]:
        return name
    return meta["aliases"].get(name, name)


def plan_load(
    layout: Layout,
    optimizer: Any,
    meta: dict[str, Any],
    saved: dict[str, tuple[int, ...]],
    world_keys: set[str],
    optimizer_state: bool = True,
) -> LoadPlan:
    """Validate the checkpoint against this layout and allocate the temporaries to read into.

    Args:
        layout: this process's layout.
        optimizer: its optimizer.
        meta: the checkpoint's ``meta.pt``.
        saved: DCP keys -> their stored size.
        world_keys: every model key (and alias) held by any rank (the union over pipeline ranks).
        optimizer_state: read the optimizer's state and hyperparameters too (False: the params
            and their fp32 masters only; the groups need not match the checkpoint's).

    Returns:
        The plan; problems go to ``plan.errors`` (the caller agrees them over the ranks before
        any rank reads).
    """
    plan = LoadPlan()
    err = plan.errors.append
    shapes, _ = model_meta(layout)
    sharded = _bucket_params(layout.sdp) if layout.sdp is not None and layout.sdp.stage == 3 else set()
    by_name = dict(layout.module.state_dict(keep_vars=True))
    for k, (shape, dtype) in shapes.items():
        ck = ckpt_name(meta, k)
        if ck not in meta["shapes"]:
            err(f"model key {k!r}: not in the checkpoint (meta.pt lists {len(meta['shapes'])} model keys)")
        elif tuple(meta["shapes"][ck][0]) != shape:
            err(f"model key {k!r}: shape {tuple(meta['shapes'][ck][0])} in the checkpoint, {shape} in the model")
        elif f"model.{ck}" not in saved:
            err(f"DCP key 'model.{ck}': missing from the checkpoint's .metadata")
        elif by_name[k] not in sharded:
            v = by_name[k]
            plan.model[k] = torch.zeros(v.shape, dtype=_dtype(dtype)).reshape(-1)  # zeros: tp padding stays 0
            _request(plan, layout, v, f"model.{ck}", 0, plan.model[k])
    for k in meta["shapes"]:
        if k not in world_keys:
            err(f"checkpoint key 'model.{k}': the model has no such parameter or buffer")
    saved_pp = meta.get("axes", {}).get("pp", 1)
    if plan.errors and saved_pp != layout.axes["pp"]:  # first: the likeliest cause of the key errors after it
        plan.errors.insert(
            0,
            f"pp: the checkpoint was saved at pp {saved_pp}, this run has pp {layout.axes['pp']}; another pp "
            "split loads only when both key the blocks alike (the unsplit nn.Sequential(*blocks)'s keys)",
        )
    names = layout.names
    groups = meta["optim"]["groups"]
    if layout.sdp is not None:
        members = optimizer.group_members()
        mine = [(g, [names[p] for p in members[gi]]) for gi, g in enumerate(optimizer.param_groups)]
    else:
        mine = [(g, [names.get(p, "?") for p in g["params"]]) for g in optimizer.param_groups]
    if not optimizer_state:
        pass  # the weights only: the optimizer may be another one, with other groups
    elif len(mine) != len(groups):
        err(f"optimizer: {len(mine)} param groups here, {len(groups)} in the checkpoint (meta.pt)")
    else:
        for gi, ((_, ns), saved_g) in enumerate(zip(mine, groups)):
            exact = layout.sdp is None and layout.whole
            ns = {ckpt_name(meta, n) for n in ns}
            extra = ns - set(saved_g["params"])
            if extra or (exact and ns != set(saved_g["params"])):
                diff = sorted(extra or set(saved_g["params"]) - ns)
                err(f"optimizer: param group {gi} holds {diff[:3]} here but not in the checkpoint, or vice versa")
    if plan.errors:
        return plan
    if sharded:  # stage 3: only this rank's pieces of the params, into copies of its shards
        for sb in _param_buckets(layout.sdp):
            tmp = sb.local_param_shard().clone()
            for seg in sb.segments:
                p = sb.grad_bucket.params[seg.index]
                key = f"model.{ckpt_name(meta, names[p])}"
                _request(plan, layout, p, key, seg.tensor_offset, tmp.narrow(0, seg.flat_offset - sb.start, seg.numel))
            plan.shards.append(tmp)
    if layout.sdp is not None:
        _plan_zero(layout, optimizer, meta, saved, names, plan, optimizer_state)
    else:
        _plan_plain(layout, optimizer, meta, saved, names, plan, optimizer_state)
    return plan


def _request(plan: LoadPlan, layout: Layout, p: torch.Tensor, key: str, offset: int, t: torch.Tensor) -> None:
    """Ask for ``t`` = local flat elements ``[offset, ...)`` of ``p``: its chunks of the dense tensor."""
    chunks = layout.pieces(p, offset, t.reshape(-1))
    if not chunks:
        return  # tp padding only: stays zero
    cur = plan.request.get(key)
    held = list(cur._chunks) if isinstance(cur, FlatPiece) else []
    plan.request[key] = FlatPiece(layout.full_numel(p), [*held, *chunks])


def _check(plan: LoadPlan, saved: dict[str, tuple[int, ...]], key: str, numel: int) -> bool:
    if key not in saved:
        plan.errors.append(f"DCP key {key!r}: missing from the checkpoint's .metadata")
        return False
    if tuple(saved[key]) != (numel,):
        plan.errors.append(f"DCP key {key!r}: {tuple(saved[key])} in the checkpoint, ({numel},) here")
        return False
    return True


def _plan_zero(layout: Layout, opt: Any, meta: dict, saved: dict, names: dict, plan: LoadPlan, optimizer_state: bool) -> None:
    masters_saved = set(meta["masters"])
    offloaded = layout.sdp.offload is not None
    for sb in layout.sdp.sharded_buckets:
        # low-precision params have an fp32 master: on the device, or off it with offload
        # (sb.master is then None, but the saved master must still win over the rounded params)
        if sb.master is None and not (offloaded and sb.flat_param.dtype != torch.float32):
            plan.masters.append(None)
            plan.master_from_ckpt.append([])
            continue
        tmp = torch.zeros(sb.shard, dtype=torch.float32, device=sb.local_param_shard().device)
        flags = []
        for seg in sb.segments:
            p = sb.grad_bucket.params[seg.index]
            name = ckpt_name(meta, names[p])
            key = f"master.{name}"
            use = name in masters_saved and _check(plan, saved, key, layout.full_numel(p))
            if use:
                _request(plan, layout, p, key, seg.tensor_offset, tmp.narrow(0, seg.flat_offset - sb.start, seg.numel))
            flags.append(use)
        plan.masters.append(tmp)
        plan.master_from_ckpt.append(flags)
    if not optimizer_state:
        return
    by_name = {n: p for p, n in names.items()}
    scalars, elementwise = meta["optim"]["scalars"], meta["optim"]["elementwise"]
    for i, (mine, start, n) in enumerate(opt.shard_slots()):
        name, p = ckpt_name(meta, mine), by_name[mine]
        if name not in scalars and name not in elementwise:
            continue  # no state yet (saved before its first step)
        state = {k: _clone(v) for k, v in scalars.get(name, {}).items()}
        for k in elementwise.get(name, []):
            key = f"optim.{name}.{k}"
            if _check(plan, saved, key, layout.full_numel(p)):
                state[k] = torch.zeros(n, dtype=torch.float32, device=layout.sdp.ctx.device)
                _request(plan, layout, p, key, start, state[k])
        plan.optim_state[i] = state


def _plan_plain(
    layout: Layout, opt: torch.optim.Optimizer, meta: dict, saved: dict, names: dict, plan: LoadPlan, optimizer_state: bool
) -> None:
    scalars, elementwise = meta["optim"]["scalars"], meta["optim"]["elementwise"]
    keeps_master = bool(getattr(opt, "master_weights", False))
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        name = ckpt_name(meta, names[p])
        if name not in scalars and name not in elementwise:
            continue
        state = {k: _clone(v) for k, v in scalars.get(name, {}).items()} if optimizer_state else {}
        for k in elementwise.get(name, []) if optimizer_state else []:
            key = f"optim.{name}.{k}"
            if _check(plan, saved, key, layout.full_numel(p)):
                state[k] = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                _request(plan, layout, p, key, 0, state[k])
        if keeps_master and p.dtype != torch.float32 and name in meta["masters"]:
            key = f"master.{name}"
            if _check(plan, saved, key, layout.full_numel(p)):
                state["master_param"] = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                _request(plan, layout, p, key, 0, state["master_param"])
        plan.optim_state[i] = state


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


def _hyper(group: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    return {**group, **{k: v for k, v in saved.items() if k in group and k not in _IMPL_KEYS}}


@torch.no_grad()
def apply_load(layout: Layout, optimizer: Any, meta: dict[str, Any], plan: LoadPlan, optimizer_state: bool = True) -> None:
    """Copy the read temporaries into the model, then the masters and (``optimizer_state``) the
    optimizer state; without it the optimizer keeps its own state (a fused optimizer's fp32
    ``master_param`` is still replaced where it has one)."""
    target = layout.module.state_dict(keep_vars=True)
    for k, flat in plan.model.items():
        target[k].copy_(flat.view(target[k].shape))
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
        if optimizer_state:
            inner = {
                "state": plan.optim_state,
                "param_groups": [_hyper(g, s["hyper"]) for g, s in zip(inner["param_groups"], groups)],
            }
        optimizer.load_state_dict({"zero": optimizer.state_dict()["zero"], "optimizer": inner, "master": masters})
    elif not optimizer_state:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, s in plan.optim_state.items():
            held = optimizer.state.get(params[i], {})
            if "master_param" in s and "master_param" in held:  # not stepped yet: made from the param
                held["master_param"].copy_(_shaped(s["master_param"], params[i]))
    else:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = {i: {k: _shaped(v, params[i]) for k, v in s.items()} for i, s in plan.optim_state.items()}
        cur = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": [_hyper(g, s["hyper"]) for g, s in zip(cur, groups)]})


def _shaped(v: Any, p: torch.Tensor) -> Any:
    return v.view(p.shape) if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == p.numel() else v
