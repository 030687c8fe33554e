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

Each beat also publishes the rank's flight record: its newest collectives, numbered per group
([Note: the flight recorder] in :mod:`shardkit.comm.stats`). :meth:`flight_record` reads every
rank's and compares them group by group, among the ranks in the group's label: the k-th
collective on a group must be the same op and size on every member, so the first ``#k`` where
two members differ ("mismatch on shardkit_dp[0, 1] #42: rank 0 all_gather 4096 B (forward:
...) vs rank 1 reduce_scatter 2048 B (backward: ...)") is where they stopped agreeing on which
collective comes next: the classic hang, which a count of calls alone cannot tell from a rank
that is merely late. Without a mismatch it says, per group, which members have issued fewer
calls on it. Sends and receives are listed but never compared (they pair by peer and tag, not by
order), nor is a ``#k`` that a rank's window no longer holds. :meth:`stall_report` appends the
first mismatch, and :func:`watch_run` prints the flight record after it.

[Note: an early stall warning]
The collective timeout is long (300 s by default) because a slow step must not end a run. But a
stuck rank can be *named* sooner: when this rank has issued no collective for ``stale_after``
seconds while a member of one of its groups has issued fewer collectives on that group (compared
per group, from the flight records: pipeline stages issue different collectives), the one it
waits for is either stuck or very late. The lowest-numbered rank ahead on such a group tells it
once per stall, with the flight record, on stdout (a torchrun worker's stderr goes to its log
file until the run ends) or to ``on_stall``; the run goes on and still ends at the timeout if
nothing moves. When every member of each group has issued as many (every rank computing, or a
collective itself stuck) nothing is told: counts cannot tell those apart.

A rank that ends (:meth:`stop`, or leaving the ``with`` block) marks itself done and is never
declared frozen. The threads hold the GIL only for a store request, which torch's collectives and
kernels release; a C extension that held the GIL for ``stale_after`` seconds would be taken for
frozen, so keep ``stale_after`` well above any such call.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import NamedTuple

import torch.distributed as dist

from .handle import CommTimeoutError
from .stats import CollectiveRecord, CommStats, merge_recent

__all__ = ["Heartbeat", "watch_run"]

_PREFIX = "shardkit/heartbeat/"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one read
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


