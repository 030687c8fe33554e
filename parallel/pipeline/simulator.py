"""The unit-time pipeline simulator: :func:`simulate` runs per-rank action lists on paper.

Pure Python. It runs a :class:`~shardkit.parallel.pipeline.actions.Schedule` as the executor
would, under the gloo or the NCCL transfer model of [Note: posting receives ahead] in
:mod:`~shardkit.parallel.pipeline.schedules`, to check the lists (no deadlock) and measure the
bubble against the formulas in ``docs/reference.md`` ("Pipeline bubbles").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .actions import COMPUTE, SENDS, Action, Key, Kind, Schedule, TimedAction, receive_for

__all__ = ["DeadlockError", "SimResult", "simulate"]


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` returns.

    Attributes:
        timeline: ``timeline[r]`` is rank ``r``'s list of :class:`TimedAction`.
        makespan: time when the last rank finishes.
        busy: per-rank compute time.
        bubble_fraction: idle time over compute time, ``(makespan - busy) / busy`` for the
            busiest rank (all ranks are equally busy in the built-in schedules).
    """

    timeline: list[list[TimedAction]]
    makespan: float
    busy: list[float]
    bubble_fraction: float


class DeadlockError(RuntimeError):
    """The simulated schedule cannot make progress; the message lists each rank's blocked action."""


