"""Progress display for the demo trainer: a one-line bar and the human-readable formatters."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

import torch

__all__ = ["ProgressBar", "fmt_bytes", "fmt_comm", "fmt_memory_vs_plan", "fmt_time"]

#: summary keys compared with the planner, and their printed names
_MEMORY = (("param_bytes", "params"), ("grad_bytes", "grads"), ("optim_state_bytes", "optim"), ("transient_bytes", "transient"))


def fmt_time(seconds: float) -> str:
    """``m:ss`` for a duration in seconds (``1h05`` from an hour on), e.g. ``fmt_time(75) == "1:15"``."""
    seconds = max(0, int(seconds + 0.5))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds // 60 % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


def fmt_bytes(n: float) -> str:
    """Binary-prefixed size (2^10 steps, labelled so), e.g. ``fmt_bytes(3 * 2**20) == "3.00 MiB"``.
    (``shardkit plan`` prints the ZeRO paper's decimal GB/MB, 10^9 / 10^6 bytes.)"""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def fmt_rank_summary(s: dict[str, Any]) -> str:
    """One rank's summary row: last-step and recent-mean train loss, eval loss, throughput, memory.

    Example:
        >>> fmt_rank_summary(dict(rank=0, final_train_loss=2.0, mean_train_loss=2.1, tail_steps=10,
        ...     final_eval_loss=2.2, tokens_per_s=5e3, wall_time_s=3.0, param_bytes=2**20,
        ...     grad_bytes=2**20, optim_state_bytes=2**21))[:58]
        'rank 0 | train loss 2.0000 (mean of last 10: 2.1000) | eval'
    """
    return (
        f"rank {s['rank']} | train loss {s['final_train_loss']:.4f} (mean of last {s['tail_steps']}: "
        f"{s['mean_train_loss']:.4f}) | eval loss {s['final_eval_loss']:.4f} | "
        f"{s['tokens_per_s'] / 1e3:.1f}k tok/s | wall {s['wall_time_s']:.1f} s | "
        f"params {fmt_bytes(s['param_bytes'])} | grads {fmt_bytes(s['grad_bytes'])} | "
        f"optim state {fmt_bytes(s['optim_state_bytes'])}"
    )


def fmt_total_throughput(ranks: list[dict[str, Any]], model_parallel: int) -> str:
    """The job's training throughput, each token counted once: the ranks of one model replica
    (``model_parallel`` = cp × tp × pp of them) process the same tokens, so the sum over ranks
    is divided by it.

    Example:
        >>> fmt_total_throughput([{"tokens_per_s": 4e3}] * 4, model_parallel=2)
        'total  | 8.0k tok/s over 2 data-parallel replicas (4 ranks, 2 per replica)'
    """
    replicas = len(ranks) // model_parallel
    total = sum(s["tokens_per_s"] for s in ranks) / model_parallel
    layout = f" ({len(ranks)} ranks, {model_parallel} per replica)" if model_parallel > 1 else ""
    noun = "replica" if replicas == 1 else "replicas"
    return f"total  | {total / 1e3:.1f}k tok/s over {replicas} data-parallel {noun}{layout}"


class ProgressBar:
    """One-line ``\\r`` progress bar (step, loss, tokens/s, ETA); plain periodic lines off a TTY.

    Args:
        total: number of steps.
        stream: where to write (default ``sys.stdout``).
        enabled: False makes every method a no-op (non-zero ranks).
        min_interval: seconds between redraws on a TTY.
        every: steps between lines when ``stream`` is not a TTY (default ``total // 10``).
        start: steps done before this bar (a resumed run), left out of the ETA's rate.

    Example:
        >>> bar = ProgressBar(100)
        >>> for step in range(1, 101):
        ...     bar.update(step, loss=2.0, tokens_per_s=1e4, elapsed=step * 0.1)
        >>> bar.close()
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        min_interval: float = 0.1,
        every: int | None = None,
        start: int = 0,
    ) -> None:
        self.total, self.enabled, self.min_interval, self.start = total, enabled, min_interval, start
        self.stream = stream or sys.stdout
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every or max(1, total // 10)
        self._last_draw = -math.inf
        self._width = 0  # length of the bar line on screen, to blank it

    def update(self, step: int, *, loss: float | torch.Tensor, tokens_per_s: float, elapsed: float) -> None:
        """Report that ``step`` (1-based) finished; ``elapsed`` = training seconds since ``start``.

        A tensor ``loss`` is read (a device sync) only when a line is actually drawn.
        """
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw < self.min_interval and step != self.total:
                return
        elif step % self.every and step not in (1, self.total):
            return
        self._last_draw = now
        eta = elapsed / max(step - self.start, 1) * (self.total - step)
        stats = f"loss {float(loss):.3f} | {tokens_per_s / 1e3:.1f}k tok/s | {fmt_time(elapsed)} < {fmt_time(eta)}"
        width = len(str(self.total))
        if not self.tty:
            print(f"step {step:>{width}}/{self.total} | {stats}", file=self.stream, flush=True)
            return
        filled = round(24 * step / self.total)
        line = f"step {step:>{width}}/{self.total} [{'#' * filled}{'.' * (24 - filled)}] {stats}"
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def write(self, line: str) -> None:
        """Print a persistent line (e.g. an eval result) without garbling the bar."""
        if not self.enabled:
            return
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width, self._last_draw = 0, -math.inf  # redraw on the next update
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar line."""
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def fmt_comm(comm: dict[str, Any] | None) -> str:
    """One line for a ``CommStats.summary()``: ``"all_reduce 3.00 MiB in 5 calls"`` (``-`` for None)."""
    if not comm:
        return "-"
    parts = []
    for op, v in comm.items():  # CommStats.summary(): {op: {"calls", "bytes", "groups"}}
        if isinstance(v, dict) and "bytes" in v:
            calls = v.get("calls", "?")
            parts.append(f"{op} {fmt_bytes(v['bytes'])} in {calls} call{'' if calls == 1 else 's'}")
        else:
            parts.append(f"{op}={v}")
    return ", ".join(parts)


def fmt_memory_vs_plan(measured: dict[str, Any], plan: dict[str, Any]) -> str:
    """Measured bytes per rank next to the planner's, by category, then the totals and their gap.

    Categories the plan has no figure for (``None``, e.g. DDP's transient) are left out of both
    totals, so the two totals cover the same buffers.

    Example:
        >>> fmt_memory_vs_plan({"param_bytes": 2**20, "grad_bytes": 2**20, "optim_state_bytes": 2**21,
        ...                     "transient_bytes": None},
        ...                    {"stage": "DDP", "param_bytes": 2**20, "grad_bytes": 2**20,
        ...                     "optim_state_bytes": 2**21, "transient_bytes": None, "total_bytes": 2**22})
        'memory measured (planner DDP): params 1.00 MiB (1.00 MiB) | grads 1.00 MiB (1.00 MiB) | optim 2.00 MiB (2.00 MiB) | total 4.00 MiB (4.00 MiB, +0.0%)'
    """
    parts, total = [], 0
    for key, name in _MEMORY:
        if plan.get(key) is None or measured.get(key) is None:
            continue
        total += measured[key]
        parts.append(f"{name} {fmt_bytes(measured[key])} ({fmt_bytes(plan[key])})")
    gap = (plan["total_bytes"] - total) / total * 100 if total else 0.0
    parts.append(f"total {fmt_bytes(total)} ({fmt_bytes(plan['total_bytes'])}, {gap:+.1f}%)")
    return f"memory measured (planner {plan['stage']}): " + " | ".join(parts)
