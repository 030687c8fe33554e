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

from shardkit.comm import all_reduce
from shardkit.kernels.grad_epilogue import clip_grads_, unscale_and_norm_

__all__ = ["OverflowReport", "unscale_grads_", "clip_grad_norm_"]


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


def _grads(items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    for _, p in items:
        if not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
    return [p.grad for _, p in items]


def unscale_grads_(
    named_params: Sequence[tuple[str, torch.Tensor]],
    *,
    inv_scale: float = 1.0,
    group: Any = None,
    norm_group: Any = None,
    max_norm: float | None = None,
    report_nonfinite: bool = False,
    backend: str = "auto",
) -> OverflowReport:
    """Unscale grads in place, detect inf/nan, measure the global norm, optionally clip.

    One :func:`~shardkit.kernels.grad_epilogue.unscale_and_norm_` launch per grad dtype, one
    all-reduce of the overflow flag over ``group``, one of the squared norm over ``norm_group``,
    then (no overflow, ``max_norm`` given) one clip launch per dtype. Reads the flag and norm on
    the host once (the caller must decide whether to step).

    Args:
        named_params: ``(name, param)`` pairs; params without a grad are skipped.
        inv_scale: multiplier for the grads (``1 / loss_scale``).
        group: process group that agrees on the overflow (None: this process only).
        norm_group: process group across which the grads are partitioned (None: replicated).
        max_norm: clip to this global L2 norm when there is no overflow.
        report_nonfinite: fill ``OverflowReport.nonfinite`` with this rank's offending names.
        backend: kernel backend (``"triton"`` runs the interpreter on CPU).

    Returns:
        :class:`~shardkit.parallel.OverflowReport` with ``grad_norm`` before clipping.

    Example:
        >>> report = unscale_grads_(list(model.named_parameters()), inv_scale=1 / 1024.0,
        ...                        group=ctx.group("dp"), max_norm=1.0)
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
    for items in groups.values():
        stats = unscale_and_norm_(
            _grads(items), inv_scale=None if inv_scale == 1.0 else float(inv_scale),
            found_inf=found_inf, sumsq=sumsq, backend=backend,
        )  # fmt: skip
        if report_nonfinite:
            nonfinite += [items[i][0] for i in stats.nonfinite_indices()]
    if group is not None:
        all_reduce(found_inf, group=group, op="max")
    if norm_group is not None:
        all_reduce(sumsq, group=norm_group, op="sum")
    overflow = bool(found_inf.item())
    norm = float(sumsq.sqrt().item()) if not overflow else float("inf")
    if max_norm is not None and not overflow:
        for items in groups.values():
            clip_grads_(_grads(items), sumsq, max_norm=max_norm, backend=backend)
    return OverflowReport(overflow=overflow, grad_norm=norm, nonfinite=nonfinite)


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
    if norm_group is not None:
        all_reduce(sumsq, group=norm_group, op="sum")
    for items in groups.values():
        clip_grads_(_grads(items), sumsq, max_norm=max_norm, backend=backend)
    return sumsq.sqrt().reshape(())
