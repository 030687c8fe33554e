"""Rendering ZeRO memory plans: :func:`plan_table` over stages, :func:`format_gb` (the CLI's half).

The plans themselves come from :func:`~shardkit.parallel.zero.planner.plan_memory`
(docs/planner.md).

Example:
    >>> print(plan_table(7_500_000_000, dp=64, precision="fp16"))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from .plan_format import _unit, format_gb
from .planner import MemoryPlan, plan_memory

__all__ = ["StageTable", "plan_table"]


@dataclass(frozen=True)
class StageTable:
    """Plans of several stages for the same model and settings; ``str()`` renders the table."""

    plans: tuple[MemoryPlan, ...]

    def __getitem__(self, stage: int) -> MemoryPlan:
        for plan in self.plans:
            if plan.stage == stage:
                return plan
        raise KeyError(stage)

    def render(self) -> str:
        """One row per stage, sizes in GB (10^9 bytes; MB when all are below 1 GB), comm in multiples of Ψ."""
        first = self.plans[0]
        offload = next((p.offload for p in self.plans if p.offload), None)
        scale, name = _unit(max(max(p.device_total, p.cpu, p.nvme) for p in self.plans))
        cols = ("stage", "params", "grads", "optim", "states", "transient", "total", "cpu", "nvme", "comm", "fits")
        rows = []
        for p in self.plans:
            psi_units = p.comm_elements / p.num_params if p.num_params else 0.0
            fits = "-" if p.fits is None else ("yes" if p.fits else "NO")
            sizes = (p.params, p.grads, p.optimizer_state, p.model_state_bytes, p.transient, p.device_total, p.cpu, p.nvme)
            stage = f"{p.stage} {p.name}" + ("*" if offload and not p.offload else "")
            rows.append((stage, *(format_gb(b, scale) for b in sizes), f"{psi_units:.1f}Ψ", fits))
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        line = lambda r: "  ".join(s.ljust(w) if i == 0 else s.rjust(w) for i, (s, w) in enumerate(zip(r, widths)))  # noqa: E731
        dev = "" if first.device_bytes is None else f", device {format_gb(first.device_bytes, scale)} {name}"
        head = (
            f"Ψ = {first.num_params:,} params ({first.trainable_params:,} trainable), dp = {first.dp}, "
            f"{first.precision}, {first.optimizer} (K = {first.optimizer_bytes_per_param} B/param), "
            f"offload = {offload or 'none'}{dev}\n"
            f"bytes per rank in {name} (1e{9 if name == 'GB' else 6}); states = params + grads + optim (ZeRO paper, "
            "Table 1); comm per step in the paper's unit (all-reduce of Ψ = 2Ψ)"
        )
        foot = ["* DDP cannot offload: planned without it"] if offload and any(not p.offload for p in self.plans) else []
        return "\n".join([head, line(cols), *map(line, rows), *foot])

    __str__ = render


def plan_table(num_params: int | nn.Module, *, stages: Iterable[int] = (0, 1, 2, 3), **kwargs: object) -> StageTable:
    """:func:`plan_memory` for each of ``stages`` (default 0-3) with the same settings.

    Stage 0 (DDP) cannot offload: with ``offload`` set it is planned without offload, and
    ``offload_params`` applies to stage 3 only.

    Example:
        >>> t = plan_table(7_500_000_000, dp=64, precision="fp16")
        >>> [format_gb(p.model_state_bytes) for p in t.plans]
        ['120', '31.4', '16.6', '1.88']
    """
    stages = tuple(stages)
    if not stages:
        raise ValueError("stages must name at least one stage")
    plans = []
    for s in stages:
        kw = dict(kwargs)
        if s == 0:
            kw.pop("offload", None)
            kw.pop("offload_params", None)
        elif s != 3:
            kw.pop("offload_params", None)
        plans.append(plan_memory(num_params, stage=s, **kw))  # type: ignore[arg-type]
    return StageTable(tuple(plans))
