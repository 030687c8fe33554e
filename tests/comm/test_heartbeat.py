"""The heartbeat watchdog: a rank that stops beating is named by the rank that watches it, with
what it last said it was doing; a rank that ends normally is never named; after a stall, the
rank that issued fewer collectives is named as the one the others wait for, and the flight record
names the first collective on which two members of a group disagree (comm/heartbeat.py,
comm/stats.py)."""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch.distributed as dist

from shardkit.comm import CommStats, CommTimeoutError, Heartbeat
from shardkit.comm.heartbeat import watch_run
from shardkit.comm.stats import CollectiveRecord, merge_recent


def _one_rank_goes_silent(silent_rank: int) -> str | None:
    verdicts: list[tuple[int, str]] = []
    hb = Heartbeat(interval=0.1, stale_after=0.6, on_frozen=lambda rank, verdict: verdicts.append((rank, verdict)))
    hb.start()
    hb.note(f"step 7 on rank {dist.get_rank()}")
    time.sleep(0.3)  # at least one beat with the note
    if dist.get_rank() == silent_rank:
        hb._stop.set()  # frozen: no more beats, and not marked done
        hb._thread.join()
    deadline = time.monotonic() + 10
    while dist.get_rank() != silent_rank and not verdicts and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    hb.stop()
    assert len(verdicts) <= 1
    return verdicts[0][1] if verdicts else None


def test_the_rank_watching_a_silent_one_names_it(dist_pool) -> None:
    out = dist_pool.run(_one_rank_goes_silent, 2, world_size=3, timeout=60)
    # the ring: rank 1 watches rank 2; nobody else names anyone
    assert out[0] is None and out[2] is None
    assert out[1] is not None and out[1].startswith("shardkit heartbeat: rank 2 (pid ")
    assert "(last note: step 7 on rank 2): frozen or stopped" in out[1]


def _everyone_ends_at_different_times() -> str | None:
    verdicts: list[str] = []
    with Heartbeat(interval=0.1, stale_after=0.5, on_frozen=lambda rank, verdict: verdicts.append(verdict)):
        time.sleep(0.2 + 1.5 * dist.get_rank())  # rank 0 stops first; rank 1 watches it for 1.5 s more
    dist.barrier()
    return verdicts[0] if verdicts else None


def test_a_rank_that_ended_is_not_called_frozen(dist_pool) -> None:
    assert dist_pool.run(_everyone_ends_at_different_times, world_size=2, timeout=60) == [None, None]


def _progress_then_report(calls: list[int]) -> str:
    stats = CommStats()
    for i in range(calls[dist.get_rank()]):
        stats.record("reduce_scatter" if i % 2 else "all_gather", "shardkit_dp[0, 1, 2, 3]", 64)
    with Heartbeat(interval=0.1, stale_after=30, stats=[stats]) as hb:
        hb.note(f"step {calls[dist.get_rank()] // 2}")
        time.sleep(0.3)  # a beat publishes the note and the progress
        dist.barrier()
        report = hb.stall_report()
        dist.barrier()
    return report


def test_stall_report_names_the_rank_that_issued_fewer_collectives(dist_pool) -> None:
    out = dist_pool.run(_progress_then_report, [6, 6, 5, 6], world_size=4, timeout=60)
    assert len(set(out)) == 1  # every rank tells the same story
    assert out[0] == (
        "shardkit stall: rank 2 is behind: 5 collectives issued (last: all_gather on shardkit_dp[0, 1, 2, 3]; step 2); "
        "ranks 0, 1, 3: 6 collectives issued (last: reduce_scatter on shardkit_dp[0, 1, 2, 3]; step 3)"
    )
    even = dist_pool.run(_progress_then_report, [4, 4, 4, 4], world_size=4, timeout=60)
    assert even[0].startswith("shardkit stall: every rank has issued 4 collectives") and "none is behind" in even[0]


@pytest.mark.parametrize(("interval", "stale_after"), [(0.0, 10.0), (1.0, 2.0)])
def test_bad_intervals_are_refused_before_anything_else(interval: float, stale_after: float) -> None:
    with pytest.raises(ValueError, match="interval|stale_after"):
        Heartbeat(interval=interval, stale_after=stale_after)