def simulate(
    schedule: Schedule,
    *,
    t_f: float = 1.0,
    t_b: float = 1.0,
    t_w: float = 1.0,
    t_comm: float = 0.0,
    rendezvous: bool = False,
    stage_times: Mapping[tuple[Kind, int], float] | None = None,
) -> SimResult:
    """Run a schedule with fixed action times, as soon as dependencies allow.

    ``F`` takes ``t_f``, ``BI`` takes ``t_b``, ``BW`` takes ``t_w`` and a full ``B`` takes
    ``t_b + t_w`` (the same work, unsplit). A rank runs its list in order, as the executor does:
    a run of consecutive communication actions is posted together, without blocking, when the
    rank reaches it; a compute starts when the rank is free and its inputs exist, waiting there
    for the receive it consumes, if any (``F(s, i)`` for stage ``s - 1``'s output, ``B``/``BI(s,
    i)`` for stage ``s + 1``'s input gradient; ``BW(s, i)`` needs ``BI(s, i)``). See
    [Note: posting receives ahead] for the two transfer models.

    Args:
        schedule: from :func:`build_schedule` (or hand-made).
        t_f, t_b, t_w: durations; ``t_b`` is the input-gradient part, ``t_w`` the weight part.
        t_comm: latency of one P2P transfer.
        stage_times: ``{(kind, stage): duration}`` overriding ``t_f``/``t_b``/``t_w`` for the
            pairs it names (e.g. measured per-stage means: unequal stages; a ``B`` is its own
            entry, not ``BI`` + ``BW``).
        rendezvous: the NCCL model (each rank's runs complete in posting order, a run only once
            every peer of its transfers has started the run holding the matching one); by default
            the gloo model: a send completes at once; the data leaves once both the send is
            posted and the receiver's "ready" message (``t_comm`` after the receive is posted)
            has arrived, and lands ``t_comm`` later (see [Note: receives ahead on gloo]).

    Returns:
        A :class:`SimResult`; a receive's :class:`TimedAction` spans its posting to the end of
        its wait, with ``wait`` the time its consumer was blocked.

    Raises:
        DeadlockError: no rank can take its next action (the message names what each waits on).
        ValueError: a malformed list (an action twice, on the wrong rank, a send before the
            compute that produces it, a receive nothing consumes). A receive without a send, or
            after its consumer, is a deadlock.

    Example:
        >>> from shardkit.parallel.pipeline import build_schedule
        >>> simulate(build_schedule("gpipe", num_ranks=4, microbatches=8)).bubble_fraction
        0.375
        >>> slow_last = {(Kind.F, 1): 2.0, (Kind.B, 1): 4.0}   # stage 1 twice as slow
        >>> simulate(build_schedule("gpipe", num_ranks=2, microbatches=4), stage_times=slow_last).makespan
        27.0
    """
    p, S = schedule.num_ranks, schedule.num_stages
    dur = {Kind.F: t_f, Kind.B: t_b + t_w, Kind.BI: t_b, Kind.BW: t_w}
    done: dict[Key, float] = {}  # compute -> end; transfer -> completion (a receive: data there)
    posted: dict[Key, tuple[int, int, float]] = {}  # transfer -> (rank, run number, post time)
    where: dict[Key, int] = {}  # transfer -> index in its rank's list
    runs: list[list[list]] = [[] for _ in range(p)]  # per rank, posting order: [keys, post, start, end]
    head, free, pc = [0] * p, [0.0] * p, [0] * p
    slots: list[list[TimedAction | None]] = [[None] * len(acts) for acts in schedule.actions]

    def key(a: Action) -> Key:
        return (a.kind, a.stage, a.mb)

    def local_ready(a: Action, r: int) -> float | None:
        s, i, k = a.stage, a.mb, a.kind
        if k is Kind.BW:
            return done.get((Kind.BI, s, i))
        if k is Kind.F:
            return 0.0 if s == 0 or (s - 1) % p != r else done.get((Kind.F, s - 1, i))
        f = done.get((Kind.F, s, i))
        if f is None or s == S - 1 or (s + 1) % p != r:
            return f
        g = done.get((Kind.B, s + 1, i), done.get((Kind.BI, s + 1, i)))
        return None if g is None else max(f, g)

    def post_run(r: int) -> None:
        acts, end = schedule.actions[r], pc[r]
        while end < len(acts) and acts[end].kind not in COMPUTE:
            end += 1
        for n in range(pc[r], end):
            a = acts[n]
            produced = done.get((Kind.F if a.kind is Kind.SEND_F else Kind.BI, a.stage, a.mb), done.get((Kind.B, a.stage, a.mb)))
            if a.kind in SENDS and produced is None:
                raise ValueError(f"rank {r} sends {a!r} before computing it")
            if key(a) in posted:
                raise ValueError(f"rank {r} runs {a!r} twice")
            posted[key(a)], where[key(a)] = (r, len(runs[r]), free[r]), n
            if not rendezvous:  # gloo: each transfer on its own; a send completes when posted
                send, recv = (key(a), _peer(key(a))) if a.kind in SENDS else (_peer(key(a)), key(a))
                if a.kind in SENDS:
                    finish(r, send, free[r])
                if send in posted and recv in posted:  # gloo's handshake: the receiver's "ready" first
                    ready = max(posted[send][2], posted[recv][2] + t_comm)
                    finish(posted[recv][0], recv, ready + t_comm)
        if rendezvous:
            runs[r].append([[key(a) for a in acts[pc[r] : end]], free[r], None, None])
        pc[r] = end

    def compute(r: int, a: Action) -> bool:
        t = local_ready(a, r)
        recv = receive_for(a, p, S)
        got = None if recv is None else done.get(key(recv))
        if t is None or (recv is not None and got is None):
            return False
        start = max(free[r], t, got or 0.0)
        if recv is not None:  # the lazy wait: blocked from free[r] until the data is there
            slots[r][where[key(recv)]] = TimedAction(recv, posted[key(recv)][2], start, start - free[r])
        if key(a) in done:
            raise ValueError(f"rank {r} runs {a!r} twice")
        took = stage_times.get((a.kind, a.stage)) if stage_times else None
        done[key(a)] = free[r] = start + (dur[a.kind] if took is None else took)
        slots[r][pc[r]] = TimedAction(a, start, free[r])
        pc[r] += 1
        return True

    def finish(r: int, k: Key, end: float) -> None:
        done[k] = end
        if k[0] in SENDS:
            slots[r][where[k]] = TimedAction(Action(*k), posted[k][2], end)

    def transfer(r: int) -> bool:
        """NCCL: complete what rank r's posted runs can, in order; True if anything changed."""
        moved = False
        while head[r] < len(runs[r]):  # NCCL: in posting order, once every peer's run has started
            run = runs[r][head[r]]
            if run[2] is None:
                run[2], moved = max(run[1], runs[r][head[r] - 1][3] if head[r] else 0.0), True
            peers = [posted.get(_peer(k)) for k in run[0]]
            starts = [None if q is None else runs[q[0]][q[1]][2] for q in peers]
            if None in starts:
                return moved
            run[3] = max([run[2], *(max(run[2], t) + t_comm for t in starts)])
            for k in run[0]:
                finish(r, k, run[3])
            head[r] += 1
            moved = True
        return moved

    total = sum(len(a) for a in schedule.actions)
    while sum(pc) < total or any(head[r] < len(runs[r]) for r in range(p)):
        progress = False
        for r in range(p):
            acts = schedule.actions[r]
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if schedule.rank_of(a.stage) != r:
                    raise ValueError(f"rank {r}'s list has {a!r}, but stage {a.stage} is on rank {a.stage % p}")
                if a.kind in COMPUTE and not compute(r, a):
                    break
                if a.kind not in COMPUTE:
                    post_run(r)
                progress = True
        for r in range(p if rendezvous else 0):
            progress = transfer(r) or progress
        if not progress:
            raise DeadlockError(f"schedule {schedule.name!r} deadlocks; blocked at {_blocked(schedule, pc, runs, head)}")
    for r, tl in enumerate(slots):
        if None in tl:
            raise ValueError(f"rank {r}'s {schedule.actions[r][tl.index(None)]!r} is received but never consumed")
    timeline: list[list[TimedAction]] = slots  # type: ignore[assignment]
    busy = [sum(ta.end - ta.start for ta in tl if ta.action.kind in COMPUTE) for tl in timeline]
    makespan = max([*free, *(ta.end for tl in timeline for ta in tl)])
    b = max(busy)
    return SimResult(timeline, makespan, busy, (makespan - b) / b if b else 0.0)


def _peer(k: Key) -> Key:
    """The transfer matching ``k`` (see [Note: matching sends and receives])."""
    kind, s, i = k
    if kind is Kind.SEND_F:
        return (Kind.RECV_F, s + 1, i)
    if kind is Kind.RECV_F:
        return (Kind.SEND_F, s - 1, i)
    if kind is Kind.SEND_B:
        return (Kind.RECV_B, s - 1, i)
    return (Kind.SEND_B, s + 1, i)


def _blocked(schedule: Schedule, pc: list[int], runs: list[list[list]], head: list[int]) -> str:
    """Each stuck rank's next action, the receive it waits on, and (NCCL) its oldest open run."""
    p, S, out = schedule.num_ranks, schedule.num_stages, []
    for r, acts in enumerate(schedule.actions):
        if pc[r] < len(acts):
            recv = receive_for(acts[pc[r]], p, S)
            out.append(f"rank {r}: {acts[pc[r]]!r}" + (f" waits on {recv!r}" if recv else ""))
        if head[r] < len(runs[r]):
            out.append(f"rank {r}'s open run {[Action(*k) for k in runs[r][head[r]][0]]}")
    return ", ".join(out)
