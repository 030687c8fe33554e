"""``check_sync``: agree which collective comes next before issuing it (ZeRO's debug switch).

[Note: diverged ranks]
Data-parallel ranks must issue the same collectives in the same order. When they do not — one
rank runs one more forward/backward, skips a ``no_sync``, or (stage 3) calls its units in
another order — the collectives pair up wrongly: a reduce-scatter on one rank meets an
all-gather of the same size on another (silently wrong values), or waits for a partner that
never comes (a hang until the process group's timeout, with an error on one rank naming nothing
useful). With ``check_sync=True`` every rank, before each of ZeRO's collectives, all-gathers one
``[4]`` int64 row: ``(collectives so far, kind, bucket or unit, phase)``. Every rank issues
such a check before *every* ZeRO collective, so as long as each rank reaches one, the checks
pair up with each other even when the ranks are at different points of their step, and the
first check after the divergence sees different rows. Every rank then raises the same
RuntimeError naming each rank's position — instead of pairing mismatched collectives.

Cost: one 32-byte-per-rank all-gather per collective (a few per bucket per step); latency-bound,
small next to the bucket collectives themselves, but a host sync each, which is why it is a
debug switch (``ShardedDataParallel(check_sync=True)``) rather than on by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardkit.comm import CommStats, all_gather

__all__ = ["KINDS", "PHASES", "SyncCheck"]

#: the collectives checked, by code (a row's second field)
KINDS = ("gradient reduce-scatter", "gradient epilogue (norm/overflow)", "parameter all-gather", "unit all-gather")
#: why a stage-3 unit is gathered (a row's fourth field; 0 for the other kinds)
PHASES = ("-", "forward", "prefetch", "backward", "state_dict")


class SyncCheck:
    """Counts this rank's ZeRO collectives and agrees each one's identity over dp before it runs.

    Args:
        group: the dp process group; ``size`` its size.
        stats: CommStats for the check all-gathers.
        device: where the check rows live (the buckets' device: NCCL needs CUDA tensors).
        who: the name the error starts with, e.g. ``"ShardedDataParallel(stage=2, check_sync=True)"``.
        name_of: ``name_of(kind, index) -> str`` names a bucket or unit in the error
            (default: ``"bucket {index}"``).

    Example:
        >>> sync = SyncCheck(dp_group, 2, CommStats(), torch.device("cpu"), who="ShardedDataParallel")
        >>> sync.check("gradient reduce-scatter", index=0)   # then issue the reduce-scatter
    """

    def __init__(
        self,
        group: Any,
        size: int,
        stats: CommStats,
        device: torch.device,
        *,
        who: str,
        name_of: Callable[[str, int], str] | None = None,
    ) -> None:
        self.group, self.size, self.stats, self.device, self.who = group, size, stats, device, who
        self.name_of = name_of or (lambda kind, index: f"bucket {index}")
        self.count = 0  # collectives checked so far on this rank

    def check(self, kind: str, index: int = 0, phase: str = "-") -> None:
        """Agree ``(count, kind, index, phase)`` over dp; raise on every rank if any differs.

        Args:
            kind: one of :data:`KINDS`.
            index: the bucket (or stage-3 unit) the collective is for.
            phase: one of :data:`PHASES` (stage-3 unit gathers).

        Raises:
            RuntimeError: the ranks are at different collectives (the message names each rank's).
        """
        mine = torch.tensor([self.count, KINDS.index(kind), index, PHASES.index(phase)], dtype=torch.int64)
        rows = torch.empty(self.size * 4, dtype=torch.int64, device=self.device)
        all_gather(rows, mine.to(self.device), group=self.group, stats=self.stats)
        rows = rows.view(self.size, 4).cpu()
        self.count += 1
        if bool((rows == rows[0]).all()):
            return
        where = "; ".join(
            f"rank {r}: collective #{n}, {KINDS[k]}"
            + ("" if KINDS[k].startswith("gradient epilogue") else f" of {self.name_of(KINDS[k], i)}")
            + (f" for {PHASES[p]}" if p else "")
            for r, (n, k, i, p) in enumerate(rows.tolist())
        )
        raise RuntimeError(
            f"{self.who}: the dp ranks diverged ({where}). Every rank must run the same forwards, backwards "
            "(no_sync on all or none) and optimizer steps, calling the stage-3 units in the same order"
        )
