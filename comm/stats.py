"""Communication accounting: :class:`CommStats`, passed explicitly to the collectives.

[Note: payload bytes]
``CommStats`` counts, per rank, the *payload* of every collective this rank issues: the bytes
of the full (unsharded) logical tensor the collective is about, ``numel * element_size``:

====================  ==========================================  ===========================
op                    payload bytes (on every participating rank)  example, Ψ elements, fp32
====================  ==========================================  ===========================
``all_reduce``        the reduced tensor                           4Ψ
``reduce_scatter``    the input (before scattering; output × N)   4Ψ
``all_gather``        the output (after gathering; input × N)     4Ψ
``broadcast``         the broadcast tensor (src and receivers)     4Ψ
``send`` / ``recv``   the tensor, on the sender / the receiver     4Ψ
====================  ==========================================  ===========================

This is the unit the ZeRO paper counts in (Rajbhandari et al. 2019: DDP all-reduce "2Ψ" =
reduce-scatter Ψ + all-gather Ψ, each Ψ being the full tensor), so a DDP test can assert
``stats.bytes("all_reduce") == sum(p.numel() * p.element_size() for p in params)`` per step,
and a ZeRO-3 test ``3 ×`` that. It is *not* the number of bytes on the wire, which depends on
the algorithm (a ring all-reduce sends ``2 (N-1)/N`` × payload per rank). A group of size 1
takes the local path, issues no collective, and records nothing. Calls are recorded when
issued (not when completed), so an async op counts even before its handle is waited on.

[Note: the flight recorder]
Each ``CommStats`` also keeps its newest ``recent`` calls (:meth:`CommStats.recent`), each with
its place in its group's order (``#k``: the k-th call on that group since the object was made),
its op, size and the phase label at the time. Backends match collectives by their order on a
group, so the k-th collective on a group must be the same op and size on every member: when two
ranks' records disagree at the same ``#k``, they disagree on which collective comes next, the
classic cause of a hang. Point-to-point ops (:data:`P2P_OPS`) pair by peer and tag, not by
order: they are numbered apart (``p2p #k``, as ProcessGroupNCCL keeps ``seqCollective`` and
``seqP2P`` apart), so a pipeline stage's sends and receives do not shift the numbers of the
collectives on the same group. :func:`merge_recent` merges a rank's several objects, and
:meth:`~shardkit.comm.Heartbeat.flight_record` compares the ranks'. Recording stays one
counter update and one tuple append under the lock that ``record`` already takes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["P2P_OPS", "CollectiveRecord", "CommStats", "group_label", "merge_recent"]

#: ops that pair by peer and tag rather than by their order on the group: numbered apart
#: ([Note: the flight recorder])
P2P_OPS = frozenset({"send", "recv"})


def group_label(group: dist.ProcessGroup) -> str:
    """A readable, rank-independent name for a process group: ``"<desc>[r0, r1, ...]"``.

    ``<desc>`` is the group's description (e.g. ``"shardkit_tp"``) when it has one, else its
    name. The ranks are global ranks, so every member of the group gets the same label.

    Example:
        >>> group_label(ctx.group("tp"))
        'shardkit_tp[0, 1]'
    """
    desc = getattr(group, "group_desc", "") or ""
    if desc in ("", "undefined"):
        desc = f"group{group.group_name}"
    return f"{desc}{dist.get_process_group_ranks(group)}"


@dataclass(frozen=True)
class CollectiveRecord:
    """One call kept by a :class:`CommStats` flight recorder ([Note: the flight recorder]).

    Attributes:
        seq_in_group: which call on ``group`` this is, 1-based, counted since the stats object
            was made (:meth:`CommStats.reset` does not restart it); point-to-point ops
            (:data:`P2P_OPS`) are counted apart from the collectives.
        op: op name, e.g. ``"all_gather"``.
        group: the group's :func:`group_label`, e.g. ``"shardkit_dp[0, 1]"``.
        nbytes: payload bytes ([Note: payload bytes]).
        phase: the recording object's :meth:`CommStats.set_phase` label at the time (``""``
            before any).

    Example:
        >>> stats = CommStats()
        >>> stats.set_phase("forward: all-gather of unit 'blocks.3'")
        >>> stats.record("all_gather", "shardkit_dp[0, 1]", 4096)
        >>> stats.recent()
        [CollectiveRecord(seq_in_group=1, op='all_gather', group='shardkit_dp[0, 1]', nbytes=4096, phase="forward: ...")]
        >>> str(stats.recent()[0])
        "#1 all_gather on shardkit_dp[0, 1] 4096 B (forward: all-gather of unit 'blocks.3')"
    """

    seq_in_group: int
    op: str
    group: str
    nbytes: int
    phase: str

    @property
    def p2p(self) -> bool:
        """Whether the op is point-to-point (numbered apart from the collectives)."""
        return self.op in P2P_OPS

    def __str__(self) -> str:
        where = f" ({self.phase})" if self.phase else ""
        return f"{'p2p ' if self.p2p else ''}#{self.seq_in_group} {self.op} on {self.group} {self.nbytes} B{where}"


class CommStats:
    """Thread-safe counter of collective calls and payload bytes, per (op, group).

    Pass it to a collective as ``stats=``; nothing is recorded globally. Recording takes a lock
    because DDP gradient hooks may fire from autograd worker threads. See
    [Note: payload bytes] (module docstring) for exactly what is counted.

    Args:
        recent: how many of the newest calls to keep for :meth:`recent` (the flight recorder:
            [Note: the flight recorder]); at least 1.

    Raises:
        ValueError: ``recent < 1``.

    Example:
        >>> stats = CommStats()
        >>> all_reduce(grad, group=ctx.group("dp"), stats=stats)   # grad: fp32 [1024]
        >>> stats.calls("all_reduce"), stats.bytes("all_reduce")
        (1, 4096)
        >>> stats.summary()["all_reduce"]
        {'calls': 1, 'bytes': 4096, 'groups': {'shardkit_dp[0, 1]': {'calls': 1, 'bytes': 4096}}}
    """

    def __init__(self, recent: int = 32) -> None:
        if recent < 1:
            raise ValueError(f"recent must be >= 1, got {recent}")
        self._lock = threading.Lock()
        # (op, group label) -> [calls, bytes, calls since construction (reset() keeps them: they
        # number the calls as the backend orders them, see recent)]
        self._counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        self._issued = 0  # every call recorded since construction (reset() keeps it: see progress)
        self._last: tuple[str, str] | None = None
        self._phase: tuple[str, float] = ("", 0.0)  # (label, time.monotonic() when set)
        # the newest calls: (time.monotonic(), op, label, nbytes, (phase label, when set)); the
        # calls are numbered when read (recent), from the counts, so record() stays cheap
        self._ring: deque[tuple[float, str, str, int, tuple[str, float]]] = deque(maxlen=recent)

    def record(self, op: str, group: dist.ProcessGroup | str, nbytes: int) -> None:
        """Record one call of ``op`` on ``group`` moving ``nbytes`` payload bytes.

        The collectives call this themselves; code that communicates by other means (e.g.
        ``batch_isend_irecv``) calls it to stay in the same accounting.

        Args:
            op: op name, e.g. ``"all_reduce"``.
            group: the process group (or an already computed :func:`group_label`).
            nbytes: payload bytes, as defined in [Note: payload bytes]; must be >= 0.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        label = group if isinstance(group, str) else group_label(group)
        nbytes = int(nbytes)
        with self._lock:
            entry = self._counts[(op, label)]
            entry[0] += 1
            entry[1] += nbytes
            entry[2] += 1
            self._issued += 1
            self._last = (op, label)
            # stamped under the lock: merge_recent orders by it, so it must follow the ring's order
            self._ring.append((time.monotonic(), op, label, nbytes, self._phase))

    def _total(self, index: int, op: str | None, group: dist.ProcessGroup | str | None) -> int:
        label = None if group is None else (group if isinstance(group, str) else group_label(group))
        with self._lock:
            return sum(
                v[index] for (o, g), v in self._counts.items() if (op is None or o == op) and (label is None or g == label)
            )

    def calls(self, op: str | None = None, *, group: dist.ProcessGroup | str | None = None) -> int:
        """Number of calls recorded for ``op`` (all ops if None), optionally on one ``group``."""
        return self._total(0, op, group)

    def bytes(self, op: str | None = None, *, group: dist.ProcessGroup | str | None = None) -> int:
        """Payload bytes recorded for ``op`` (all ops if None), optionally on one ``group``."""
        return self._total(1, op, group)

    def bytes_per_link(self, ranks_per_machine: int, op: str | None = None) -> dict[str, int]:
        """Payload bytes recorded (for ``op``, all ops if None) split by where their group lies:
        ``"within_machine"`` for groups whose ranks all sit on one machine, ``"across_machines"``
        for groups that span machines. Machine ``m`` holds the global ranks
        ``[m·ranks_per_machine, (m+1)·ranks_per_machine)`` (torchrun's placement; pass
        ``LOCAL_WORLD_SIZE``). A group recorded by a label with no rank list (a string that is
        not a :func:`group_label`) counts under ``"unplaced"``.

        The split is by group, in payload bytes ([Note: payload bytes]): a collective over a group
        that spans machines counts whole under ``"across_machines"``, though a ring moves part of
        it inside each machine. It is the measure hierarchical collectives are judged by: ZeRO-3
        moves 3Ψ per step over its dp group; with ``reshard_after_forward`` set to the dp ranks
        per machine the backward's all-gather Ψ moves within machines
        ([Note: hierarchical gathers] in ``shardkit.parallel.zero.stage3_shards``).

        Args:
            ranks_per_machine: ranks on each machine, >= 1.
            op: one op's bytes (e.g. ``"all_gather"``), or None for all.

        Raises:
            ValueError: ``ranks_per_machine < 1``.

        Example:
            >>> stats.bytes_per_link(ranks_per_machine=2)   # 2 machines x 2 ranks, ZeRO-3, hpZ
            {'within_machine': 4096, 'across_machines': 8192, 'unplaced': 0}
        """
        if isinstance(ranks_per_machine, bool) or not isinstance(ranks_per_machine, int) or ranks_per_machine < 1:
            raise ValueError(f"ranks_per_machine must be an int >= 1, got {ranks_per_machine!r}")
        with self._lock:
            items = [(label, v[1]) for (o, label), v in self._counts.items() if op is None or o == op]
        out = {"within_machine": 0, "across_machines": 0, "unplaced": 0}
        for label, nbytes in items:
            ranks = _ranks_of(label)
            if ranks is None:
                out["unplaced"] += nbytes
            elif len({r // ranks_per_machine for r in ranks}) == 1:
                out["within_machine"] += nbytes
            else:
                out["across_machines"] += nbytes
        return out

    def progress(self) -> tuple[int, tuple[str, str] | None]:
        """``(calls issued so far, (op, group label) of the last one)``, for telling which rank is
        behind when a collective stalls (:meth:`~shardkit.comm.Heartbeat.stall_report`). Unlike
        :meth:`calls`, the count survives :meth:`reset`: ranks that run the same program have
        issued the same number of calls at the same point.

        Example:
            >>> stats.progress()
            (41, ('all_gather', 'shardkit_dp[0, 1]'))
        """
        with self._lock:
            return self._issued, self._last

    def recent(self) -> list[CollectiveRecord]:
        """The newest calls recorded (at most ``recent`` of them), oldest first: a snapshot.

        Unlike :meth:`calls`, the records and their numbers survive :meth:`reset`. To merge a
        rank's several objects, use :func:`merge_recent`.

        Example:
            >>> stats = CommStats(recent=2)
            >>> for op in ("all_gather", "reduce_scatter", "all_gather"):
            ...     stats.record(op, "shardkit_dp[0, 1]", 64)
            >>> [str(r) for r in stats.recent()]
            ['#2 reduce_scatter on shardkit_dp[0, 1] 64 B', '#3 all_gather on shardkit_dp[0, 1] 64 B']
        """
        with self._lock:
            ring, calls = list(self._ring), self._calls_per_group()
        return _numbered(ring, calls)

    def _calls_per_group(self) -> dict[tuple[str, bool], int]:
        """``{(group label, point-to-point?): calls since construction}``; hold the lock."""
        calls: dict[tuple[str, bool], int] = defaultdict(int)
        for (op, label), entry in self._counts.items():
            calls[(label, op in P2P_OPS)] += entry[2]
        return calls

    def set_phase(self, label: str) -> None:
        """Say what the code recording into this object is doing now, e.g. ``"forward: all-gather
        of unit 'blocks.3'"`` or ``"pipeline: receive of micro-batch 2 from stage 0"``.
        :class:`~shardkit.comm.Heartbeat` publishes the newest label of a rank's stats objects,
        and its stall report and verdicts show it.

        Example:
            >>> stats.set_phase("optimizer step")
            >>> stats.phase()[0]
            'optimizer step'
        """
        self._phase = (label, time.monotonic())

    def phase(self) -> tuple[str, float]:
        """``(label, when)``: the last :meth:`set_phase` label (``""`` before any) and its
        ``time.monotonic()`` stamp (to tell the newest of several objects)."""
        return self._phase

    def reset(self) -> None:
        """Forget the counts recorded so far (e.g. at the start of each measured step); the
        progress (:meth:`progress`) and the flight recorder (:meth:`recent`) are kept."""
        with self._lock:
            for entry in self._counts.values():
                entry[0] = entry[1] = 0

    def summary(self) -> dict[str, dict]:
        """A JSON-friendly snapshot: ``{op: {"calls", "bytes", "groups": {label: {"calls", "bytes"}}}}``."""
        with self._lock:
            items = sorted((k, v[:2]) for k, v in self._counts.items() if v[0])  # not those reset
        out: dict[str, dict] = {}
        for (op, label), (calls, nbytes) in items:
            entry = out.setdefault(op, {"calls": 0, "bytes": 0, "groups": {}})
            entry["calls"] += calls
            entry["bytes"] += nbytes
            entry["groups"][label] = {"calls": calls, "bytes": nbytes}
        return out

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls()}, bytes={self.bytes()})"


