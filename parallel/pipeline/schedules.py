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
``RECV_B(s - 1, i)``. Matching is by identity, which the executor realises with a P2P tag per
(stage, micro-batch, direction) on gloo. NCCL ignores tags and matches in posting order per
rank pair, so every built-in list is also FIFO-consistent: the sends from rank ``a`` to rank
``b`` appear in ``a``'s list in the order the receives from ``a`` appear in ``b``'s (tested).

[Note: posting receives ahead]
A ``RECV`` action *posts* the receive (a non-blocking ``irecv``); nothing in the lists waits.
The wait is implicit and lazy: the compute that consumes the data (``F(s, i)`` for
``RECV_F(s, i)``, ``B``/``BI(s, i)`` for ``RECV_B(s, i)``) waits for it right before it runs,
and that blocked time is the receive's ``wait`` in a timeline. A run of consecutive
communication actions is posted together (one ``batch_isend_irecv``); sends are waited at the
end of the step. So a receive can be posted early without blocking the rank, and where it is
placed decides only which run it joins. 1F1B-style lists (gpipe, 1f1b, zb-h1) post each receive
in the run right before its consumer, which is the run of the send the peer waits on (Megatron-
LM's ``send_forward_recv_backward``). Interleaved 1F1B posts each receive in the run after the
previous compute of the same direction (the next forward's input with this forward's output,
the next backward's gradient with this backward's gradient: Megatron-LM's interleaved schedule
with ``overlap_p2p_comm``); posted right before its consumer instead, it deadlocks on NCCL for
``m > p`` (p = 2, m = 4, v = 2: rank 0 sends B2.0 while rank 1 sends B3.1).
:func:`simulate` models both transports. gloo: a send completes when posted; a receive's
data lands ``t_comm`` after both its send is posted and the receiver's "ready" message has
reached the sender (see [Note: receives ahead on gloo]), each transfer on its own. NCCL (``rendezvous=True``): each
rank's runs execute one after another in posting order (one stream), and a run completes only
once every transfer in it has met its match, i.e. once the peer's run holding the match has
started; a receive's data is there when its run completes. A cycle of runs waiting on each
other is a deadlock the simulator reports; the tests check that none exists for every built-in
schedule, p <= 8, m <= 32, v <= 4.

[Note: receives ahead on gloo]
gloo is a rendezvous transport too: a send whose receive is not posted yet only announces
itself, and the bytes leave once the receiver's "ready" message has reached the sender's event
loop (gloo's tcp ``Pair::send``: it transmits at once only when a remote receive is pending).
A receive posted right before its consumer therefore puts a round trip between two busy
processes on the critical path of every hand-off; on the 2-core CI machine that was 2-5 ms of
visible wait per hand-off, the larger part of the measured bubble's excess over the formula.
Posted one compute earlier, the handshake and the transfer happen while the receiver computes.
gloo's sends never block the sender and its P2P matches by tag, so any placement of the
receives is deadlock-free and correct there; ``build_schedule(..., recv_ahead=k)`` posts each
receive ``k`` computes before its consumer (``k`` more receive buffers alive per rank), and the
executor uses it on gloo. NCCL keeps the default placement: it matches in posting order and its
sends can block (a test shows ahead-posted lists deadlocking under ``rendezvous=True``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import COMPUTE, Action, Kind, Schedule, TimedAction, receive_for
from .simulator import DeadlockError, SimResult, simulate

__all__ = [
    "COMPUTE",
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


def _with_comm(
    compute: list[Action], p: int, num_stages: int, r: int, *, ahead: bool, recv_ahead: int | None = None
) -> list[Action]:
    """Insert sends right after the compute that produces them, and each receive right before
    the compute that consumes it or, with ``ahead``, in the run after the previous compute of
    the same direction; with ``recv_ahead = k``, ``k`` computes before its consumer (see
    [Note: posting receives ahead] and [Note: receives ahead on gloo])."""
    front: list[Action] = []  # posted before the first compute
    before: list[list[Action]] = [[] for _ in compute]
    after: list[list[Action]] = [[] for _ in compute]
    last: dict[bool, int] = {}  # direction (True: forward) -> index of its latest compute
    for j, a in enumerate(compute):
        fwd = a.kind is Kind.F
        recv = receive_for(a, p, num_stages)
        if recv is not None:
            if recv_ahead is not None:
                k = j - recv_ahead - 1  # computes k+1 .. j-1 run between posting and waiting
                (before[j] if recv_ahead == 0 else after[k] if k >= 0 else front).append(recv)
            else:
                (after[last[fwd]] if ahead and fwd in last else before[j]).append(recv)
        if a.kind is not Kind.BW:
            last[fwd] = j
    out: list[Action] = list(front)
    for j, a in enumerate(compute):
        out += before[j]
        out.append(a)
        s, i = a.stage, a.mb
        if a.kind is Kind.F and s < num_stages - 1 and (s + 1) % p != r:
            out.append(Action(Kind.SEND_F, s, i))
        if a.kind in (Kind.B, Kind.BI) and s > 0 and (s - 1) % p != r:
            out.append(Action(Kind.SEND_B, s, i))
        out += after[j]
    return out


#: Schedule names accepted by :func:`build_schedule`.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")


def build_schedule(
    name: str, *, num_ranks: int, microbatches: int, virtual_stages: int = 1, recv_ahead: int | None = None
) -> Schedule:
    """Build the per-rank action lists of a named schedule.

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (interleaved 1F1B) or ``"zb-h1"``.
        num_ranks: ``p >= 1``, the pp group size.
        microbatches: ``m >= 1``; any value for gpipe/1f1b/zb-h1 (``m < p`` included);
            a multiple of ``p`` for interleaved (as Megatron requires).
        virtual_stages: ``v >= 1`` stages per rank; ``v > 1`` only for interleaved.
        recv_ahead: None (default): each receive where every transport is safe, NCCL included
            (see [Note: posting receives ahead]). An int ``k >= 0``: each receive posted ``k``
            computes before the compute consuming it, for transports whose sends never block
            and match receives by tag (gloo; see [Note: receives ahead on gloo]).

    Returns:
        The :class:`Schedule`, communication actions included.

    Raises:
        ValueError: unknown name, sizes < 1, ``v > 1`` for a non-interleaved schedule, or
            interleaved with ``m % p != 0``, ``recv_ahead`` not None or an int ``>= 0``
            (raised before anything runs).

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
    if recv_ahead is not None and (not isinstance(recv_ahead, int) or isinstance(recv_ahead, bool) or recv_ahead < 0):
        raise ValueError(f"recv_ahead must be None or an int >= 0, got {recv_ahead!r}")
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
        lists.append(tuple(_with_comm(compute, p, p * v, r, ahead=name == "interleaved", recv_ahead=recv_ahead)))
    return Schedule(name, p, v, m, tuple(lists))


# ---- simulator --------------------------------------------------------------------------------


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