#: the global ranks at the end of a group label: ``"shardkit_dp[0, 2]"`` -> ``"0, 2"``
_MEMBERS = re.compile(r"\[(\d+(?:, \d+)*)\]$")


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
            last one, which :meth:`stall_report` compares across ranks, and the newest ones
            (:func:`~shardkit.comm.stats.merge_recent`), which :meth:`flight_record` compares.
        on_stall: ``on_stall(report)`` instead of printing it to stdout: called once per stall
            when this rank has issued no collective for ``stale_after`` seconds while a member of
            one of its groups has issued fewer on that group ([Note: an early stall warning]);
            needs ``stats``. It runs on the heartbeat thread: return quickly (an error turns the
            warnings off, the beats go on).

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
        on_stall: Callable[[str], None] | None = None,
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
        self._on_stall = on_stall
        self._stats = list(stats)
        # this rank's collective count, when it last changed, and whether its stall was told
        self._own: tuple[int, float, bool] = (-1, 0.0, False)
        self._stall_warnings = True
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
        that owns them is built). Add them in the same order on every rank. Published at once
        when started, then with every beat."""
        self._stats.extend(stats)
        if self._stats and self._count:  # started: beats have published "none" so far
            self._publish()

    def start(self) -> Heartbeat:
        """Register this rank (pid, host, start time) and start beating and watching."""
        pid = os.getpid()
        self._store.set(f"{_PREFIX}{self.rank}/who", f"{pid} {socket.gethostname()} {_start_time(pid)}")
        if not self._stats:  # none yet (track() may add some): not an earlier Heartbeat's on this store
            self._store.set(f"{_PREFIX}{self.rank}/recent", "")
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
            self._publish()

    def _publish(self) -> None:
        """This rank's progress and flight record, now (one store request)."""
        records, calls = merge_recent(self._stats)
        flight = {"calls": calls, "records": [[r.seq_in_group, r.op, r.group, r.nbytes, r.phase] for r in records]}
        self._store.multi_set(
            [f"{_PREFIX}{self.rank}/progress", f"{_PREFIX}{self.rank}/recent"],
            [self._progress(), json.dumps(flight, separators=(",", ":"))],
        )

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
            all_gather on shardkit_dp[0, 1, 2, 3]; step 5); ranks 0-2: 41 (last: ...)"``; when
            the ranks' flight records disagree (:meth:`flight_record`), it ends with ``"; first
            mismatch: shardkit_dp[0, 1, 2, 3] #41: rank 0 all_gather 4096 B (...) vs rank 3
            reduce_scatter 2048 B (...)"``.

        Example:
            >>> try:
            ...     train_step()
            ... except CommTimeoutError:
            ...     print(hb.stall_report(), file=sys.stderr); raise
        """
        if not self._stats:
            return "shardkit stall: no progress recorded (Heartbeat(stats=...) was not given the run's CommStats)"
        rows = self._rows()
        fewest = min(r[1] for r in rows)
        behind = [r for r in rows if r[1] == fewest]
        ahead = [r for r in rows if r[1] != fewest]

        def where(group: list[tuple[int, int, str, str]]) -> str:
            notes = sorted({f"last: {r[2]}; {r[3]}" for r in group})
            return f"{group[0][1]} collectives issued ({' | '.join(notes)})"

        mismatches = _mismatches(self._flights())
        also = f"; first mismatch: {mismatches[0]}" if mismatches else ""
        if not ahead:
            return f"shardkit stall: every rank has issued {where(rows)}: none is behind, a collective itself is stuck{also}"
        names = _ranks([r[0] for r in behind])
        others = "; ".join(
            f"{_ranks([r[0] for r in ahead if r[1] == n])}: {where([r for r in ahead if r[1] == n])}"
            for n in sorted({r[1] for r in ahead})
        )
        verb = "is" if len(behind) == 1 else "are"
        return f"shardkit stall: {names} {verb} behind: {where(behind)}; {others}{also}"

    def _rows(self) -> list[tuple[int, int, str, str]]:
        """``(rank, collectives issued, last one, phase and note)`` of every rank, from what it
        published (-1 issued: not started); this rank's published first, current."""
        self._publish()
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
        return rows

    def _flights(self) -> dict[int, _Flight | None]:
        """Every rank's published flight record (None: it published none)."""
        keys = [f"{_PREFIX}{rank}/recent" for rank in range(self.world)]
        if self._store.check(keys):
            values = self._store.multi_get(keys)
        else:  # a missing key would block multi_get
            values = [self._store.get(key) if self._store.check([key]) else None for key in keys]
        flights: dict[int, _Flight | None] = {}
        for rank, value in enumerate(values):
            if not value:  # never set, or set empty by start(): no stats
                flights[rank] = None
                continue
            flight = json.loads(value)
            flights[rank] = _Flight(
                [CollectiveRecord(*row) for row in flight["records"]], {k: tuple(v) for k, v in flight["calls"].items()}
            )
        return flights

    def flight_record(self, last: int = 8) -> str:
        """Every rank's newest collectives, compared group by group (see [Note: heartbeats]):
        call it when a collective timed out, on any rank, as :meth:`stall_report`.

        Args:
            last: how many of each rank's newest records to list (the verdict uses all it published).

        Returns:
            Lines: a verdict, then each rank's ``last`` records, oldest first; a rank that
            published none is listed as such. The verdict is the first mismatch (the oldest,
            counted back from the ranks' newest collectives) where there is one, else which
            members of each group are behind on it::

                shardkit flight record: mismatch on shardkit_dp[0, 1] #42: rank 0 all_gather 4096 B
                (forward: all-gather of unit 'blocks.3') vs rank 1 reduce_scatter 2048 B (backward: ...)
                shardkit flight record: no mismatch; behind: shardkit_dp[0, 1, 2, 3]: rank 3 at #41
                (forward: ...); ranks 0-2 at #42 (backward: ...); in step: shardkit_tp[0, 1] #12

        Example:
            >>> try:
            ...     train_step()
            ... except CommTimeoutError:
            ...     print(hb.stall_report(), hb.flight_record(), sep="\n", file=sys.stderr); raise
            >>> print(hb.flight_record(last=2))
            shardkit flight record: no mismatch; behind: shardkit_dp[0, 1]: rank 1 at #41 (optimizer step); rank 0 at #42 (backward: ...)
            rank 0, newest 2 of 32 kept (oldest first):
              #41 all_gather on shardkit_dp[0, 1] 4096 B (optimizer step)
              #42 reduce_scatter on shardkit_dp[0, 1] 4096 B (backward: reduce-scatter of gradient bucket 0)
            rank 1, newest 2 of 32 kept (oldest first):
              #40 reduce_scatter on shardkit_dp[0, 1] 4096 B (backward: reduce-scatter of gradient bucket 0)
              #41 all_gather on shardkit_dp[0, 1] 4096 B (optimizer step)
        """
        if not self._stats:
            return "shardkit flight record: none (Heartbeat(stats=...) was not given the run's CommStats)"
        self._publish()  # this rank's, current
        return _flight_text(self._flights(), last)

    def _run(self) -> None:
        watched, watching = (self.rank + 1) % self.world, True
        while not self._stop.wait(self.interval):
            try:
                self._beat()  # beats on after a verdict: this rank is alive
                if watching and self._check(watched):
                    watching = False
                if self._stats and self._stall_warnings:
                    try:
                        self._check_stall()
                    except Exception as exc:  # noqa: BLE001 - never let the warning stop the beats
                        self._stall_warnings = False
                        print(f"shardkit heartbeat: early stall warnings are off after an error: {exc!r}", file=sys.stderr)
            except Exception:  # noqa: BLE001 - the store went away (the run is ending): stop quietly
                return

    def _check_stall(self) -> None:
        """[Note: an early stall warning]: tell, once per stall, that this rank has issued no
        collective for ``stale_after`` seconds while a member of one of its groups has issued
        fewer on that group."""
        count, now = sum(stats.progress()[0] for stats in self._stats), time.monotonic()
        last, since, told = self._own
        if count != last:
            self._own = (count, now, False)
            return
        if told or now - since < self.stale_after:
            return
        self._own = (count, since, True)
        self._publish()
        flights = self._flights()
        mine = flights.get(self.rank)
        if mine is None or not _first_ahead(self.rank, mine, flights):
            return
        text = (
            f"shardkit stall warning: rank {self.rank} has issued no collective for {now - since:.0f} s; "
            f"{_flight_text(flights, 8).removeprefix('shardkit flight record: ')}\n"
            "(the run ends at the collective timeout unless the ranks behind move on)"
        )
        if self._on_stall is not None:
            self._on_stall(text)
        else:
            print(text, flush=True)  # stdout: a torchrun worker's stderr goes to its log file until the run ends

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
    and :meth:`Heartbeat.flight_record` to stderr when the run's collective times out; None (and
    nothing running) when ``stale_after`` is 0 or the world has one rank.

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
        except CommTimeoutError:  # who the others were waiting for, and where the ranks disagree
            for report in (hb.stall_report, hb.flight_record):
                try:
                    text = report()
                except Exception as exc:  # noqa: BLE001 - the store may be gone too: the timeout stays the error raised
                    text = f"shardkit {report.__name__}: unavailable ({type(exc).__name__}: {exc})"
                print(text, file=sys.stderr, flush=True)
            raise


