"""Gradient post-processing across ranks: fused unscale + inf/nan check, clip by global norm.

Two groups matter and they are different:

* ``group`` — ranks that must *agree* on an overflow (every rank skips the same step). For DDP
  that is the dp group; the flag is all-reduced with ``max`` (one 4-byte collective).
* ``norm_group`` — ranks across which the gradients are *partitioned* (ZeRO shards, tensor-
  parallel slices): their squared norms are summed. DDP replicas hold identical grads after the
  all-reduce, so for DDP the local norm is already global: leave ``norm_group=None``.

Naming scheme for unscale/clip functions (torch's names at the top):

==============================  ===========================  ==================================
level                           takes                        names
==============================  ===========================  ==================================
public, ``shardkit.parallel``   parameters (reads ``.grad``)  ``clip_grad_norm_`` (as
                                may communicate over a        ``torch.nn.utils``),
                                group                         ``DynamicLossScaler.unscale_`` (as
                                                              ``torch.amp.GradScaler``), and
                                                              ``unscale_grads_`` under it
kernels, ``shardkit.kernels``   lists of grad tensors, one    ``unscale_and_norm_``,
``.grad_epilogue``              device/dtype, no collective   ``clip_grads_``, ``clip_coef``
==============================  ===========================  ==================================

A trailing ``_`` means the function writes the gradients in place (torch's convention);
``clip_coef`` only computes. ``grad``/``grads`` in a name: it acts on gradients, never on
parameters. Kernel names describe the fused pass (``unscale_and_norm_``: unscale, flag inf/nan,
accumulate Σg²); public names say what the caller asks for.

This module owns :class:`OverflowReport`; :mod:`.loss_scaler` imports from here, never the
reverse.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardkit.comm import CommStats, all_reduce
from shardkit.kernels.grad_epilogue import clip_grads_, unscale_and_norm_
from shardkit.kernels.layout import is_dense

__all__ = ["OverflowReport", "UnscaledGrads", "agree_and_clip_", "unscale_grads_", "clip_grad_norm_"]


@dataclass
class OverflowReport:
    """Outcome of :func:`unscale_grads_` (and :meth:`DynamicLossScaler.unscale_`).

    Attributes:
        overflow: an inf/nan gradient was found on some rank of the group.
        grad_norm: global L2 norm of the unscaled gradients (``inf`` on overflow).
        nonfinite: names (or indices) of this rank's params with inf/nan grads, when requested.
    """

    overflow: bool
    grad_norm: float
    nonfinite: list[str] = field(default_factory=list)


def _by_dtype(named: Sequence[tuple[str, torch.Tensor]]) -> dict[torch.dtype, list[tuple[str, torch.Tensor]]]:
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    devices = set()
    for name, p in named:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise TypeError(f"sparse gradients are not supported (param {name})")
        devices.add(p.grad.device)
        groups.setdefault(p.grad.dtype, []).append((name, p))
    if len(devices) > 1:
        raise ValueError(f"all gradients must be on one device per rank, found {sorted(map(str, devices))}")
    return groups


@dataclass
class UnscaledGrads:
    """Gradients a strategy already averaged, unscaled and measured in its copy-back pass.

    ``DataParallel(loss_scaler=...)`` multiplies each all-reduced bucket by ``1 / (dp * S)`` on
    its way into ``p.grad`` and accumulates the inf/nan flag and Σg² in the same pass; it hands
    this record to the scaler (:meth:`DynamicLossScaler.expect_unscaled`), and
    :func:`unscale_grads_` then skips those grads instead of reading and writing them again.

    Attributes:
        loss_scale: the S the grads were divided by.
        grads: ``id(param) -> (param, grad, grad._version)`` when the pass wrote ``grad``; a
            later change to ``p.grad`` (another tensor, or an in-place write) is detected.
        found_inf: fp32 ``[1]``, 1.0 if any of these grads holds an inf/nan (this rank).
        sumsq: fp32 ``[1]``, Σg² of these grads after unscaling.
    """

    loss_scale: float
    grads: dict[int, tuple[torch.Tensor, torch.Tensor, int]]
    found_inf: torch.Tensor
    sumsq: torch.Tensor


def _grads(items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each grad as a tensor the kernels take (contiguous), without changing ``p.grad``'s layout
    when it is dense (channels_last): such a grad is passed as a flat alias of its memory."""
    out = []
    for _, p in items:
        g = p.grad
        if not g.is_contiguous():
            if is_dense(g):  # every element once, from storage_offset on: a 1-D alias is exact
                g = g.as_strided((g.numel(),), (1,))
            else:
                p.grad = g = g.contiguous()
        out.append(g)
    return out


