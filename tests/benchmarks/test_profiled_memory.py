"""The profiled peak: its replay, the frees another thread makes (which the trace misses), and
the settled peak that measures around them (``shardkit.parallel.profiled_peak``)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from shardkit.comm import ParallelContext, all_to_all
from shardkit.parallel.profiled_peak import profiled_memory, profiled_peak_bytes, settled_peak_bytes

N = 1 << 16  # floats: 256 KiB tensors


def _freed_by_another_thread() -> None:
    """A tensor whose last reference a second thread drops after this thread has dropped its own,
    as gloo's worker thread drops a collective's tensors."""
    t = torch.ones(N)
    held, dropped = [t], threading.Event()

    def worker() -> None:
        dropped.wait()
        held.clear()  # the free happens here, on this thread

    th = threading.Thread(target=worker)
    th.start()
    del t
    dropped.set()
    th.join()


def test_the_replay_counts_what_is_alive_at_once_and_what_is_not_freed() -> None:
    def two_live() -> None:
        a = torch.ones(N)
        b = a + a
        del a, b

    kept: list[torch.Tensor] = []
    m = profiled_memory(two_live)
    assert (m.peak_bytes, m.unfreed_bytes) == (2 * 4 * N, 0)
    m = profiled_memory(lambda: kept.append(torch.ones(N)))
    assert (m.peak_bytes, m.unfreed_bytes) == (4 * N, 4 * N)
    before = torch.ones(N)
    m = profiled_memory(lambda: before.add_(before))  # a tensor from before the call: not counted
    assert (m.peak_bytes, m.unfreed_bytes) == (0, 0)
    assert profiled_peak_bytes(two_live) == 2 * 4 * N


def test_a_free_on_another_thread_is_missed_by_the_trace() -> None:
    m = profiled_memory(_freed_by_another_thread)
    assert m.unfreed_bytes == 4 * N  # it is gone, but the trace shows it alive to the end


def test_the_settled_peak_is_the_first_call_that_frees_all_it_allocates() -> None:
    calls = []

    def sometimes_missed() -> None:
        calls.append(1)
        if len(calls) < 3:
            _freed_by_another_thread()
        a = torch.ones(N)
        b = torch.ones(N)
        del a, b

    assert settled_peak_bytes(sometimes_missed) == (2 * 4 * N, 3)
    kept: list[torch.Tensor] = []
    assert settled_peak_bytes(lambda: kept.append(torch.ones(N)), tries=2) == (4 * N, -2)  # never settles
    with pytest.raises(ValueError, match="tries"):
        settled_peak_bytes(sometimes_missed, tries=0)


@pytest.mark.parametrize("device", ["gpu", "cuda:0", None])
def test_an_unknown_device_is_refused_before_the_call(device) -> None:
    calls = []
    for measure in (profiled_memory, profiled_peak_bytes, settled_peak_bytes):
        with pytest.raises(ValueError, match="device must be 'CPU' or 'CUDA'"):
            measure(lambda: calls.append(1), device=device)
    assert not calls
    assert profiled_memory(lambda: torch.ones(N), device="cpu").peak_bytes == 4 * N  # either case


def _settled_over_ranks() -> tuple[tuple[int, int], int]:
    """Rank r's calls miss a free for its first r + 1 calls; each call does one all-to-all, so
    the ranks must call equally often. (Its buffers exist before the calls: a buffer allocated
    inside would be gloo's to free, now and then, and the call would not settle when meant to.)"""
    rank = dist.get_rank()
    with ParallelContext.from_world(cp=2) as ctx:
        group = ctx.group("cp")
        calls = []
        send, recv = torch.ones(2 * N), torch.empty(2 * N)

        def step() -> None:
            calls.append(1)
            if len(calls) <= rank + 1:
                _freed_by_another_thread()
            all_to_all(recv, send, group=group)
            a = torch.ones(N)
            b = torch.ones(N)
            del a, b

        return settled_peak_bytes(step, group=group), len(calls)


def test_ranks_call_equally_often_until_each_has_settled(dist_pool) -> None:
    (r0, calls0), (r1, calls1) = dist_pool.run(_settled_over_ranks, world_size=2, timeout=60)
    assert r0[1] == 2 and r1[1] == 3  # each rank's first settled call
    assert calls0 == calls1 == 3  # rank 0 went on calling while rank 1 had not settled
    assert r0[0] == r1[0] == 2 * 4 * N  # the settled calls' own two tensors