class _Flight(NamedTuple):
    """A rank's published flight record (:func:`~shardkit.comm.stats.merge_recent`)."""

    records: list[CollectiveRecord]  # oldest first
    calls: dict[str, tuple[int, int]]  # group label -> (collectives, point-to-point calls) issued


def _members(label: str, flights: dict[int, _Flight | None]) -> list[int]:
    """The global ranks in ``label``; for a label without them, the ranks that recorded on it."""
    m = _MEMBERS.search(label)
    if m is None:
        return sorted(rank for rank, f in flights.items() if f is not None and label in f.calls)
    return sorted(rank for rank in map(int, m.group(1).split(", ")) if rank in flights)


def _what(record: CollectiveRecord) -> str:
    """``"all_gather 4096 B (forward)"``."""
    return f"{record.op} {record.nbytes} B" + (f" ({record.phase})" if record.phase else "")


def _mismatches(flights: dict[int, _Flight | None]) -> list[str]:
    """Per group label, the first ``#k`` whose collective differs (op or size) between two
    members that both still hold it: ``"shardkit_dp[0, 1] #42: rank 0 ... vs rank 1 ..."``;
    oldest first (counted back from the first rank's newest record), then by label."""
    labels = sorted({r.group for f in flights.values() if f is not None for r in f.records if not r.p2p})
    found: list[tuple[int, str, str]] = []
    for label in labels:
        members = [rank for rank in _members(label, flights) if flights[rank] is not None]
        held = {  # rank -> {k: (records back from its newest, record)}
            rank: {
                r.seq_in_group: (len(flights[rank].records) - i, r)
                for i, r in enumerate(flights[rank].records)
                if r.group == label and not r.p2p
            }
            for rank in members
        }
        for k in sorted(set().union(*held.values())):
            have = [(rank, held[rank][k]) for rank in members if k in held[rank]]
            (first, (back, want)), *others = have
            odd = next(((rank, r) for rank, (_, r) in others if (r.op, r.nbytes) != (want.op, want.nbytes)), None)
            if odd is not None:
                found.append((-back, label, f"{label} #{k}: rank {first} {_what(want)} vs rank {odd[0]} {_what(odd[1])}"))
                break
    return [text for *_, text in sorted(found)]