def merge_recent(stats: Sequence[CommStats]) -> tuple[list[CollectiveRecord], dict[str, tuple[int, int]]]:
    """One rank's flight record from its several :class:`CommStats` (e.g. a DP wrapper's and the
    model's): their newest calls merged in the order they were recorded, numbered per group over
    all of them ([Note: the flight recorder]).

    When two objects record on one group, the backend orders their calls together, so the number
    of a call is counted over both: the newest call on a group gets the sum of the objects' calls
    on it, the ones before it count down from there. Only the span that every object still holds
    is kept (an object whose ring dropped calls holds nothing older than its oldest record), at
    most the largest ``recent`` of the objects. An object given twice counts once.

    Args:
        stats: the rank's stats objects.

    Returns:
        ``(records, calls)``: the merged records, oldest first; and per group label, ``(collectives,
        point-to-point calls)`` recorded on it in all, including those no longer kept.

    Example:
        >>> wrapper, model = CommStats(), CommStats()
        >>> wrapper.record("all_reduce", "shardkit_dp[0, 1]", 64)
        >>> model.record("all_reduce", "shardkit_dp[0, 1]", 8)
        >>> records, calls = merge_recent([wrapper, model])
        >>> [str(r) for r in records], calls
        (['#1 all_reduce on shardkit_dp[0, 1] 64 B', '#2 all_reduce on shardkit_dp[0, 1] 8 B'], {'shardkit_dp[0, 1]': (2, 0)})
    """
    unique = list({id(s): s for s in stats}.values())  # a lock taken twice would deadlock
    if not unique:
        return [], {}
    with contextlib.ExitStack() as held:  # all at once: no object records between the snapshots
        for s in sorted(unique, key=id):  # one order for every caller (record() takes one lock): no deadlock
            held.enter_context(s._lock)
        rings = [list(s._ring) for s in unique]
        dropped = [s._issued > len(s._ring) for s in unique]
        totals: dict[tuple[str, bool], int] = defaultdict(int)
        for s in unique:
            for key, n in s._calls_per_group().items():
                totals[key] += n
    # every call at or after the newest "oldest record" among the objects that dropped some is kept
    since = max((ring[0][0] for ring, lost in zip(rings, dropped, strict=True) if lost), default=float("-inf"))
    merged = sorted(
        ((entry, i, j) for i, ring in enumerate(rings) for j, entry in enumerate(ring) if entry[0] >= since),
        key=lambda e: (e[0][0], e[1], e[2]),
    )[-max(s._ring.maxlen or 1 for s in unique) :]
    records = _numbered([entry for entry, _, _ in merged], totals)
    calls = {label: (totals.get((label, False), 0), totals.get((label, True), 0)) for label in sorted({k[0] for k in totals})}
    return records, calls


def _ranks_of(label: str) -> list[int] | None:
    """The global ranks a :func:`group_label` ends with (``"shardkit_dp[0, 1]"`` -> ``[0, 1]``),
    or None for a label without them."""
    if not label.endswith("]") or "[" not in label:
        return None
    try:
        return [int(r) for r in label[label.rindex("[") + 1 : -1].split(",")]
    except ValueError:
        return None


def _numbered(
    ring: list[tuple[float, str, str, int, tuple[str, float]]], calls: dict[tuple[str, bool], int]
) -> list[CollectiveRecord]:
    """The records of ``ring`` (oldest first, every call since its first one), numbered backwards
    from ``calls``: the newest call on a group is its last one."""
    nxt = dict(calls)
    records: list[CollectiveRecord] = []
    for _, op, label, nbytes, (phase, _) in reversed(ring):
        key = (label, op in P2P_OPS)
        records.append(CollectiveRecord(nxt[key], op, label, nbytes, phase))
        nxt[key] -= 1
    records.reverse()
    return records