def _split_unscaled(
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]], unscaled: UnscaledGrads | None
) -> tuple[list[tuple[str, torch.Tensor]], dict[torch.dtype, list[tuple[str, torch.Tensor]]]]:
    """``(done, todo)``: params whose grads ``unscaled`` covers, and the rest (by dtype)."""
    if unscaled is None:
        return [], groups
    done: list[tuple[str, torch.Tensor]] = []
    todo: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for dtype, items in groups.items():
        for name, p in items:
            entry = unscaled.grads.get(id(p))
            if entry is None or entry[0] is not p:
                todo.setdefault(dtype, []).append((name, p))
                continue
            if p.grad is not entry[1] or p.grad._version != entry[2]:
                raise RuntimeError(
                    f"the grad of {name} changed after DataParallel(loss_scaler=...) averaged and "
                    "unscaled it at the end of backward (it holds unscaled values from then on); "
                    "change grads after scaler.unscale_(), not between backward and unscale_()"
                )
            done.append((name, p))
    return done, todo


@torch.no_grad()
def agree_and_clip_(
    sumsq: torch.Tensor,
    found_inf: torch.Tensor | None = None,
    *,
    sum_over: Sequence[Any] = (),
    flag_over: Any = None,
    riders: torch.Tensor | None = None,
    max_norm: float | None = None,
    grads: Sequence[Sequence[torch.Tensor]] = (),
    backend: str = "auto",
    stats: CommStats | None = None,
) -> tuple[bool, torch.Tensor]:
    """The one place a step's gradients become final: agree the inf/nan flag and the global Σg²
    across ranks, decide overflow, clip.

    Every unscale/clip path calls this after its own local pass (which unscales and measures
    the grads as they are laid out there: :func:`unscale_grads_` and :func:`clip_grad_norm_`
    over ``p.grad``, :func:`~shardkit.parallel.tensor.unscale_and_clip_model_parallel_` with
    tensor-parallel weights, ZeRO's epilogue over its flat shards).

    ``[found_inf, Σg²]`` is summed over each group of ``sum_over`` in turn (the axes across
    which the grads are partitioned: ZeRO's dp, tp, pp), one all-reduce each; then the flag
    alone takes the ``max`` over ``flag_over`` (replicas, e.g. DDP's dp, whose Σg² is already
    global). ``riders`` (fp32 ``[k]``, e.g. ZeRO's per-param "had a gradient" flags) travel in
    the first ``sum_over`` all-reduce and are written back in place. With ``found_inf=None``
    only Σg² is reduced and nothing is read on the host: a clip-only step has no host sync,
    and a non-finite norm simply propagates, as in ``torch.nn.utils.clip_grad_norm_``.

    Args:
        sumsq: fp32 ``[1]``, this rank's share of Σg² (after unscaling).
        found_inf: fp32 ``[1]``, > 0 when this rank saw an inf/nan; None: no loss scaler.
        sum_over: process groups (None entries are skipped) that add flags and squares.
        flag_over: process group that agrees the overflow flag only, or None.
        riders: extra fp32 values summed in the first ``sum_over`` all-reduce, or None.
        max_norm: clip to this global L2 norm unless an overflow (None: measure only).
        grads: lists of same-dtype, same-device gradients to clip in place.
        backend: kernel backend of the clip launches.
        stats: optional :class:`~shardkit.comm.CommStats` for the all-reduces.

    Returns:
        ``(overflow, norm)``: whether any rank saw an inf/nan (always False without
        ``found_inf``), and the global L2 norm before clipping (0-d fp32; ``inf`` on overflow).

    Example:
        >>> sumsq, found = torch.zeros(1), torch.zeros(1)
        >>> unscale_and_norm_(grads, inv_scale=1 / 1024, found_inf=found, sumsq=sumsq)
        >>> overflow, norm = agree_and_clip_(sumsq, found, sum_over=[ctx.group("tp")], max_norm=1.0, grads=[grads])
    """
    both = sumsq if found_inf is None else torch.cat([found_inf.to(sumsq.device), sumsq])
    for group in [g for g in sum_over if g is not None]:
        if riders is not None:
            packed = torch.cat([both, riders.to(both.device)])
            all_reduce(packed, group=group, op="sum", stats=stats)
            riders.copy_(packed[both.numel() :])
            both, riders = packed[: both.numel()].clone(), None
        else:
            all_reduce(both, group=group, op="sum", stats=stats)
    if flag_over is not None and found_inf is not None:
        flag = both[:1].clone()
        all_reduce(flag, group=flag_over, op="max", stats=stats)
        both = torch.cat([flag, both[1:]])
    total = both[-1:]
    if found_inf is not None and bool(both[0].item() > 0):
        return True, torch.full((), float("inf"), device=total.device)
    if max_norm is not None:
        for group_grads in grads:
            if group_grads:
                clip_grads_(list(group_grads), total.to(group_grads[0].device), max_norm=max_norm, backend=backend)
    return False, total.sqrt().reshape(())


