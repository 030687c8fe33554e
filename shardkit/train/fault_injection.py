"""``shardkit train --inject-fault RANK:STEP:KIND``: make one rank fail on purpose, for drills.

Try ``--max-restarts`` and ``--resume auto`` before a real failure needs them (docs/operations.md):
rank RANK fails when step STEP begins, in the first attempt only (torchrun's
``TORCHELASTIC_RESTART_COUNT`` is 0), so a restarted run passes the same step. Kinds:

* ``raise``: a ``RuntimeError`` in the rank (a bug, a bad batch);
* ``exit``: the process exits with status 1 without a traceback (``os._exit``);
* ``kill``: SIGKILL to itself (the OOM killer, a lost node);
* ``stop``: SIGSTOP to itself (a frozen process: it holds its sockets and answers nothing);
* ``hang``: sleeps inside the step (a stuck data loader or collective), still alive.

The others learn of a dead rank from torchrun, which stops them; of a frozen or stuck one only
when their next collective times out (``--timeout``).

Example:
    $ shardkit train --nproc 2 --strategy ddp --ckpt-dir ckpt --save-every 20 --resume auto \\
          --max-restarts 1 --inject-fault 1:50:kill
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Literal, cast

__all__ = ["FAULT_KINDS", "Fault", "parse_fault"]

FaultKind = Literal["raise", "exit", "kill", "stop", "hang"]
FAULT_KINDS: tuple[str, ...] = ("raise", "exit", "kill", "stop", "hang")


@dataclass(frozen=True)
class Fault:
    """Rank ``rank`` fails with ``kind`` when step ``step`` (1-based) begins."""

    rank: int
    step: int
    kind: FaultKind

    def due(self, rank: int, step: int) -> bool:
        """Whether this rank fails now (never after a torchrun restart)."""
        return rank == self.rank and step == self.step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def fire(self) -> None:
        """Fail as ``kind`` says; returns only for ``hang`` after an hour."""
        print(
            f"[rank {self.rank}] --inject-fault: {self.kind} at step {self.step} (t={time.time():.3f})",
            file=sys.stderr,
            flush=True,
        )
        if self.kind == "raise":
            raise RuntimeError(f"--inject-fault: rank {self.rank} raised at step {self.step}")
        if self.kind == "exit":
            os._exit(1)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)


def parse_fault(spec: str | None, *, world_size: int | None = None) -> Fault | None:
    """``"RANK:STEP:KIND"`` → :class:`Fault` (None for None).

    Raises:
        ValueError: not three fields, a negative rank or a step < 1, an unknown kind, or a rank
            outside ``world_size``.

    Example:
        >>> parse_fault("1:50:kill")
        Fault(rank=1, step=50, kind='kill')
    """
    if spec is None:
        return None
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError(f"--inject-fault expects RANK:STEP:KIND (e.g. 1:50:kill), got {spec!r}")
    rank, step, kind = int(parts[0]), int(parts[1]), parts[2]
    if kind not in FAULT_KINDS:
        raise ValueError(f"--inject-fault: kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
    if step < 1:
        raise ValueError(f"--inject-fault: step must be >= 1, got {step}")
    if world_size is not None and rank >= world_size:
        raise ValueError(f"--inject-fault: rank {rank} but the run has {world_size} rank(s)")
    return Fault(rank, step, cast(FaultKind, kind))
