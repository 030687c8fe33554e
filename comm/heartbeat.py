"""A frozen rank is found in seconds: each rank beats, the next rank watches.

[Note: heartbeats]
A rank that dies closes its sockets: its peers' next collective fails at once and torchrun sees
the exit. A rank that *freezes* (SIGSTOP, a swapped-out VM, a deadlock in a C extension) closes
nothing: its peers wait in their collective until the group's timeout (300 s by default), and
then cannot tell who is to blame. :class:`Heartbeat` finds it sooner and names it:

* every rank's daemon thread writes ``(count, note)`` to the default group's store every
  ``interval`` seconds, where ``note`` is what the rank last said it was doing (:meth:`note`,
  e.g. ``"step 41"``);
* each rank watches one other, the next in a ring (``(rank + 1) % world``): every rank is watched,
  and the store sees two requests per rank per interval whatever the world size;
* a watched rank whose beat has not changed for ``stale_after`` seconds (the watcher's own clock:
  none is compared across hosts) is declared frozen: the
  watcher prints ``shardkit heartbeat: rank R (pid P on HOST) sent no heartbeat for S s (last
  note: ...)`` to stderr and, when R runs on the same host and is still the process that
  registered (same pid and start time in ``/proc``), kills it with SIGKILL. Its peers'
  collectives then fail at once ("Connection closed by peer"), the run ends, and torchrun can
  restart it (``--max-restarts``). On another host the watcher exits itself instead, with status
  1, which ends the run the same way.

A rank that is alive but stuck (a data loader waiting forever, a collective only it skipped)
still beats. Given the run's :class:`~shardkit.comm.CommStats` (``stats=``), each beat also
publishes how many collectives the rank has issued, the last one, and its phase: the newest
:meth:`~shardkit.comm.CommStats.set_phase` label, which the layouts set as they go
(``forward: all-gather of unit 'blocks.1'``, ``backward: reduce-scatter of gradient bucket 0``,
``pipeline: receive of micro-batch 2's activation from stage 0``, ``gradient clip``,
``optimizer step``). When a collective times out, :meth:`stall_report` compares them: the rank
that has issued fewer is the one the others wait for ("rank 3 is behind: 40 collectives issued
(last: all_gather on ...; optimizer step; step 5); ranks 0-2: 41 (last: ...; backward:
reduce-scatter of gradient bucket 0; step 5)"). A frozen rank's verdict names its phase too.

A rank that ends (:meth:`stop`, or leaving the ``with`` block) marks itself done and is never
declared frozen. The threads hold the GIL only for a store request, which torch's collectives and
kernels release; a C extension that held the GIL for ``stale_after`` seconds would be taken for
frozen, so keep ``stale_after`` well above any such call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType

import torch.distributed as dist

from .handle import CommTimeoutError
from .stats import CommStats

__all__ = ["Heartbeat", "watch_run"]

_PREFIX = "shardkit/heartbeat/"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one read
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _ranks(ranks: list[int]) -> str:
    """``"rank 3"``, ``"ranks 0-2"``, ``"ranks 0, 2, 5"``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