def _flight_text(flights: dict[int, _Flight | None], last: int) -> str:
    """:meth:`Heartbeat.flight_record`'s text from the ranks' published records."""
    lines = [_verdict(flights)]
    for rank, flight in flights.items():
        if flight is None:
            lines.append(f"rank {rank}: published no flight record")
        elif not flight.records:
            lines.append(f"rank {rank}: no collectives recorded")
        else:
            shown = flight.records[-last:] if last > 0 else []
            lines.append(f"rank {rank}, newest {len(shown)} of {len(flight.records)} kept (oldest first):")
            lines += [f"  {record}" for record in shown]
    return "\n".join(lines)


def _first_ahead(rank: int, mine: _Flight, flights: dict[int, _Flight | None]) -> bool:
    """Whether ``rank`` is the lowest-numbered rank ahead of a member that has issued fewer
    collectives on one of ``rank``'s groups (per group: pipeline stages issue different ones)."""
    for label, (n, _) in mine.calls.items():
        at = {r: flights[r].calls.get(label, (0, 0))[0] for r in _members(label, flights) if flights[r] is not None}
        fewest = min(at.values(), default=n)
        if n > fewest and rank == min(r for r, c in at.items() if c > fewest):
            return True
    return False


def _phase_at(flight: _Flight, label: str, k: int) -> str:
    """The phase of collective ``#k`` on ``label`` in ``flight``, or ``""`` (not held)."""
    return next((r.phase for r in flight.records if r.group == label and not r.p2p and r.seq_in_group == k), "")


def _verdict(flights: dict[int, _Flight | None]) -> str:
    """The first line of :meth:`Heartbeat.flight_record`."""
    mismatches = _mismatches(flights)
    if mismatches:
        more = f" (also on {len(mismatches) - 1} more group(s))" if len(mismatches) > 1 else ""
        return f"shardkit flight record: mismatch on {mismatches[0]}{more}"
    labels = sorted({label for f in flights.values() if f is not None for label, (n, _) in f.calls.items() if n})
    if not labels:
        return "shardkit flight record: no collectives recorded"
    behind, even = [], []
    for label in labels:
        members = _members(label, flights)
        at = {rank: flights[rank].calls.get(label, (0, 0))[0] for rank in members if flights[rank] is not None}
        silent = [rank for rank in members if flights[rank] is None]
        if len(set(at.values())) == 1 and not silent:
            even.append(f"{label} #{next(iter(at.values()))}")
            continue
        parts = []
        for n in sorted(set(at.values())):
            ranks = [rank for rank in at if at[rank] == n]
            phases = sorted({p for rank in ranks if (p := _phase_at(flights[rank], label, n))}) if n else ["none issued"]
            parts.append(f"{_ranks(ranks)} at #{n}" + (f" ({' | '.join(phases)})" if phases else ""))
        if silent:
            parts.append(f"{_ranks(silent)}: nothing published")
        behind.append(f"{label}: {'; '.join(parts)}")
    if not behind:
        return f"shardkit flight record: no mismatch, every member of each group at the same call: {', '.join(even)}"
    same = f"; in step: {', '.join(even)}" if even else ""
    return f"shardkit flight record: no mismatch; behind: {' | '.join(behind)}{same}"