def _phases_then_report() -> tuple[str, str | None]:
    """Two stats objects per rank, as a ParallelModel has (the dp wrapper's and its own): the
    newest phase label of either is the one published."""
    wrapper, model = CommStats(), CommStats()
    rank = dist.get_rank()
    model.set_phase("backward")
    time.sleep(0.01)
    for i in range(3 if rank == 1 else 4):
        wrapper.record("reduce_scatter", "shardkit_dp[0, 1]", 64)
    wrapper.set_phase("backward: reduce-scatter of gradient bucket 2" if rank == 1 else "optimizer step")
    verdicts: list[str] = []
    with Heartbeat(interval=0.1, stale_after=0.6, stats=[wrapper, model], on_frozen=lambda r, v: verdicts.append(v)) as hb:
        hb.note("step 9")
        time.sleep(0.3)
        dist.barrier()
        report = hb.stall_report()
        if rank == 1:  # then rank 1 freezes: rank 0 watches it and names its phase
            hb._stop.set()
            hb._thread.join()
        deadline = time.monotonic() + 10
        while rank == 0 and not verdicts and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.barrier()
    return report, verdicts[0] if verdicts else None


def test_the_stall_report_and_a_verdict_name_the_phase_each_rank_was_in(dist_pool) -> None:
    out = dist_pool.run(_phases_then_report, world_size=2, timeout=60)
    assert (
        out[0][0]
        == out[1][0]
        == (
            "shardkit stall: rank 1 is behind: 3 collectives issued (last: reduce_scatter on shardkit_dp[0, 1]; "
            "backward: reduce-scatter of gradient bucket 2; step 9); "
            "rank 0: 4 collectives issued (last: reduce_scatter on shardkit_dp[0, 1]; optimizer step; step 9)"
        )
    )
    assert out[0][1] is not None and out[0][1].endswith(
        "(last note: step 9; in backward: reduce-scatter of gradient bucket 2): frozen or stopped"
    )


def test_comm_stats_keep_the_newest_phase_label() -> None:
    stats = CommStats()
    assert stats.phase() == ("", 0.0)
    stats.set_phase("forward")
    label, when = stats.phase()
    stats.set_phase("backward")
    assert stats.phase()[0] == "backward" and stats.phase()[1] >= when and label == "forward"


# ---- the flight record ----------------------------------------------------------------------
DP4 = "shardkit_dp[0, 1, 2, 3]"
DP2 = "shardkit_dp[0, 1]"
PP2 = "shardkit_pp[0, 1]"


def test_comm_stats_keep_the_newest_calls_numbered_per_group() -> None:
    stats = CommStats(recent=3)
    stats.set_phase("forward")
    stats.record("all_gather", DP2, 64)
    stats.record("all_reduce", "shardkit_tp[0, 1]", 8)
    stats.set_phase("backward")
    stats.record("reduce_scatter", DP2, 64)
    stats.record("send", DP2, 16)  # point-to-point: numbered apart from the collectives
    stats.reset()  # the counts restart, the numbers and the records do not
    stats.record("all_gather", DP2, 32)
    assert stats.calls() == 1 and list(stats.summary()) == ["all_gather"]
    assert stats.recent() == [
        CollectiveRecord(2, "reduce_scatter", DP2, 64, "backward"),
        CollectiveRecord(1, "send", DP2, 16, "backward"),
        CollectiveRecord(3, "all_gather", DP2, 32, "backward"),
    ]
    assert [str(r) for r in stats.recent()[1:]] == [
        "p2p #1 send on shardkit_dp[0, 1] 16 B (backward)",
        "#3 all_gather on shardkit_dp[0, 1] 32 B (backward)",
    ]
    assert str(CollectiveRecord(1, "all_reduce", DP2, 8, "")) == "#1 all_reduce on shardkit_dp[0, 1] 8 B"
    with pytest.raises(ValueError, match="recent must be >= 1, got 0"):
        CommStats(recent=0)


def test_merge_recent_numbers_a_shared_group_over_both_objects() -> None:
    """The wrapper keeps 2 calls and dropped 2: the model's older calls cannot be numbered among
    the dropped ones, so the merged window starts at the wrapper's oldest kept call."""
    wrapper, model = CommStats(recent=2), CommStats(recent=8)
    for stats, op in [(model, "all_reduce"), (wrapper, "all_gather"), (model, "all_reduce")] + [(wrapper, "all_gather")] * 3:
        stats.record(op, DP2, 64)
    model.record("send", PP2, 8)
    records, calls = merge_recent([wrapper, model, wrapper])  # an object given twice counts once
    assert [(r.seq_in_group, r.op, r.group) for r in records] == [
        (5, "all_gather", DP2),
        (6, "all_gather", DP2),
        (1, "send", PP2),
    ]
    assert calls == {DP2: (6, 0), PP2: (0, 1)}
    assert merge_recent([]) == ([], {})


