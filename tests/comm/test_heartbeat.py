"""The heartbeat watchdog: a rank that stops beating is named by the rank that watches it, with
what it last said it was doing; a rank that ends normally is never named; after a stall, the
rank that issued fewer collectives is named as the one the others wait for (comm/heartbeat.py)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from shardkit.comm import CommStats, Heartbeat


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