class Heartbeat:
    """Beat for this rank and watch the next one (see [Note: heartbeats]).

    Args:
        interval: seconds between beats (and checks).
        stale_after: seconds without a beat after which the watched rank is declared frozen.
        store: the store to beat into (default: the default process group's).
        on_frozen: ``on_frozen(rank, verdict)`` instead of the default kill-or-exit, called once
            from the watcher thread (e.g. to alert and let the collective timeout end the run).
        stats: the run's :class:`~shardkit.comm.CommStats` objects, in the same order on every
            rank: each beat also publishes how many collectives this rank has issued and the
            last one, which :meth:`stall_report` compares across ranks.

    Raises:
        ValueError: ``interval <= 0`` or ``stale_after <= 2 * interval``.
        RuntimeError: no default process group.

    Example:
        >>> with Heartbeat(stale_after=20) as hb:
        ...     for step in range(steps):
        ...         hb.note(f"step {step}")
        ...         train_step()
    """

    def __init__(
        self,
        *,
        interval: float = 1.0,
        stale_after: float = 20.0,
        store: dist.Store | None = None,
        on_frozen: Callable[[int, str], None] | None = None,
        stats: Sequence[CommStats] = (),
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval}")
        if not stale_after > 2 * interval:
            raise ValueError(f"stale_after must exceed 2 * interval = {2 * interval}, got {stale_after}")
        if not dist.is_initialized():
            raise RuntimeError("Heartbeat needs an initialized default process group")
        self.interval, self.stale_after = interval, stale_after
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._on_frozen = on_frozen
        self._stats = list(stats)
        self._note = "started"
        self._count = 0
        self._seen, self._seen_at = "", 0.0  # the watched rank's last beat, and when it changed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the verdict, once this rank declared its watched rank frozen
        self.verdict: str | None = None

    # ---- this rank --------------------------------------------------------------------------
    def note(self, what: str) -> None:
        """Say what this rank is doing now (shown in a verdict about it)."""
        self._note = what

    def track(self, *stats: CommStats) -> None:
        """Add CommStats objects to the published progress (as ``stats=``; e.g. once the model
        that owns them is built). Add them in the same order on every rank."""
        self._stats.extend(stats)

    def start(self) -> Heartbeat:
        """Register this rank (pid, host, start time) and start beating and watching."""
        pid = os.getpid()
        self._store.set(f"{_PREFIX}{self.rank}/who", f"{pid} {socket.gethostname()} {_start_time(pid)}")
        self._beat()
        if self.world > 1:
            self._thread = threading.Thread(target=self._run, name=f"shardkit-heartbeat-{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Mark this rank done (never declared frozen after this) and stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 5)
        try:
            self._store.set(f"{_PREFIX}{self.rank}/beat", "done")
        except Exception:  # noqa: BLE001 - the store may be gone at exit: nothing to mark then
            pass

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # ---- the thread -------------------------------------------------------------------------
    def _beat(self) -> None:
        self._count += 1
        self._store.set(f"{_PREFIX}{self.rank}/beat", f"{self._count} {self._note}")
        if self._stats:
            self._store.set(f"{_PREFIX}{self.rank}/progress", self._progress())

    def _progress(self) -> str:
        """``"<calls>\t<last op on group>\t<phase>"`` over this run's stats objects (the phase:
        the newest :meth:`CommStats.set_phase` label among them)."""
        issued, last, phase = 0, "-", ("", -1.0)
        for stats in self._stats:
            n, op = stats.progress()
            issued += n
            if op is not None:
                last = f"{op[0]} on {op[1]}"
            phase = max(phase, stats.phase(), key=lambda p: p[1])
        return f"{issued}\t{last}\t{phase[0]}"

    def _published_phase(self, rank: int) -> str:
        """``rank``'s last published phase label, or ``""``."""
        key = f"{_PREFIX}{rank}/progress"
        if not self._stats or not self._store.check([key]):
            return ""
        return self._store.get(key).decode().split("\t")[2]

    def stall_report(self) -> str:
        """Which rank is behind, from every rank's last published progress (call it when a
        collective timed out, on any rank; the others need not answer).

        Ranks that run the same program issue the same collectives in the same order, so the
        rank that has issued fewer is the one the others are waiting for; when all have issued
        as many, the collective itself is stuck (or a rank skipped one: a bug).

        Returns:
            One line, ``"shardkit stall: rank 3 is behind: 40 collectives issued (last:
            all_gather on shardkit_dp[0, 1, 2, 3]; step 5); ranks 0-2: 41 (last: ...)"``.

        Example:
            >>> try:
            ...     train_step()
            ... except CommTimeoutError:
            ...     print(hb.stall_report(), file=sys.stderr); raise
        """
        if not self._stats:
            return "shardkit stall: no progress recorded (Heartbeat(stats=...) was not given the run's CommStats)"
        self._store.set(f"{_PREFIX}{self.rank}/progress", self._progress())  # this rank's, current
        rows: list[tuple[int, int, str, str]] = []
        for rank in range(self.world):
            keys = [f"{_PREFIX}{rank}/progress", f"{_PREFIX}{rank}/beat"]
            if not self._store.check(keys):
                rows.append((rank, -1, "-", "not started"))
                continue
            progress, beat = (v.decode() for v in self._store.multi_get(keys))
            issued, last, phase = progress.split("\t")
            note = beat.partition(" ")[2]
            rows.append((rank, int(issued), last, f"{phase}; {note}" if phase else note))
        fewest = min(r[1] for r in rows)
        behind = [r for r in rows if r[1] == fewest]
        ahead = [r for r in rows if r[1] != fewest]

        def where(group: list[tuple[int, int, str, str]]) -> str:
            notes = sorted({f"last: {r[2]}; {r[3]}" for r in group})
            return f"{group[0][1]} collectives issued ({' | '.join(notes)})"

        if not ahead:
            return f"shardkit stall: every rank has issued {where(rows)}: none is behind, a collective itself is stuck"
        names = _ranks([r[0] for r in behind])
        others = "; ".join(
            f"{_ranks([r[0] for r in ahead if r[1] == n])}: {where([r for r in ahead if r[1] == n])}"
            for n in sorted({r[1] for r in ahead})
        )
        verb = "is" if len(behind) == 1 else "are"
        return f"shardkit stall: {names} {verb} behind: {where(behind)}; {others}"

    def _run(self) -> None:
        watched, watching = (self.rank + 1) % self.world, True
        while not self._stop.wait(self.interval):
            try:
                self._beat()  # beats on after a verdict: this rank is alive
                if watching and self._check(watched):
                    watching = False
            except Exception:  # noqa: BLE001 - the store went away (the run is ending): stop quietly
                return

    def _check(self, watched: int) -> bool:
        """Whether ``watched`` was declared frozen (and dealt with). Staleness is measured on this
        rank's own clock, from when the watched beat last changed: no clock is compared across hosts."""
        key = f"{_PREFIX}{watched}/beat"
        if not self._store.check([key]):
            return False  # not registered yet: it is still starting
        beat = self._store.get(key).decode()
        now = time.monotonic()
        if beat == "done":
            return False
        if beat != self._seen:
            self._seen, self._seen_at = beat, now
            return False
        silent = now - self._seen_at
        if silent < self.stale_after:
            return False
        note = beat.partition(" ")[2]
        phase = self._published_phase(watched)
        pid_s, host, started = self._store.get(f"{_PREFIX}{watched}/who").decode().split(" ")
        pid = int(pid_s)
        self.verdict = (
            f"shardkit heartbeat: rank {watched} (pid {pid} on {host}) sent no heartbeat for {silent:.1f} s "
            f"(last note: {note or '-'}{'; in ' + phase if phase else ''}): frozen or stopped"
        )
        if self._on_frozen is not None:
            self._on_frozen(watched, self.verdict)
            return True
        if host == socket.gethostname() and _start_time(pid) == started:
            print(f"{self.verdict}; rank {self.rank} kills it (SIGKILL)", file=sys.stderr, flush=True)
            os.kill(pid, signal.SIGKILL)
            return True
        print(f"{self.verdict}; rank {self.rank} exits to end the run", file=sys.stderr, flush=True)
        os._exit(1)


@contextlib.contextmanager
def watch_run(stale_after: float, *, world_size: int) -> Iterator[Heartbeat | None]:
    """A :class:`Heartbeat` around a training run, which also prints :meth:`Heartbeat.stall_report`
    to stderr when the run's collective times out; None (and nothing running) when
    ``stale_after`` is 0 or the world has one rank.

    Example:
        >>> with watch_run(20.0, world_size=ctx.world_size) as hb:
        ...     if hb is not None:
        ...         hb.track(*par.comm_stats())
        ...     train()
    """
    if stale_after <= 0 or world_size <= 1:
        yield None
        return
    with Heartbeat(stale_after=stale_after) as hb:
        try:
            yield hb
        except CommTimeoutError:  # who the others were waiting for
            print(hb.stall_report(), file=sys.stderr, flush=True)
            raise