def _record_then_report(calls: list[list[tuple]], recent: list[int], objects: list[int]) -> tuple[str, str]:
    """Rank r records ``calls[r]``: ``(object, phase, op, group, nbytes)``, into ``objects[r]``
    CommStats of ``recent[r]`` records each; then every rank reports."""
    rank = dist.get_rank()
    stats = [CommStats(recent=recent[rank]) for _ in range(objects[rank])]
    for obj, phase, op, group, nbytes in calls[rank]:
        stats[obj].set_phase(phase)
        stats[obj].record(op, group, nbytes)
    with Heartbeat(interval=0.1, stale_after=30, stats=stats) as hb:  # start() publishes
        dist.barrier()
        out = hb.stall_report(), hb.flight_record(last=4)
        dist.barrier()
    return out


def _steps(group: str, n: int) -> list[tuple]:
    """``n`` steps of (forward all-gather, backward reduce-scatter) of 64 B on ``group``."""
    return [c for _ in range(n) for c in ((0, "forward", "all_gather", group, 64), (0, "backward", "reduce_scatter", group, 64))]


@pytest.mark.parametrize(
    ("world", "odd_rank", "odd", "want"),
    [
        # rank 2 skipped #5's all-gather: #6 is off too, the first is named
        (4, 2, [(0, "backward", "reduce_scatter", DP4, 64), (0, "forward", "all_gather", DP4, 64)],
         "shardkit_dp[0, 1, 2, 3] #5: rank 0 all_gather 64 B (forward) vs rank 2 reduce_scatter 64 B (backward)"),
        # rank 1 gathers a tensor of another size
        (2, 1, [(0, "forward", "all_gather", DP2, 32), (0, "backward", "reduce_scatter", DP2, 64)],
         "shardkit_dp[0, 1] #5: rank 0 all_gather 64 B (forward) vs rank 1 all_gather 32 B (forward)"),
    ],
)  # fmt: skip
def test_flight_record_names_the_first_call_two_ranks_disagree_on(
    dist_pool, world: int, odd_rank: int, odd: list[tuple], want: str
) -> None:
    group = DP4 if world == 4 else DP2
    calls = [_steps(group, 3) for _ in range(world)]
    calls[odd_rank][4:6] = odd  # its calls #5 and #6
    out = dist_pool.run(_record_then_report, calls, [32] * world, [1] * world, world_size=world, timeout=60)
    for stall, flight in out:
        assert stall.startswith("shardkit stall: every rank has issued 6 collectives") and stall.endswith(
            f"; first mismatch: {want}"
        )
        assert flight.splitlines()[0] == f"shardkit flight record: mismatch on {want}"
    assert f"rank {odd_rank}, newest 4 of 6 kept (oldest first):\n  #3 all_gather on {group} 64 B (forward)\n" in out[0][1]


