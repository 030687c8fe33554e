"""Pipeline schedules as data: per-rank ordered action lists, and a unit-time simulator.

Pure Python: no torch, no ``torch.distributed``. A schedule says, for each pp rank, the exact
order in which it runs forwards (``F``), backwards (``B``, or the zero-bubble split ``BI`` =
input gradient, ``BW`` = weight gradient) and the point-to-point sends/receives between them.
One executor (:mod:`shardkit.parallel.pipeline.executor`) runs any of them; the simulator
(:func:`simulate`) runs them on paper, with unit times, to check them and measure the bubble
against the formulas in ``docs/reference.md`` ("Pipeline bubbles").

[Note: stages, chunks and ranks]
A model split into ``S = p * v`` stages (``p`` pp ranks, ``v`` virtual stages per rank) places
stage ``s`` on rank ``s % p`` as chunk ``s // p`` (Megatron's looping placement): with ``v = 2``
and ``p = 2``, rank 0 holds stages 0 and 2, rank 1 stages 1 and 3. Actions name the *global*
stage. Consecutive stages on the same rank (only when ``p = 1``) hand tensors over locally, so no
send/receive is emitted for them.

[Note: matching sends and receives]
``SEND_F(s, i)`` (stage ``s``'s output for micro-batch ``i``) is matched by ``RECV_F(s + 1, i)``
on stage ``s + 1``'s rank; ``SEND_B(s, i)`` (the gradient of stage ``s``'s input) by
``RECV_B(s - 1, i)``. A send never blocks (it is posted asynchronously and waited at the end of
the step); a receive blocks until its send has been posted. Matching is by identity, which the
executor realises with a P2P tag per (stage, micro-batch, direction) on gloo. NCCL ignores tags
and matches in posting order per rank pair, which these schedules do not all guarantee (p = 2
mixes both directions on one pair): see docs/pipeline.md, "What is next".
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Action",
    "DeadlockError",
    "Kind",
    "Schedule",
    "SimResult",
    "TimedAction",
    "build_schedule",
    "in_flight",
    "simulate",
]


class Kind(str, enum.Enum):
    """What an :class:`Action` does."""

    F = "F"  # forward of one stage on one micro-batch
    B = "B"  # full backward (input and weight gradients)
    BI = "BI"  # backward, input gradient only (zero bubble "B")
    BW = "BW"  # backward, weight gradient only (zero bubble "W")
    SEND_F = "SEND_F"  # send stage output to the next stage's rank
    RECV_F = "RECV_F"  # receive stage input from the previous stage's rank
    SEND_B = "SEND_B"  # send gradient of stage input to the previous stage's rank
    RECV_B = "RECV_B"  # receive gradient of stage output from the next stage's rank

    def __str__(self) -> str:
        return self.value


COMPUTE = (Kind.F, Kind.B, Kind.BI, Kind.BW)
SENDS = (Kind.SEND_F, Kind.SEND_B)
RECVS = (Kind.RECV_F, Kind.RECV_B)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule.

    Attributes:
        kind: the :class:`Kind`.
        stage: global stage index in ``[0, p * v)`` (see [Note: stages, chunks and ranks]).
        mb: micro-batch index in ``[0, m)``.
    """

    kind: Kind
    stage: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for one step.

    Attributes:
        name: schedule name (a key of :data:`SCHEDULES`).
        num_ranks: ``p``, pp group size.
        virtual_stages: ``v``, stages per rank.
        microbatches: ``m``.
        actions: ``actions[r]`` is rank ``r``'s ordered tuple of :class:`Action`.
    """

    name: str
    num_ranks: int
    virtual_stages: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        """``S = p * v``."""
        return self.num_ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The pp rank holding ``stage`` (``stage % p``)."""
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages held by ``rank``, in increasing order."""
        return list(range(rank, self.num_stages, self.num_ranks))


# ---- compute orders (no communication yet) ------------------------------------------------------
def _gpipe(p: int, m: int, r: int) -> list[Action]:
    return [Action(Kind.F, r, i) for i in range(m)] + [Action(Kind.B, r, i) for i in range(m)]


def _one_f_one_b(p: int, m: int, r: int) -> list[Action]:
    # Warm-up forwards fill the pipe below this rank; then one forward, one backward; the
    # cool-down drains. At most warmup + 1 <= p micro-batches are in flight on rank r.
    warmup = min(p - 1 - r, m)
    out = [Action(Kind.F, r, i) for i in range(warmup)]
    for k in range(m - warmup):
        out += [Action(Kind.F, r, warmup + k), Action(Kind.B, r, k)]
    out += [Action(Kind.B, r, k) for k in range(m - warmup, m)]
    return out


def _zb_h1(p: int, m: int, r: int) -> list[Action]:
    # 1F1B with B split into BI (on the critical path: its result is sent at once) and BW,
    # deferred by r micro-batches on rank r. Later ranks hold fewer activations in 1F1B (p - r),
    # so the r deferred weight passes keep every rank within 1F1B's peak of p in flight, and the
    # deferred BWs fill the cool-down bubble (Qi et al. 2024, ZB-H1).
    warmup = min(p - 1 - r, m)
    out = [Action(Kind.F, r, i) for i in range(warmup)]
    w_next = 0
    for k in range(m):
        if k < m - warmup:
            out.append(Action(Kind.F, r, warmup + k))
        out.append(Action(Kind.BI, r, k))
        if k - r >= 0:
            out.append(Action(Kind.BW, r, k - r))
            w_next = k - r + 1
    out += [Action(Kind.BW, r, i) for i in range(w_next, m)]
    return out


def _interleaved(p: int, m: int, v: int, r: int) -> list[Action]:
    # Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, §2.2): the k-th forward on a rank
    # is chunk (k // p) % v of micro-batch (k // (p v)) p + k % p; backwards walk the chunks in
    # reverse. Needs m % p == 0 (checked by build_schedule).
    total = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd(k: int) -> Action:
        return Action(Kind.F, ((k // p) % v) * p + r, mb(k))

    def bwd(k: int) -> Action:
        return Action(Kind.B, (v - 1 - (k // p) % v) * p + r, mb(k))

    warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
    out = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [fwd(warmup + k), bwd(k)]
    out += [bwd(k) for k in range(total - warmup, total)]
    return out


def _with_comm(compute: list[Action], p: int, num_stages: int, r: int) -> list[Action]:
    """Insert receives right before the compute that needs them and sends right after the
    compute that produces them (see [Note: matching sends and receives])."""
    out: list[Action] = []
    for a in compute:
        s, i = a.stage, a.mb
        if a.kind is Kind.F and s > 0 and (s - 1) % p != r:
            out.append(Action(Kind.RECV_F, s, i))
        if a.kind in (Kind.B, Kind.BI) and s < num_stages - 1 and (s + 1) % p != r:
            out.append(Action(Kind.RECV_B, s, i))
        out.append(a)
        if a.kind is Kind.F and s < num_stages - 1 and (s + 1) % p != r:
            out.append(Action(Kind.SEND_F, s, i))
        if a.kind in (Kind.B, Kind.BI) and s > 0 and (s - 1) % p != r:
            out.append(Action(Kind.SEND_B, s, i))
    return out


#: Schedule names accepted by :func:`build_schedule`.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")


def build_schedule(name: str, *, num_ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build the per-rank action lists of a named schedule.

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (interleaved 1F1B) or ``"zb-h1"``.
        num_ranks: ``p >= 1``, the pp group size.
        microbatches: ``m >= 1``; any value for gpipe/1f1b/zb-h1 (``m < p`` included);
            a multiple of ``p`` for interleaved (as Megatron requires).
        virtual_stages: ``v >= 1`` stages per rank; ``v > 1`` only for interleaved.

    Returns:
        The :class:`Schedule`, communication actions included.

    Raises:
        ValueError: unknown name, sizes < 1, ``v > 1`` for a non-interleaved schedule, or
            interleaved with ``m % p != 0`` (raised before anything runs).

    Example:
        >>> sched = build_schedule("1f1b", num_ranks=2, microbatches=3)
        >>> sched.actions[1]
        (RECV_F1.0, F1.0, B1.0, SEND_B1.0, RECV_F1.1, F1.1, B1.1, SEND_B1.1, RECV_F1.2, F1.2, B1.2, SEND_B1.2)
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    for arg, val in (("num_ranks", num_ranks), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{arg} must be an int >= 1, got {val!r}")
    p, m, v = num_ranks, microbatches, virtual_stages
    if name != "interleaved" and v != 1:
        raise ValueError(f"virtual_stages={v} needs schedule='interleaved'; {name!r} runs one stage per rank")
    if name == "interleaved" and m % p:
        raise ValueError(
            f"schedule='interleaved' needs microbatches to be a multiple of the pp size {p} "
            f"(Megatron-LM's interleaved 1F1B order); got microbatches={m}. Use {m + (-m) % p}, "
            f"or schedule='1f1b'/'zb-h1', which take any micro-batch count"
        )
    gen = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb-h1": _zb_h1}
    lists = []
    for r in range(p):
        compute = _interleaved(p, m, v, r) if name == "interleaved" else gen[name](p, m, r)
        lists.append(tuple(_with_comm(compute, p, p * v, r)))
    return Schedule(name, p, v, m, tuple(lists))


# ---- simulator --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimedAction:
    """An action with its start and end time (simulated units, or seconds when recorded).

    Attributes:
        action: the :class:`Action`.
        start, end: when it started and finished.
        wait: time spent blocked on P2P inside ``[start, end]`` (receives; 0 for compute).
    """

    action: Action
    start: float
    end: float
    wait: float = 0.0


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
) -> SimResult:
    """Run a schedule with fixed action times, as soon as dependencies allow.

    ``F`` takes ``t_f``, ``BI`` takes ``t_b``, ``BW`` takes ``t_w`` and a full ``B`` takes
    ``t_b + t_w`` (the same work, unsplit). A rank runs its list in order; a compute action
    starts when the rank is free and its inputs exist: ``F(s, i)`` needs stage ``s - 1``'s
    output for ``i`` (received, or local), ``B``/``BI(s, i)`` needs ``F(s, i)`` and stage
    ``s + 1``'s input gradient, ``BW(s, i)`` needs ``BI(s, i)``. A run of consecutive
    communication actions is posted together when the rank reaches it (as the executor posts
    it) and finishes when each receive has its data, ``t_comm`` after the matching send was
    posted; see [Note: matching sends and receives].

    Args:
        schedule: from :func:`build_schedule` (or hand-made).
        t_f, t_b, t_w: durations; ``t_b`` is the input-gradient part, ``t_w`` the weight part.
        t_comm: latency of one P2P transfer.
        rendezvous: a send also blocks until the peer has posted the matching receive (the
            NCCL model: a send may not finish before its receive is posted); by default sends
            never block (gloo: the executor waits for them at the end of the step).

    Returns:
        A :class:`SimResult`.

    Raises:
        DeadlockError: no rank can take its next action.
        ValueError: a malformed list (an action twice, on the wrong rank, a send before the
            compute that produces it). A receive without a send is a deadlock.

    Example:
        >>> simulate(build_schedule("gpipe", num_ranks=4, microbatches=8)).bubble_fraction
        0.375
    """
    p, last = schedule.num_ranks, schedule.num_stages - 1
    dur = {Kind.F: t_f, Kind.B: t_b + t_w, Kind.BI: t_b, Kind.BW: t_w}
    done: dict[tuple[Kind, int, int], float] = {}  # (kind, stage, mb) -> end time
    posted: dict[tuple[Kind, int, int], float] = {}  # sends and receives -> when posted
    free = [0.0] * p
    pc = [0] * p
    timeline: list[list[TimedAction]] = [[] for _ in range(p)]

    def bwd_done(s: int, i: int) -> float | None:
        # input gradient of stage s for micro-batch i, from a full B or a BI
        return done.get((Kind.B, s, i), done.get((Kind.BI, s, i)))

    def ready(a: Action, r: int) -> float | None:
        s, i, k = a.stage, a.mb, a.kind
        if k is Kind.F:
            if s == 0:
                return 0.0
            key = (Kind.RECV_F, s, i) if (s - 1) % p != r else (Kind.F, s - 1, i)
            return done.get(key)
        if k in (Kind.B, Kind.BI):
            f = done.get((Kind.F, s, i))
            if s == last or f is None:
                return f
            g = done.get((Kind.RECV_B, s, i)) if (s + 1) % p != r else bwd_done(s + 1, i)
            return None if g is None else max(f, g)
        if k is Kind.BW:
            return done.get((Kind.BI, s, i))
        if k is Kind.SEND_F:
            return done.get((Kind.F, s, i))
        if k is Kind.SEND_B:
            return bwd_done(s, i)
        raise ValueError(f"unknown action kind {k!r}")

    def peer(key: tuple[Kind, int, int]) -> tuple[Kind, int, int]:
        k, s, i = key
        return {
            Kind.SEND_F: (Kind.RECV_F, s + 1, i),
            Kind.RECV_F: (Kind.SEND_F, s - 1, i),
            Kind.SEND_B: (Kind.RECV_B, s - 1, i),
            Kind.RECV_B: (Kind.SEND_B, s + 1, i),
        }[k]

    def comm_run(r: int) -> bool:
        """Post the run of communication actions at rank r's pc together; finish it if matched."""
        acts, first = schedule.actions[r], pc[r]
        last_ = first
        while last_ < len(acts) and acts[last_].kind not in COMPUTE:
            last_ += 1
        run = [(a, (a.kind, a.stage, a.mb)) for a in acts[first:last_]]
        for a, key in run:
            if key not in posted:
                if a.kind in SENDS and ready(a, r) is None:
                    raise ValueError(f"rank {r} sends {a!r} before computing it")
                posted[key] = free[r]
        ends = []
        for a, key in run:
            other = posted.get(peer(key))
            if other is None and (a.kind in RECVS or rendezvous):
                return False
            if a.kind in RECVS:
                ends.append(max(posted[key], other + t_comm))
            else:
                ends.append(max(posted[key], other) if rendezvous else posted[key])
        for (a, key), end in zip(run, ends, strict=True):
            if key in done:
                raise ValueError(f"rank {r} runs {a!r} twice")
            done[key] = end
            wait = end - posted[key] if (a.kind in RECVS or rendezvous) else 0.0
            timeline[r].append(TimedAction(a, posted[key], end, wait))
        free[r] = max([free[r], *ends])
        pc[r] = last_
        return True

    total = sum(len(a) for a in schedule.actions)
    while sum(pc) < total:
        progress = False
        for r in range(p):
            acts = schedule.actions[r]
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if schedule.rank_of(a.stage) != r:
                    raise ValueError(f"rank {r}'s list has {a!r}, but stage {a.stage} is on rank {a.stage % p}")
                if a.kind not in COMPUTE:
                    if not comm_run(r):
                        break
                    progress = True
                    continue
                t = ready(a, r)
                if t is None:
                    break
                start = max(free[r], t)
                key = (a.kind, a.stage, a.mb)
                if key in done:
                    raise ValueError(f"rank {r} runs {a!r} twice")
                done[key] = free[r] = start + dur[a.kind]
                timeline[r].append(TimedAction(a, start, free[r]))
                pc[r] += 1
                progress = True
        if not progress:
            blocked = ", ".join(f"rank {r}: {schedule.actions[r][pc[r]]!r}" for r in range(p) if pc[r] < len(schedule.actions[r]))
            raise DeadlockError(f"schedule {schedule.name!r} deadlocks; blocked at {blocked}")
    busy = [sum(ta.end - ta.start for ta in tl if ta.action.kind in COMPUTE) for tl in timeline]
    makespan = max(free)
    b = max(busy)
    return SimResult(timeline, makespan, busy, (makespan - b) / b if b else 0.0)


def in_flight(actions: Sequence[Action]) -> int:
    """Peak number of micro-batches whose forward ran and whose weight gradient has not, over
    one rank's list (what bounds activation memory).

    Example:
        >>> in_flight(build_schedule("1f1b", num_ranks=4, microbatches=8).actions[0])
        4
    """
    live, peak = 0, 0
    for a in actions:
        if a.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind in (Kind.B, Kind.BW):
            live -= 1
    return peak
