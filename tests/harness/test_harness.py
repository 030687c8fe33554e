"""The distributed test harness itself: results, reuse, failures, hangs, crashes."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from distributed import DistributedTestError


def _identity_body(scale: int, *, offset: int = 0) -> tuple[int, int, int, torch.Tensor]:
    rank = dist.get_rank()
    return rank, dist.get_world_size(), os.getpid(), torch.full((2,), float(rank * scale + offset))


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_in_rank_order_and_workers_reused(dist_pool, world_size):
    first = dist_pool.run(_identity_body, 10, offset=1, world_size=world_size)
    assert [(r, n) for r, n, _, _ in first] == [(r, world_size) for r in range(world_size)]
    for r, (_, _, _, t) in enumerate(first):
        torch.testing.assert_close(t, torch.full((2,), float(10 * r + 1)))
    second = dist_pool.run(_identity_body, 1, world_size=world_size)
    assert [pid for *_, pid, _ in second] == [pid for *_, pid, _ in first]  # same processes


def _worker_setup_body() -> tuple[int, str]:
    return torch.get_num_threads(), dist.get_backend()


def test_workers_are_single_threaded_gloo(dist_pool):
    assert dist_pool.run(_worker_setup_body, world_size=2) == [(1, "gloo")] * 2


def _fails_on_rank_1_body() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here: rank 1 never joins


def _sleeps_on_rank_1_body() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)


def _exits_on_rank_0_body() -> None:
    if dist.get_rank() == 0:
        os._exit(3)


def test_failing_rank_reports_traceback_and_pool_recovers(dist_pool):
    pool = dist_pool.pool(2)
    with pytest.raises(DistributedTestError) as info:
        dist_pool.run(_fails_on_rank_1_body, world_size=2)
    message = str(info.value)
    assert "rank 1 raised" in message and "ValueError: boom on rank 1" in message
    assert "_fails_on_rank_1_body" in message  # the traceback, not just the message
    assert "rank 0 did not finish" in message
    starts = pool.starts
    assert [r for r, *_ in dist_pool.run(_identity_body, 1, world_size=2)] == [0, 1]
    assert pool.starts == starts + 1  # restarted after the failure


def test_hang_is_killed_by_timeout_and_next_call_works(dist_pool):
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[1\] did not finish within 2 s") as info:
        dist_pool.run(_sleeps_on_rank_1_body, world_size=2, timeout=2)
    assert time.monotonic() - t0 < 15
    assert "_sleeps_on_rank_1_body" in str(info.value)  # the hung rank's stack
    assert [r for r, *_ in dist_pool.run(_identity_body, 1, world_size=2)] == [0, 1]


def test_dead_worker_is_reported_and_replaced(dist_pool):
    with pytest.raises(DistributedTestError, match=r"rank 0: worker died \(exit code 3\)"):
        dist_pool.run(_exits_on_rank_0_body, world_size=2)
    assert [r for r, *_ in dist_pool.run(_identity_body, 1, world_size=2)] == [0, 1]


def test_body_must_be_module_level(dist_pool):
    def local_body() -> None: ...

    with pytest.raises(TypeError, match="module-level function"):
        dist_pool.run(local_body, world_size=2)
    with pytest.raises(TypeError, match="module-level function"):
        dist_pool.run(lambda: None, world_size=2)


def _listening_addresses() -> list[str]:
    """Local addresses of the TCP sockets this process listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "0A":  # 0A: LISTEN
                addresses.append(fields[1].split(":")[0])
    return addresses


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
def test_workers_listen_on_loopback_only(dist_pool):
    per_rank = dist_pool.run(_listening_addresses, world_size=2)
    assert all(per_rank), per_rank  # gloo listens somewhere...
    assert {a for addresses in per_rank for a in addresses} == {"0100007F"}  # ...on 127.0.0.1 only