def test_groups_are_compared_among_their_own_members(dist_pool) -> None:
    """dp[0, 2], dp[1, 3], tp[0, 1], tp[2, 3]: each group its own sizes and numbers; rank 3
    skipped its last dp call and the loss all-reduce over the world. Comparing ranks across
    groups would find false mismatches; the members are the label's, not the ranks that recorded."""
    calls = []
    for rank in range(4):
        dp, tp = f"shardkit_dp[{rank % 2}, {rank % 2 + 2}]", f"shardkit_tp[{rank // 2 * 2}, {rank // 2 * 2 + 1}]"
        mine = []
        for step in (1, 2, 3):
            mine.append((0, f"step {step}: tp", "all_reduce", tp, 128 * (1 + rank // 2)))
            if not (rank == 3 and step == 3):
                mine.append((0, f"step {step}: dp", "reduce_scatter", dp, 64 * (1 + rank % 2)))
        if rank != 3:
            mine.append((0, "loss", "all_reduce", DP4, 4))
        calls.append(mine)
    out = dist_pool.run(_record_then_report, calls, [32] * 4, [1] * 4, world_size=4, timeout=60)
    for stall, flight in out:
        assert "mismatch" not in stall and stall.startswith("shardkit stall: rank 3 is behind: 5 collectives issued")
        assert flight.splitlines()[0] == (
            "shardkit flight record: no mismatch; behind: shardkit_dp[0, 1, 2, 3]: rank 3 at #0 (none issued); ranks 0-2 at #1 "
            "(loss) | shardkit_dp[1, 3]: rank 3 at #2 (step 2: dp); rank 1 at #3 (step 3: dp); "
            "in step: shardkit_dp[0, 2] #3, shardkit_tp[0, 1] #3, shardkit_tp[2, 3] #3"
        )


def test_sends_and_receives_are_listed_but_not_compared(dist_pool) -> None:
    calls = [
        [(0, "pipeline", "send", PP2, 64), (0, "pipeline", "send", PP2, 64), (0, "loss", "all_reduce", PP2, 8)],
        [(0, "pipeline", "recv", PP2, 64), (0, "pipeline", "recv", PP2, 32), (0, "pipeline", "send", PP2, 16),
         (0, "loss", "all_reduce", PP2, 8)],
    ]  # fmt: skip
    out = dist_pool.run(_record_then_report, calls, [32] * 2, [1] * 2, world_size=2, timeout=60)
    for stall, flight in out:
        assert "mismatch" not in stall
        assert (
            flight.splitlines()[0]
            == "shardkit flight record: no mismatch, every member of each group at the same call: shardkit_pp[0, 1] #1"
        )
        assert (
            "  p2p #2 recv on shardkit_pp[0, 1] 32 B (pipeline)\n  p2p #3 send on shardkit_pp[0, 1] 16 B (pipeline)\n" in flight
        )


@pytest.mark.parametrize("recent", [3, 32])
def test_a_call_a_rank_no_longer_holds_is_not_compared(dist_pool, recent: int) -> None:
    """Rank 1's #2 differs; with 3 records kept it holds #4-#6 only, so nothing can be compared."""
    calls = [_steps(DP2, 3), _steps(DP2, 3)]
    calls[1][1] = (0, "backward", "all_reduce", DP2, 64)
    out = dist_pool.run(_record_then_report, calls, [32, recent], [1, 1], world_size=2, timeout=60)
    want = (
        "shardkit flight record: mismatch on shardkit_dp[0, 1] #2: rank 0 reduce_scatter 64 B (backward) vs rank 1 all_reduce 64 B (backward)"
        if recent == 32
        else "shardkit flight record: no mismatch, every member of each group at the same call: shardkit_dp[0, 1] #6"
    )
    assert [flight.splitlines()[0] for _, flight in out] == [want, want]


def test_two_stats_objects_on_one_group_number_its_calls_together(dist_pool) -> None:
    """A DP wrapper's and the model's CommStats both record on dp; 4 kept each, the wrapper
    dropped its first: the published numbers run on, the ranks agree."""
    mine = [(0, "forward", "all_gather", DP2, 64), (1, "clip", "all_reduce", DP2, 4)]
    mine += [(0, "forward", "all_gather", DP2, 64)] * 4 + [(1, "clip", "all_reduce", DP2, 4)]
    out = dist_pool.run(_record_then_report, [mine, mine], [4, 4], [2, 2], world_size=2, timeout=60)
    for _, flight in out:
        assert flight.splitlines() == [
            "shardkit flight record: no mismatch, every member of each group at the same call: shardkit_dp[0, 1] #7",
            *(
                line
                for rank in (0, 1)
                for line in (
                    f"rank {rank}, newest 4 of 4 kept (oldest first):",
                    "  #4 all_gather on shardkit_dp[0, 1] 64 B (forward)",
                    "  #5 all_gather on shardkit_dp[0, 1] 64 B (forward)",
                    "  #6 all_gather on shardkit_dp[0, 1] 64 B (forward)",
                    "  #7 all_reduce on shardkit_dp[0, 1] 4 B (clip)",
                )
            ),
        ]


def test_a_rank_that_published_no_flight_record_is_listed_as_such(dist_pool) -> None:
    calls = [_steps(DP2, 1), []]
    out = dist_pool.run(_record_then_report, calls, [32, 32], [1, 0], world_size=2, timeout=60)
    flight = out[0][1].splitlines()
    assert (
        flight[0]
        == "shardkit flight record: no mismatch; behind: shardkit_dp[0, 1]: rank 0 at #2 (backward); rank 1: nothing published"
    )
    assert flight[-1] == "rank 1: published no flight record"
    assert out[1][1] == "shardkit flight record: none (Heartbeat(stats=...) was not given the run's CommStats)"


def _time_out_under_watch_run() -> tuple[str, list[str]]:
    stats = CommStats()
    for op in ("all_gather", "reduce_scatter" if dist.get_rank() else "all_gather"):
        stats.record(op, DP2, 64)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(CommTimeoutError):
        with watch_run(30.0, world_size=2) as hb:
            hb.track(stats)  # published at once, not at the next beat (1 s)
            dist.barrier()
            early = hb.flight_record().splitlines()[0] if dist.get_rank() == 0 else ""  # rank 1 publishes nothing now
            dist.barrier()
            raise CommTimeoutError("all_gather on shardkit_dp[0, 1] timed out")
    return early, err.getvalue().splitlines()


def test_watch_run_prints_the_stall_report_then_the_flight_record(dist_pool) -> None:
    out = dist_pool.run(_time_out_under_watch_run, world_size=2, timeout=60)
    assert out[0][0].startswith("shardkit flight record: mismatch on shardkit_dp[0, 1] #2")
    for _, lines in out:
        assert lines[0].startswith("shardkit stall: every rank has issued 2 collectives") and lines[0].endswith(
            "; first mismatch: shardkit_dp[0, 1] #2: rank 0 all_gather 64 B vs rank 1 reduce_scatter 64 B"
        )
        assert (
            lines[1]
            == "shardkit flight record: mismatch on shardkit_dp[0, 1] #2: rank 0 all_gather 64 B vs rank 1 reduce_scatter 64 B"
        )
        assert (
            lines[2] == "rank 0, newest 2 of 2 kept (oldest first):"
            and lines[-1] == "  #2 reduce_scatter on shardkit_dp[0, 1] 64 B"
        )


def _one_rank_falls_behind(calls: list[int]) -> list[str]:
    stats = CommStats()
    for _ in range(calls[dist.get_rank()]):
        stats.record("all_gather", "shardkit_dp[0, 1, 2]", 64)
    told: list[str] = []
    with Heartbeat(interval=0.1, stale_after=0.6, stats=[stats], on_stall=told.append, on_frozen=lambda r, v: None) as hb:
        hb.note("step 4")
        time.sleep(1.6)  # no collective on any rank: the ranks ahead wait for the one behind
        dist.barrier()
    return told


def test_a_rank_behind_is_named_after_stale_after_not_the_timeout(dist_pool) -> None:
    """Ranks 0 and 2 have issued 5 collectives, rank 1 only 4: after stale_after without a new
    collective, rank 0 (the first one ahead) tells it once, with the flight record; when every rank
    has issued as many (all computing, say) nobody is told."""
    out = dist_pool.run(_one_rank_falls_behind, [5, 4, 5], world_size=3, timeout=60)
    assert out[1] == [] and out[2] == []
    assert len(out[0]) == 1
    text = out[0][0]
    assert text.startswith("shardkit stall warning: rank 0 has issued no collective for ")
    assert "no mismatch; behind: shardkit_dp[0, 1, 2]: rank 1 at #4; ranks 0, 2 at #5" in text, text
    assert "\nrank 1, newest 4 of 4 kept" in text and text.endswith("unless the ranks behind move on)")
    even = dist_pool.run(_one_rank_falls_behind, [5, 5, 5], world_size=3, timeout=60)
    assert even == [[], [], []]


def _stages_issue_different_collectives(failing_callback: bool) -> tuple[list[str], bool]:
    """Two pipeline stages: stage 0 (rank 0) issued 3 collectives on its own tp-like group and 2
    on the pp group, stage 1 (rank 1) 2 on the pp group only."""
    rank = dist.get_rank()
    stats = CommStats()
    for _ in range(2):
        stats.record("all_reduce", "shardkit_pp[0, 1]", 8)
    if rank == 0:
        for _ in range(3):
            stats.record("all_reduce", "shardkit_tp[0]", 64)
    told: list[str] = []

    def on_stall(text: str) -> None:
        told.append(text)
        if failing_callback:
            raise RuntimeError("alert service down")

    frozen: list[str] = []
    with Heartbeat(
        interval=0.1, stale_after=0.6, stats=[stats], on_stall=on_stall, on_frozen=lambda r, v: frozen.append(v)
    ) as hb:
        if failing_callback and rank == 1:
            stats.record("all_reduce", "shardkit_pp[0, 1]", 8)  # now rank 0 is behind on the pp group
        time.sleep(1.6)
        dist.barrier()
        beating = hb._thread is not None and hb._thread.is_alive()
    return told, beating and not frozen


def test_stall_warnings_compare_each_group_among_its_members(dist_pool) -> None:
    """Pipeline stages issue different collectives: totals of 5 and 2 are no stall when each group's
    members agree. A callback that raises turns the warnings off, not the heartbeat."""
    assert dist_pool.run(_stages_issue_different_collectives, False, world_size=2, timeout=60) == [([], True), ([], True)]
    out = dist_pool.run(_stages_issue_different_collectives, True, world_size=2, timeout=60)
    assert out[0] == ([], True) and len(out[1][0]) == 1 and out[1][1]  # told once; still beating, nobody frozen