def unscale_grads_(
    named_params: Sequence[tuple[str, torch.Tensor]],
    *,
    inv_scale: float = 1.0,
    group: Any = None,
    norm_group: Any = None,
    max_norm: float | None = None,
    report_nonfinite: bool = False,
    backend: str = "auto",
    unscaled: UnscaledGrads | None = None,
) -> OverflowReport:
    """Unscale grads in place, detect inf/nan, measure the global norm, optionally clip.

    One :func:`~shardkit.kernels.grad_epilogue.unscale_and_norm_` launch per grad dtype, one
    all-reduce of the overflow flag over ``group``, one of the squared norm over ``norm_group``,
    then (no overflow, ``max_norm`` given) one clip launch per dtype. Reads the flag and norm on
    the host once (the caller must decide whether to step). Grads covered by ``unscaled`` are
    not touched: their flag and Σg² come from that record (or, if only some of its grads are
    passed here, from one read-only norm pass over them).

    Args:
        named_params: ``(name, param)`` pairs; params without a grad are skipped.
        inv_scale: multiplier for the grads (``1 / loss_scale``).
        group: process group that agrees on the overflow (None: this process only).
        norm_group: process group across which the grads are partitioned (None: replicated).
        max_norm: clip to this global L2 norm when there is no overflow.
        report_nonfinite: fill ``OverflowReport.nonfinite`` with this rank's offending names.
        backend: kernel backend (``"triton"`` runs the interpreter on CPU).
        unscaled: grads a strategy already unscaled (see :class:`UnscaledGrads`).

    Returns:
        :class:`OverflowReport` with ``grad_norm`` before clipping.

    Raises:
        RuntimeError: a grad covered by ``unscaled`` was replaced or modified since.

    Example:
        >>> report = unscale_grads_(list(model.named_parameters()), inv_scale=1 / 1024.0,
        ...                         group=ctx.group("dp"), max_norm=1.0)
    """
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    groups = _by_dtype(named_params)
    if not groups:
        return OverflowReport(overflow=False, grad_norm=0.0)
    device = next(iter(groups.values()))[0][1].grad.device
    found_inf = torch.zeros(1, device=device)
    sumsq = torch.zeros(1, device=device)
    nonfinite: list[str] = []
    done, todo = _split_unscaled(groups, unscaled)
    if done and len(done) == len(unscaled.grads):
        found_inf.copy_(unscaled.found_inf)
        sumsq.copy_(unscaled.sumsq)
    elif done:  # a subset of the record: its totals include grads not asked about
        for dtype in {p.grad.dtype for _, p in done}:
            items = [(n, p) for n, p in done if p.grad.dtype == dtype]
            unscale_and_norm_(_grads(items), found_inf=found_inf, sumsq=sumsq, backend=backend)
    if report_nonfinite and done and bool(found_inf.item()):
        nonfinite += [n for n, p in done if not bool(torch.isfinite(p.grad).all())]
    for items in todo.values():
        stats = unscale_and_norm_(
            _grads(items),
            inv_scale=None if inv_scale == 1.0 else float(inv_scale),
            found_inf=found_inf,
            sumsq=sumsq,
            backend=backend,
        )
        if report_nonfinite:
            nonfinite += [items[i][0] for i in stats.nonfinite_indices()]
    overflow, norm = agree_and_clip_(
        sumsq,
        found_inf,
        sum_over=[norm_group],
        flag_over=group,
        max_norm=max_norm,
        grads=[_grads(items) for items in groups.values()],
        backend=backend,
    )
    return OverflowReport(overflow=overflow, grad_norm=float(norm.item()), nonfinite=nonfinite)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_group: Any = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Clip gradients by their global L2 norm, like ``torch.nn.utils.clip_grad_norm_``.

    Fused: one read-only norm launch per grad dtype, an all-reduce of Σg² over ``norm_group``
    when the grads are partitioned across ranks (ZeRO / tensor parallel; None for DDP, whose
    replicas hold identical grads), then one clip launch per dtype with the coefficient computed
    on the device — no host synchronization anywhere.

    Args:
        parameters: parameters whose ``.grad`` are clipped (those without a grad are skipped).
        max_norm: the largest allowed global norm (> 0).
        norm_group: process group across which the grads are partitioned, or None.
        backend: kernel backend.

    Returns:
        The total norm before clipping, fp32 0-d tensor on the grads' device.

    Example:
        >>> loss.backward()
        >>> total = clip_grad_norm_(model.parameters(), 1.0)
        >>> opt.step()
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    groups = _by_dtype([(str(i), p) for i, p in enumerate(parameters)])
    if not groups:
        return torch.zeros(())
    device = next(iter(groups.values()))[0][1].grad.device
    sumsq = torch.zeros(1, device=device)
    for items in groups.values():
        unscale_and_norm_(_grads(items), sumsq=sumsq, backend=backend)
    _, norm = agree_and_clip_(
        sumsq, sum_over=[norm_group], max_norm=max_norm, grads=[_grads(items) for items in groups.values()], backend=backend
    )
    return norm
