"""Pipeline schedules as data (no processes): structure, matching, no deadlock, in-flight bound,
and the simulated bubble against the formulas of docs/reference.md ("Pipeline bubbles"), which
are written out here as the independent reference."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.parallel.pipeline.schedules import (
    Action,
    DeadlockError,
    Kind,
    Schedule,
    build_schedule,
    in_flight,
    simulate,
)

P = st.integers(1, 8)
M = st.integers(1, 32)


@st.composite
def configs(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]))
    p = draw(P)
    if name == "interleaved":
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, 32 // p))
    else:
        v, m = 1, draw(M)
    return name, p, m, v


def _check_structure(s: Schedule) -> None:
    p, v, m, S = s.num_ranks, s.virtual_stages, s.microbatches, s.num_stages
    split = s.name == "zb-h1"
    for r, acts in enumerate(s.actions):
        pos = {(a.kind, a.stage, a.mb): n for n, a in enumerate(acts)}
        assert len(pos) == len(acts), f"rank {r} repeats an action"
        for st_ in range(r, S, p):
            for i in range(m):
                f = pos[(Kind.F, st_, i)]
                if split:
                    bi, bw = pos[(Kind.BI, st_, i)], pos[(Kind.BW, st_, i)]
                    assert f < bi < bw, f"rank {r} stage {st_} mb {i}: F, BI, BW out of order"
                else:
                    assert f < pos[(Kind.B, st_, i)], f"rank {r} stage {st_} mb {i}: B before F"
        n_compute = sum(a.kind in (Kind.F, Kind.B, Kind.BI, Kind.BW) for a in acts)
        assert n_compute == v * m * (3 if split else 2)
        assert all(a.stage % p == r for a in acts)


def _check_matching(s: Schedule) -> None:
    # every send is matched by exactly one receive on the peer's rank, and vice versa
    p = s.num_ranks
    sends, recvs = Counter(), Counter()
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind is Kind.SEND_F:
                sends[(r, (a.stage + 1) % p, "F", a.stage + 1, a.mb)] += 1
            elif a.kind is Kind.RECV_F:
                recvs[((a.stage - 1) % p, r, "F", a.stage, a.mb)] += 1
            elif a.kind is Kind.SEND_B:
                sends[(r, (a.stage - 1) % p, "B", a.stage - 1, a.mb)] += 1
            elif a.kind is Kind.RECV_B:
                recvs[((a.stage + 1) % p, r, "B", a.stage, a.mb)] += 1
    assert sends == recvs
    assert all(c == 1 for c in sends.values())
    # every stage boundary that crosses ranks carries one activation and one gradient per mb
    crossing = sum(1 for st_ in range(s.num_stages - 1) if st_ % p != (st_ + 1) % p)
    assert sum(sends.values()) == 2 * crossing * s.microbatches


@settings(max_examples=300, deadline=None)
@given(configs())
def test_schedule_structure_matching_and_no_deadlock(cfg):
    name, p, m, v = cfg
    s = build_schedule(name, num_ranks=p, microbatches=m, virtual_stages=v)
    _check_structure(s)
    _check_matching(s)
    res = simulate(s)  # raises DeadlockError if stuck
    assert res.makespan > 0
    # a receive is waited lazily: its timed span ends where the compute consuming it starts,
    # and only the part its consumer spent blocked is wait
    for r, tl in enumerate(res.timeline):
        assert [ta.action for ta in tl] == list(s.actions[r])
        start = {ta.action: ta.start for ta in tl}
        for ta in tl:
            if ta.action.kind in (Kind.RECV_F, Kind.RECV_B):
                consumer = Action(Kind.F if ta.action.kind is Kind.RECV_F else Kind.B, ta.action.stage, ta.action.mb)
                consumer = consumer if consumer in start else Action(Kind.BI, consumer.stage, consumer.mb)
                assert ta.start <= ta.end == start[consumer] and 0 <= ta.wait <= ta.end - ta.start
            else:
                assert ta.wait == 0


@settings(max_examples=300, deadline=None)
@given(configs())
def test_sends_are_posted_in_the_order_they_are_received(cfg):
    # NCCL matches P2P in posting order per rank pair (it ignores tags): the built-in schedules
    # must not rely on tags for correctness
    name, p, m, v = cfg
    s = build_schedule(name, num_ranks=p, microbatches=m, virtual_stages=v)
    sent, received = {}, {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind is Kind.SEND_F:
                sent.setdefault((r, (a.stage + 1) % p), []).append(("F", a.stage + 1, a.mb))
            elif a.kind is Kind.SEND_B:
                sent.setdefault((r, (a.stage - 1) % p), []).append(("B", a.stage - 1, a.mb))
            elif a.kind is Kind.RECV_F:
                received.setdefault(((a.stage - 1) % p, r), []).append(("F", a.stage, a.mb))
            elif a.kind is Kind.RECV_B:
                received.setdefault(((a.stage + 1) % p, r), []).append(("B", a.stage, a.mb))
    assert sent == received


@settings(max_examples=200, deadline=None)
@given(P, M)
def test_one_f_one_b_keeps_at_most_p_in_flight(p, m):
    for name in ("1f1b", "zb-h1"):
        s = build_schedule(name, num_ranks=p, microbatches=m)
        for r, acts in enumerate(s.actions):
            assert in_flight(acts) <= min(p, m), (name, r)
    # GPipe, for contrast, holds all m: the bound is not vacuous
    assert in_flight(build_schedule("gpipe", num_ranks=p, microbatches=m).actions[0]) == m


@settings(max_examples=200, deadline=None)
@given(P, M, st.sampled_from([(1, 1), (1, 2), (2, 1), (3, 2)]))
def test_bubble_gpipe_and_1f1b(p, m, times):
    t_f, t_b = times
    for name in ("gpipe", "1f1b"):
        res = simulate(build_schedule(name, num_ranks=p, microbatches=m), t_f=t_f, t_b=t_b, t_w=0.0)
        assert res.bubble_fraction == pytest.approx((p - 1) / m)


@settings(max_examples=60, deadline=None)  # each example simulates up to p * 16 * v micro-batch stages
@given(P, st.integers(1, 16), st.integers(1, 4))
def test_bubble_interleaved(p, k, v):
    m = p * k
    res = simulate(build_schedule("interleaved", num_ranks=p, microbatches=m, virtual_stages=v))
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m))


@settings(max_examples=200, deadline=None)
@given(P, M, st.sampled_from([(1, 1, 1), (2, 1, 1), (1, 2, 1), (3, 2, 1), (1, 2, 0.5)]))
def test_bubble_zb_h1(p, m, times):
    t_f, t_b, t_w = times
    res = simulate(build_schedule("zb-h1", num_ranks=p, microbatches=m), t_f=t_f, t_b=t_b, t_w=t_w)
    idle = res.bubble_fraction * m * (t_f + t_b + t_w)
    if m >= p:
        # docs/reference.md: (p - 1)(T_F + T_B - T_W), for T_W <= T_F, T_B (W fits the gaps)
        assert idle == pytest.approx((p - 1) * (t_f + t_b - t_w))
    else:
        # fewer micro-batches than stages: only m - 1 deferred W's exist to fill the cool-down
        assert idle == pytest.approx((p - 1) * (t_f + t_b) - (m - 1) * t_w)
    one_f_one_b = simulate(build_schedule("1f1b", num_ranks=p, microbatches=m), t_f=t_f, t_b=t_b, t_w=t_w)
    assert res.makespan <= one_f_one_b.makespan


def test_unit_bubble_examples():
    # the docstring numbers, worked by hand: GPipe p=4, m=8: makespan (m + p - 1) * 3 = 33
    res = simulate(build_schedule("gpipe", num_ranks=4, microbatches=8), t_f=1, t_b=1, t_w=1)
    assert res.makespan == 33 and res.busy == [24.0] * 4
    zb = simulate(build_schedule("zb-h1", num_ranks=4, microbatches=8))
    assert zb.makespan == 24 + 3  # one third of 1F1B's 9 idle units


def test_deadlock_is_detected():
    # rank 0 waits for a gradient before the backward that precedes its activation send
    a = Action
    bad = Schedule(
        "bad",
        2,
        1,
        1,
        (
            (a(Kind.F, 0, 0), a(Kind.RECV_B, 0, 0), a(Kind.B, 0, 0), a(Kind.SEND_F, 0, 0)),
            (a(Kind.RECV_F, 1, 0), a(Kind.F, 1, 0), a(Kind.B, 1, 0), a(Kind.SEND_B, 1, 0)),
        ),
    )
    with pytest.raises(DeadlockError, match="rank 0: B0.0 waits on RECV_B0.0, .*rank 1: F1.0 waits on RECV_F1.0"):
        simulate(bad)


def test_recorded_wait_is_separate_from_compute():
    res = simulate(build_schedule("gpipe", num_ranks=2, microbatches=1))
    recv = [ta for ta in res.timeline[1] if ta.action.kind is Kind.RECV_F][0]
    assert recv.start == 0.0 and recv.end == 1.0 and recv.wait == 1.0  # posted at once, waited one F


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="pipedream", num_ranks=2, microbatches=2), "schedule must be one of"),
        (dict(name="1f1b", num_ranks=0, microbatches=2), "num_ranks"),
        (dict(name="1f1b", num_ranks=2, microbatches=0), "microbatches"),
        (dict(name="1f1b", num_ranks=2, microbatches=2, virtual_stages=2), "virtual_stages=2 needs"),
        (dict(name="interleaved", num_ranks=4, microbatches=6, virtual_stages=2), "multiple of the pp size 4"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(**kwargs)


@settings(max_examples=100, deadline=None)
@given(configs())
def test_survives_blocking_sends(cfg):
    # NCCL model: each rank's runs complete in posting order, each once its peers have started
    # the runs holding the matching transfers ([Note: posting receives ahead]). Every built-in
    # schedule, interleaved with m > p included, completes under it.
    name, p, m, v = cfg
    simulate(build_schedule(name, num_ranks=p, microbatches=m, virtual_stages=v), rendezvous=True)


def _posted_before_consumer(s: Schedule) -> Schedule:
    # the same lists with every receive moved to the run right before the compute consuming it
    lists = []
    for acts in s.actions:
        out = []
        for a in acts:
            if a.kind not in (Kind.RECV_F, Kind.RECV_B):
                out += [r for r in (s.receive_for(a),) if r is not None] + [a]
        lists.append(tuple(out))
    return Schedule(s.name, s.num_ranks, s.virtual_stages, s.microbatches, tuple(lists))


def test_blocking_sends_and_posting_order():
    # Posted one by one, rank 0 would send F1 while rank 1 sends B0 (both blocked); posted as one
    # run, each send meets the facing receive: rank 0's run after F0.1 is [SEND_F0.1, RECV_B0.0],
    # rank 1's after B1.0 is [SEND_B1.0, RECV_F1.1].
    s = build_schedule("1f1b", num_ranks=2, microbatches=2)
    assert s.actions[0][3:5] == (Action(Kind.SEND_F, 0, 1), Action(Kind.RECV_B, 0, 0))
    assert s.actions[1][3:5] == (Action(Kind.SEND_B, 1, 0), Action(Kind.RECV_F, 1, 1))
    simulate(s, rendezvous=True)
    # Interleaved posts each receive with the previous same-direction compute's send (rank 1
    # posts B1.0's gradient with B3.1's send): that is what lets m > p complete on NCCL ...
    inter = build_schedule("interleaved", num_ranks=2, microbatches=4, virtual_stages=2)
    assert inter.actions[1][12:16] == (
        Action(Kind.RECV_F, 1, 2),
        Action(Kind.B, 3, 1),
        Action(Kind.SEND_B, 3, 1),
        Action(Kind.RECV_B, 1, 0),
    )
    simulate(inter, rendezvous=True)
    # ... posted right before its consumer instead (the lists before this change), rank 0 sends
    # B2.0 while rank 1 sends B3.1, and neither peer has the facing receive in an open run
    late = _posted_before_consumer(inter)
    assert [a for a in late.actions[0] if a.kind in (Kind.F, Kind.B)] == [
        a for a in inter.actions[0] if a.kind in (Kind.F, Kind.B)
    ]
    assert simulate(late).makespan == simulate(inter).makespan  # gloo: placement costs nothing
    with pytest.raises(DeadlockError, match=r"rank 0's open run \[SEND_B2.0\].*rank 1's open run \[SEND_B3.1, RECV_F1.2\]"):
        simulate(late, rendezvous=True)


# ---- receives posted ahead on gloo ([Note: receives ahead on gloo]) -----------------------------
def _compute_index(acts) -> dict:
    """Each receive -> (index among computes of the compute it is posted before, of its consumer)."""
    out, n = {}, 0
    for a in acts:
        if a.kind in (Kind.F, Kind.B, Kind.BI, Kind.BW):
            n += 1
        elif a.kind in (Kind.RECV_F, Kind.RECV_B):
            out[a] = n
    return out


@settings(max_examples=150, deadline=None)
@given(configs(), st.integers(0, 5))
def test_recv_ahead_posts_each_receive_k_computes_early_and_changes_nothing_else(cfg, k):
    name, p, m, v = cfg
    base = build_schedule(name, num_ranks=p, microbatches=m, virtual_stages=v)
    s = build_schedule(name, num_ranks=p, microbatches=m, virtual_stages=v, recv_ahead=k)
    _check_structure(s)
    _check_matching(s)
    for r in range(p):
        drop_recvs = [a for a in s.actions[r] if a.kind not in (Kind.RECV_F, Kind.RECV_B)]
        assert drop_recvs == [a for a in base.actions[r] if a.kind not in (Kind.RECV_F, Kind.RECV_B)]
        computes = [a for a in s.actions[r] if a.kind in (Kind.F, Kind.B, Kind.BI, Kind.BW)]
        for recv, before in _compute_index(s.actions[r]).items():
            consumer = next(j for j, a in enumerate(computes) if s.receive_for(a) == recv)
            assert before == max(consumer - k, 0), f"rank {r}: {recv!r} posted before compute {before}, consumer {consumer}"
    # at zero latency the placement changes no compute time: the bubble formulas still hold
    res, ref = simulate(s), simulate(base)
    assert res.makespan == ref.makespan and res.bubble_fraction == ref.bubble_fraction


@settings(max_examples=60, deadline=None)
@given(configs(), st.sampled_from([0.1, 0.5]))
def test_recv_ahead_takes_gloos_handshake_off_the_critical_path(cfg, t_comm):
    # gloo's data leaves only after the receiver's "ready" reached the sender. Posted right before
    # its consumer, every hand-off pays that round trip on the critical path; posted one compute
    # ahead (t_comm <= half a compute), the handshake overlaps the compute and the step is as fast
    # as with every receive posted at the start (an eager transport), and strictly faster than
    # late posting wherever there is a receive to move (p >= 2, m >= 2).
    name, p, m, v = cfg

    def makespan(k: int) -> float:
        sched = build_schedule(name, num_ranks=p, microbatches=m, virtual_stages=v, recv_ahead=k)
        return simulate(sched, t_comm=t_comm).makespan

    late, early, eager = makespan(0), makespan(1), makespan(10**6)
    assert early == pytest.approx(eager, abs=1e-9)
    if p >= 2 and m >= 2:
        assert early < late - 1e-9

    # Worked by hand: gpipe, p = 2, m = 2, F = 1, B = 2, latency c. Ahead, only the two boundary
    # crossings of the critical path pay c: 9 + 2c. Late, F1.1's receive is posted when F1.0
    # ends (its data: ready + data, 2c after), B0.0 waits c after B1.0's send and B0.1 2c after
    # B1.1's, plus the c of the first crossing: 9 + 6c.
    c = t_comm
    sched = {k: build_schedule("gpipe", num_ranks=2, microbatches=2, recv_ahead=k) for k in (0, 1)}
    assert simulate(sched[1], t_comm=c).makespan == pytest.approx(9 + 2 * c)
    assert simulate(sched[0], t_comm=c).makespan == pytest.approx(9 + 6 * c)


def test_recv_ahead_lists_are_for_gloo_only():
    # NCCL matches in posting order and its sends can block: posted ahead, 1F1B deadlocks there
    s = build_schedule("1f1b", num_ranks=2, microbatches=4, recv_ahead=1)
    simulate(s)  # gloo model: fine
    with pytest.raises(DeadlockError):
        simulate(s, rendezvous=True)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_recv_ahead_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="recv_ahead must be None or an int >= 0"):
        build_schedule("1f1b", num_ranks=2, microbatches=4, recv_ahead=bad)


@settings(max_examples=40, deadline=None)
@given(configs())
def test_stage_times_equal_to_the_scalars_change_nothing(cfg):
    name, p, m, v = cfg
    s = build_schedule(name, num_ranks=p, microbatches=m, virtual_stages=v)
    same = {(k, st_): t for st_ in range(s.num_stages) for k, t in ((Kind.F, 1.0), (Kind.B, 3.0), (Kind.BI, 1.5), (Kind.BW, 1.5))}
    a, b = simulate(s, t_f=1.0, t_b=1.5, t_w=1.5), simulate(s, stage_times=same)
    assert a.makespan == b.makespan and a.busy == b.busy


def test_stage_times_worked_example():
    # gpipe p=2 m=4, stage 1 twice as slow (F 2, B 4; stage 0: F 1, B 2). Rank 1 runs F1.i over
    # [1+2i, 3+2i], then B1.0-B1.3 over [9, 25]; rank 0's B0.3 starts when B1.3 ends: 25 + 2 = 27.
    s = build_schedule("gpipe", num_ranks=2, microbatches=4)
    res = simulate(s, stage_times={(Kind.F, 1): 2.0, (Kind.B, 1): 4.0})
    assert res.makespan == 27.0 and res.busy == [12.0, 24.0]
    assert res.bubble_fraction == pytest.approx((27 - 24) / 24)
