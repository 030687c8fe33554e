"""shardkit.comm: collectives, handles, CommStats, ParallelContext, timeouts (gloo, 2 and 4 ranks).

Bodies prefixed ``_`` run on every rank through the ``dist_pool`` fixture; each rank draws its
input from a generator seeded by its rank and recomputes every other rank's input, so the
single-process reference is built on every rank and compared there.
"""

from __future__ import annotations

import os
import threading
import warnings
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardkit.comm import (
    AXES,
    CommStats,
    CommTimeoutError,
    ParallelContext,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    group_label,
    recv,
    reduce_scatter,
    ring_shift,
    send,
)
from shardkit.comm.collectives import GLOO_BROADCAST_GATHER_BYTES
from shardkit.comm.context import NCCL_BLOCKING_WAIT_ENV, _nccl_blocking_wait
from shardkit.comm.handle import CommHandle, as_timeout_error
from tolerances import FP32

WORLD_SIZES = [2, 4]
OPS = ["sum", "avg", "max", "min"]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]
NUMELS = [0, 1, 13, 132]  # empty, single, odd, a few hundred

# Per-dtype tolerances of a reduction vs the float64 reference rounded to the dtype.
EXACT = dict(rtol=0, atol=0)  # data movement (gather, broadcast, p2p) and integer reductions
TOL = {
    # gloo sums in another order than the reference: a few ulps, well inside the suite's FP32.
    torch.float32: FP32,
    # Looser: bf16 partial sums (|x| up to ~8 for 4 ranks of N(0,1)) are rounded at each of up
    # to 3 steps, half an ulp (2^-6 at 4..8) each, ~0.05 worst case; near-zero sums need the atol.
    torch.bfloat16: dict(rtol=1.6e-2, atol=6e-2),
    torch.int64: EXACT,  # inputs are small integers
}


def _input(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * salt + rank)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    return (x * 100).round().to(dtype) if dtype == torch.int64 else x.to(dtype)


def _reference(inputs: list[torch.Tensor], op: str, dtype: torch.dtype) -> torch.Tensor:
    stacked = torch.stack([x.to(torch.float64) for x in inputs])
    fn = {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin}[op]
    return fn(stacked, dim=0).to(dtype)


def _dtypes_for(op: str) -> list[torch.dtype]:
    return [d for d in DTYPES if op != "avg" or d.is_floating_point]


# ---- collectives vs reference ------------------------------------------------------------------
def _all_reduce_body(op: str) -> int:
    with ParallelContext.from_world() as ctx:
        group, me, n = ctx.group("dp"), ctx.rank("dp"), ctx.size("dp")
        checked = 0
        for dtype in _dtypes_for(op):
            for numel in NUMELS:
                x = _input(me, numel, dtype)
                h = all_reduce(x, group=group, op=op)
                assert h.output is x and h.is_completed()
                ref = _reference([_input(r, numel, dtype) for r in range(n)], op, dtype)
                torch.testing.assert_close(x, ref, **TOL[dtype])
                checked += 1
        return checked


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_matches_reference(dist_pool, world_size, op):
    checked = dist_pool.run(_all_reduce_body, op, world_size=world_size)
    assert checked == [len(_dtypes_for(op)) * len(NUMELS)] * world_size


def _reduce_scatter_body(op: str, scratch: bool) -> None:
    with ParallelContext.from_world() as ctx:
        group, me, n = ctx.group("dp"), ctx.rank("dp"), ctx.size("dp")
        stats = CommStats()
        for dtype in _dtypes_for(op):
            for numel in NUMELS:
                inp = _input(me, n * numel, dtype)
                # stack form ([n, numel] input) must behave as the flat concatenation
                out = torch.empty(numel, dtype=dtype)
                h = reduce_scatter(
                    out, inp.view(n, numel), group=group, op=op, async_op=True, stats=stats, input_is_scratch=scratch
                )
                h.wait()
                full = _reference([_input(r, n * numel, dtype) for r in range(n)], op, dtype)
                torch.testing.assert_close(out, full[me * numel : (me + 1) * numel], **TOL[dtype])
                if not scratch:
                    torch.testing.assert_close(inp, _input(me, n * numel, dtype), rtol=0, atol=0)  # input kept
        # the payload asked for, whichever way gloo carries it
        assert stats.bytes("reduce_scatter") == sum(
            n * numel * torch.empty((), dtype=d).element_size() for d in _dtypes_for(op) for numel in NUMELS
        )


@pytest.mark.parametrize("scratch", [False, True], ids=["input-kept", "input-is-scratch"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_matches_reference(dist_pool, world_size, op, scratch):
    dist_pool.run(_reduce_scatter_body, op, scratch, world_size=world_size)


def _reduce_scatter_in_place_body(scratch: bool) -> None:
    """``output`` = this rank's own chunk of ``input`` (ZeRO-1 reduces its bucket in place)."""
    with ParallelContext.from_world() as ctx:
        group, me, n = ctx.group("dp"), ctx.rank("dp"), ctx.size("dp")
        for numel in NUMELS:
            inp = _input(me, n * numel, torch.float32)
            out = inp.narrow(0, me * numel, numel)
            reduce_scatter(out, inp, group=group, op="sum", async_op=True, input_is_scratch=scratch).wait()
            full = _reference([_input(r, n * numel, torch.float32) for r in range(n)], "sum", torch.float32)
            torch.testing.assert_close(out, full[me * numel : (me + 1) * numel], **TOL[torch.float32])


@pytest.mark.parametrize("scratch", [False, True], ids=["input-kept", "input-is-scratch"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_into_its_own_chunk(dist_pool, world_size, scratch):
    dist_pool.run(_reduce_scatter_in_place_body, scratch, world_size=world_size)


def _all_gather_body() -> None:
    with ParallelContext.from_world() as ctx:
        group, me, n = ctx.group("dp"), ctx.rank("dp"), ctx.size("dp")
        for dtype in DTYPES:
            for numel in NUMELS:
                out = torch.full((n, numel), -7, dtype=dtype)  # [N, n] output = concatenation
                all_gather(out, _input(me, numel, dtype), group=group)
                ref = torch.stack([_input(r, numel, dtype) for r in range(n)])
                torch.testing.assert_close(out, ref, **EXACT)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_matches_reference(dist_pool, world_size):
    dist_pool.run(_all_gather_body, world_size=world_size)


def _all_gather_large_body() -> None:
    """Outputs over GLOO_BROADCAST_GATHER_BYTES take gloo's broadcast path ([Note: gloo all-gather
    as broadcasts]): same result as the reference, async, with the input separate from or
    aliasing this rank's own chunk of the output, and recorded as one all-gather."""
    with ParallelContext.from_world() as ctx:
        group, me, n = ctx.group("dp"), ctx.rank("dp"), ctx.size("dp")
        stats = CommStats()
        for dtype in DTYPES:
            numel = GLOO_BROADCAST_GATHER_BYTES // (n * torch.empty((), dtype=dtype).element_size()) + 37
            ref = torch.stack([_input(r, numel, dtype) for r in range(n)])
            out = torch.full((n, numel), -7, dtype=dtype)
            h = all_gather(out, _input(me, numel, dtype), group=group, async_op=True, stats=stats)
            torch.testing.assert_close(h.wait(), ref, **EXACT)
            assert h.is_completed()
            aliased = torch.full((n, numel), -7, dtype=dtype)
            aliased[me] = _input(me, numel, dtype)
            all_gather(aliased, aliased[me], group=group)  # in place: the input is this rank's chunk
            torch.testing.assert_close(aliased, ref, **EXACT)
        assert stats.calls("all_gather") == len(DTYPES)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_large_all_gather_matches_reference(dist_pool, world_size):
    dist_pool.run(_all_gather_large_body, world_size=world_size)


def _broadcast_body() -> None:
    # On a dp x tp mesh, src is a rank *within* the group: check it against the global rank.
    tp = 2 if dist.get_world_size() % 2 == 0 else 1
    with ParallelContext.from_world(tp=tp) as ctx:
        for axis in ("dp", "tp"):
            group = ctx.group(axis)
            for src in range(group.size()):
                x = _input(ctx.global_rank, 9, torch.float32, salt=1)
                broadcast(x, src=src, group=group)
                expected = _input(dist.get_global_rank(group, src), 9, torch.float32, salt=1)
                torch.testing.assert_close(x, expected, **EXACT)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_src_is_group_rank(dist_pool, world_size):
    dist_pool.run(_broadcast_body, world_size=world_size)


def _send_recv_body() -> None:
    with ParallelContext.from_world() as ctx:
        group, me, n = ctx.group("dp"), ctx.rank("dp"), ctx.size("dp")
        # ring: send to the right asynchronously, receive from the left synchronously
        h = send(_input(me, 5, torch.float32, salt=2), dst=(me + 1) % n, group=group, async_op=True)
        buf = torch.empty(5)
        recv(buf, src=(me - 1) % n, group=group)
        h.wait()
        torch.testing.assert_close(buf, _input((me - 1) % n, 5, torch.float32, salt=2), **EXACT)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_send_recv_ring(dist_pool, world_size):
    dist_pool.run(_send_recv_body, world_size=world_size)


def _async_body() -> None:
    with ParallelContext.from_world() as ctx:
        group, me, n = ctx.group("dp"), ctx.rank("dp"), ctx.size("dp")
        a, b = _input(me, 64, torch.float32), _input(me, 64, torch.float32, salt=3)
        out = torch.empty(n * 64)
        handles = [
            all_reduce(a, group=group, op="avg", async_op=True),
            all_reduce(b, group=group, op="max", async_op=True),
            all_gather(out, _input(me, 64, torch.float32, salt=4), group=group, async_op=True),
        ]
        # waited in reverse issue order: any order is allowed
        results = [h.wait() for h in reversed(handles)][::-1]
        assert all(h.is_completed() for h in handles)
        assert results[0] is a and results[1] is b and results[2] is out
        assert handles[0].wait() is a  # idempotent: no second division
        fp32 = torch.float32
        torch.testing.assert_close(a, _reference([_input(r, 64, fp32) for r in range(n)], "avg", fp32), **TOL[fp32])
        torch.testing.assert_close(b, _reference([_input(r, 64, fp32, salt=3) for r in range(n)], "max", fp32))
        torch.testing.assert_close(out, torch.cat([_input(r, 64, torch.float32, salt=4) for r in range(n)]))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_async_handles(dist_pool, world_size):
    dist_pool.run(_async_body, world_size=world_size)


# ---- CommStats ---------------------------------------------------------------------------------
def _stats_body() -> dict:
    with ParallelContext.from_world(tp=2) as ctx:
        stats = CommStats()
        dp, tp = ctx.group("dp"), ctx.group("tp")
        n_dp, n_tp = ctx.size("dp"), ctx.size("tp")
        grad = torch.zeros(100)  # 400 B
        for _ in range(3):
            all_reduce(grad, group=dp, op="avg", stats=stats)
        shard = torch.zeros(10, dtype=torch.bfloat16)  # gathered: n_tp * 20 B
        all_gather(torch.empty(10 * n_tp, dtype=torch.bfloat16), shard, group=tp, stats=stats)
        reduce_scatter(torch.empty(10), torch.zeros(10 * n_tp), group=tp, stats=stats)  # n_tp * 40 B
        all_reduce(torch.zeros(7), group=ctx.group("pp"), stats=stats)  # size 1: not recorded
        assert stats.calls("all_reduce") == 3 * (n_dp > 1) and stats.bytes("all_reduce") == 1200 * (n_dp > 1)
        assert stats.calls("all_reduce", group=dp) == 3 * (n_dp > 1)
        assert stats.bytes("all_gather", group=tp) == n_tp * 20
        assert stats.bytes("reduce_scatter") == n_tp * 40
        assert stats.calls() == 3 * (n_dp > 1) + 2
        assert stats.bytes() == 1200 * (n_dp > 1) + n_tp * 60
        summary = stats.summary()
        assert summary["all_gather"]["groups"] == {group_label(tp): {"calls": 1, "bytes": n_tp * 20}}
        stats.reset()
        assert stats.calls() == 0 and stats.summary() == {}
        return summary


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_comm_stats_counts_payload_bytes(dist_pool, world_size):
    summaries = dist_pool.run(_stats_body, world_size=world_size)
    # rank-independent labels: the tp group of ranks 0 and 1 has one name on both
    assert summaries[0]["all_gather"]["groups"] == summaries[1]["all_gather"]["groups"]
    assert list(summaries[0]["all_gather"]["groups"]) == ["shardkit_tp[0, 1]"]


def test_comm_stats_is_thread_safe():
    stats = CommStats()

    def hammer() -> None:
        for _ in range(2000):
            stats.record("all_reduce", "g[0, 1]", 4)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.calls("all_reduce") == 16_000 and stats.bytes(group="g[0, 1]") == 64_000
    with pytest.raises(ValueError, match="nbytes"):
        stats.record("all_reduce", "g", -1)


def test_comm_stats_bytes_per_link_places_each_group_by_its_ranks():
    """Machine m holds ranks [m·k, (m+1)·k): a group inside one machine is within, else across."""
    stats = CommStats()
    stats.record("all_gather", "shardkit_dp[0, 1, 2, 3]", 400)  # spans 2 machines of 2
    stats.record("all_gather", "shardkit_dp_cp_block[2, 3]", 100)  # machine 1
    stats.record("reduce_scatter", "shardkit_dp[0, 1, 2, 3]", 50)
    stats.record("send", "a label without ranks", 7)
    assert stats.bytes_per_link(2) == {"within_machine": 100, "across_machines": 450, "unplaced": 7}
    assert stats.bytes_per_link(2, "all_gather") == {"within_machine": 100, "across_machines": 400, "unplaced": 0}
    assert stats.bytes_per_link(4)["across_machines"] == 0  # one machine
    assert stats.bytes_per_link(1) == {"within_machine": 0, "across_machines": 550, "unplaced": 7}
    stats.reset()
    assert stats.bytes_per_link(2) == {"within_machine": 0, "across_machines": 0, "unplaced": 0}
    with pytest.raises(ValueError, match="ranks_per_machine"):
        stats.bytes_per_link(0)


def test_comm_stats_group_filter_is_keyword_only():
    """``calls("all_reduce", "g")`` would read as two filters of one kind; the group is named."""
    stats = CommStats()
    stats.record("all_reduce", "g[0, 1]", 4)
    for method in (stats.calls, stats.bytes):
        with pytest.raises(TypeError, match="positional argument"):
            method("all_reduce", "g[0, 1]")  # type: ignore[misc]


# ---- groups of size 1 --------------------------------------------------------------------------
def _size_one_body() -> None:
    with ParallelContext.from_world() as ctx:  # pp and tp are size 1
        group, stats = ctx.group("tp"), CommStats()
        assert group.size() == 1 and ctx.size("tp") == 1 and ctx.rank("tp") == 0
        forbidden = AssertionError("a size-1 group must not communicate")
        names = ["all_reduce", "reduce_scatter_single", "all_gather_single", "broadcast", "isend", "irecv"]
        with mock.patch.multiple(dist, **{n: mock.Mock(side_effect=forbidden) for n in names}):
            for op in OPS:
                x = _input(dist.get_rank(), 11, torch.float32)
                h = all_reduce(x, group=group, op=op, async_op=True, stats=stats)
                assert h.is_completed()
                torch.testing.assert_close(h.wait(), _input(dist.get_rank(), 11, torch.float32), **EXACT)
                out = torch.empty(11)
                reduce_scatter(out, x, group=group, op=op, stats=stats)
                torch.testing.assert_close(out, x, **EXACT)
            out = torch.empty(1, 11)
            assert all_gather(out, x, group=group, stats=stats).output is out
            torch.testing.assert_close(out[0], x, **EXACT)
            broadcast(x, src=0, group=group, stats=stats)
            with pytest.raises(ValueError, match="dst=0 is this rank"):
                send(x, dst=0, group=group)
        assert stats.calls() == 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_size_one_group_takes_local_path(dist_pool, world_size):
    dist_pool.run(_size_one_body, world_size=world_size)


# ---- argument validation -----------------------------------------------------------------------
def _bad_arguments_body() -> None:
    with ParallelContext.from_world() as ctx:
        g = ctx.group("dp")
        # any attempt to communicate fails the test: errors must come first
        names = ["all_reduce", "reduce_scatter_single", "all_gather_single", "broadcast", "isend", "irecv"]
        forbidden = AssertionError("validation must precede communication")
        with mock.patch.multiple(dist, **{n: mock.Mock(side_effect=forbidden) for n in names}):
            x = torch.zeros(8)
            with pytest.raises(TypeError, match="group= is required"):
                all_reduce(x, group=None)
            with pytest.raises(ValueError, match="op must be one of"):
                all_reduce(x, group=g, op="prod")
            with pytest.raises(TypeError, match="op='avg' needs a floating tensor"):
                all_reduce(torch.zeros(3, dtype=torch.int64), group=g, op="avg")
            with pytest.raises(ValueError, match="tensor must be contiguous"):
                all_reduce(torch.zeros(4, 4).t(), group=g)
            with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
                all_reduce([1.0], group=g)
            with pytest.raises(ValueError, match=r"output.numel\(\) \* group size"):
                reduce_scatter(torch.empty(3), torch.zeros(8), group=g)
            with pytest.raises(TypeError, match="output dtype"):
                reduce_scatter(torch.empty(4, dtype=torch.float64), torch.zeros(8), group=g)
            with pytest.raises(ValueError, match=r"input.numel\(\) \* group size"):
                all_gather(torch.empty(5), torch.zeros(2), group=g)
            with pytest.raises(ValueError, match="src=5 is not a rank"):
                broadcast(x, src=5, group=g)
            with pytest.raises(TypeError, match="src must be an int"):
                recv(x, src=None, group=g)


def test_collectives_validate_before_communicating(dist_pool):
    dist_pool.run(_bad_arguments_body, world_size=2)


# ---- ParallelContext ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world_size", "sizes", "axis"),
    [
        (4, dict(dp=3), "dp"),  # product mismatch
        (4, dict(dp=2, tp=4), "tp"),
        (4, dict(tp=0), "tp"),
        (4, dict(pp=-1), "pp"),
        (4, dict(dp=0), "dp"),
        (6, dict(tp=4), "dp=-1"),  # "the rest" does not divide
    ],
)
def test_resolve_sizes_rejects_bad_sizes(world_size, sizes, axis):
    with pytest.raises(ValueError, match=axis):
        ParallelContext.resolve_sizes(world_size, **sizes)


def test_resolve_sizes_fills_dp():
    assert ParallelContext.resolve_sizes(8, tp=2, pp=2) == {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    assert ParallelContext.resolve_sizes(1) == {"pp": 1, "dp": 1, "cp": 1, "tp": 1}
    with pytest.raises(TypeError, match="tp must be an int"):
        ParallelContext.resolve_sizes(4, tp=2.0)


def test_from_env_validates_before_creating_a_process_group(monkeypatch):
    # Single process, no process group anywhere: the error must come from the integers alone.
    assert not dist.is_initialized()
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    init = mock.Mock(side_effect=AssertionError("must not initialize"))
    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(ValueError, match="dp"):
        ParallelContext.from_env(dp=3)
    with pytest.raises(ValueError, match="tp"):
        ParallelContext.from_env(tp=0)
    with pytest.raises(TypeError, match="timeout"):
        ParallelContext.from_env(timeout=5)
    assert not init.called and not dist.is_initialized()


def test_from_env_rejects_a_zero_timeout_and_tp_rest(monkeypatch):
    # a zero timeout would make every collective time out at once; only dp may be -1 ("the rest")
    init = mock.Mock(side_effect=AssertionError("must not initialize"))
    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(ValueError, match="timeout must be positive"):
        ParallelContext.from_env(timeout=timedelta(0))
    with pytest.raises(ValueError, match="tp must be >= 1"):
        ParallelContext.resolve_sizes(8, tp=-1)
    with pytest.raises(ValueError, match="pp must be >= 1"):
        ParallelContext.resolve_sizes(8, pp=-1)
    assert not init.called


@pytest.mark.parametrize("present", ["RANK", "WORLD_SIZE"])
def test_from_env_with_half_of_torchruns_variables_is_an_error(monkeypatch, present):
    """RANK without WORLD_SIZE (or the reverse) is a broken launch, not a single process: the error
    names the missing variable instead of silently training alone."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(present, "1")
    init = mock.Mock(side_effect=AssertionError("must not initialize"))
    monkeypatch.setattr(dist, "init_process_group", init)
    missing = "WORLD_SIZE" if present == "RANK" else "RANK"
    with pytest.raises((KeyError, ValueError, RuntimeError), match=missing):
        ParallelContext.from_env()
    assert not init.called


def test_from_env_takes_the_local_rank_from_local_rank_not_rank(monkeypatch):
    """Rank 5 of a multi-node job is local rank 1: the GPU check (and set_device) must see 1."""
    env = dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    forbidden = mock.Mock(side_effect=AssertionError("must fail before this"))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(torch.cuda, "set_device", forbidden)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"local rank 1 of 4 ranks per node"):
        ParallelContext.from_env(backend="nccl")


def _no_torchrun_env(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_destroy_tears_down_the_default_group_only_when_from_env_created_it(monkeypatch):
    """A gloo world left to interpreter shutdown can abort the process, so ctx.destroy() must
    release the default group from_env made; one that existed before the context is the caller's."""
    _no_torchrun_env(monkeypatch)
    assert not dist.is_initialized()
    try:
        ctx = ParallelContext.from_env(backend="gloo")  # a world of one
        assert dist.is_initialized()
        ctx.destroy()
        assert not dist.is_initialized()
        ctx.destroy()  # idempotent: no second destroy of a group that is gone
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ctx = ParallelContext.from_env(backend="gloo")  # finds the caller's world: from_world
        ctx.destroy()
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_from_env_leaves_no_world_behind_when_building_the_context_fails(monkeypatch):
    _no_torchrun_env(monkeypatch)
    monkeypatch.setattr(ParallelContext, "from_world", mock.Mock(side_effect=RuntimeError("mesh failed")))
    try:
        with pytest.raises(RuntimeError, match="mesh failed"):
            ParallelContext.from_env(backend="gloo")
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _bad_context_body() -> str:
    new_group = mock.Mock(side_effect=AssertionError("no group may be created"))
    with mock.patch.object(dist, "new_group", new_group):
        with pytest.raises(ValueError, match="dp") as info:
            ParallelContext.from_world(dp=3)
        with pytest.raises(ValueError, match="tp"):
            ParallelContext.from_env(tp=3)  # initialized world: from_env takes the from_world path
    assert not new_group.called
    return str(info.value)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_context_validation_on_every_rank(dist_pool, world_size):
    messages = dist_pool.run(_bad_context_body, world_size=world_size)
    assert len(set(messages)) == 1  # same error on every rank


def _mesh_2d_body() -> dict:
    r = dist.get_rank()
    with ParallelContext.from_env(dp=2, tp=2) as ctx:
        ranks = {a: dist.get_process_group_ranks(ctx.group(a)) for a in AXES}
        assert ctx.sizes == {"pp": 1, "dp": 2, "cp": 1, "tp": 2} and ctx.world_size == 4 and ctx.global_rank == r
        assert (ctx.rank("dp"), ctx.rank("tp"), ctx.rank("pp")) == (r // 2, r % 2, 0)
        assert ctx.device == torch.device("cpu")
        assert dist.get_process_group_ranks(ctx.submesh("tp").get_group()) == ranks["tp"]
        assert ctx.submesh(("dp", "tp")).shape == (2, 2)
        with pytest.raises(ValueError, match="ordered"):
            ctx.submesh(("tp", "dp"))
        with pytest.raises(ValueError, match="unknown axis 'ep'"):
            ctx.group("ep")
        assert ctx.group("dp_cp") is ctx.group("dp") and ctx.size("dp_cp") == 2 and ctx.rank("dp_cp") == r // 2
        # a tp all-reduce only mixes the two ranks of this tp group
        x = _input(r, 6, torch.float32)
        all_reduce(x, group=ctx.group("tp"))
        ref = _reference([_input(q, 6, torch.float32) for q in ranks["tp"]], "sum", torch.float32)
        torch.testing.assert_close(x, ref, **TOL[torch.float32])
    with ParallelContext.from_world(pp=2, tp=2) as ctx:
        ranks["pp_of_pp2"] = dist.get_process_group_ranks(ctx.group("pp"))
    return ranks


def test_mesh_2d_dp2_tp2_groups(dist_pool):
    ranks = dist_pool.run(_mesh_2d_body, world_size=4)
    for r, got in enumerate(ranks):
        base = 2 * (r // 2)
        assert got["tp"] == [base, base + 1], (r, got)  # tp innermost: consecutive ranks
        assert got["dp"] == [r % 2, r % 2 + 2], (r, got)
        assert got["pp"] == [r]
        assert got["pp_of_pp2"] == [r % 2, r % 2 + 2]


def _context_parallel_mesh_body() -> dict:
    """cp sits between dp and tp; dp_cp flattens dp and cp (gradients are reduced over it)."""
    got = {}
    with ParallelContext.from_world(cp=2) as ctx:  # dp 2 x cp 2
        got["cp"] = dist.get_process_group_ranks(ctx.group("cp"))
        got["dp"] = dist.get_process_group_ranks(ctx.group("dp"))
        got["dp_cp"] = dist.get_process_group_ranks(ctx.group("dp_cp"))
        got["coords"] = (ctx.rank("dp"), ctx.rank("cp"), ctx.rank("dp_cp"), ctx.size("dp_cp"))
        assert "cp=2" in repr(ctx)
        x = torch.full((3,), float(dist.get_rank()))
        all_reduce(x, group=ctx.group("dp_cp"))
        got["dp_cp_sum"] = x[0].item()
    with ParallelContext.from_world(cp=2, tp=2) as ctx:  # dp 1 x cp 2 x tp 2
        got["cp_of_tp2"] = dist.get_process_group_ranks(ctx.group("cp"))
        got["dp_cp_of_tp2"] = dist.get_process_group_ranks(ctx.group("dp_cp"))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    with ParallelContext.from_mesh(mesh) as ctx:
        got["from_mesh"] = (ctx.sizes, dist.get_process_group_ranks(ctx.group("dp_cp")))
    return got


def test_context_parallel_axis_groups(dist_pool):
    for r, got in enumerate(dist_pool.run(_context_parallel_mesh_body, world_size=4)):
        assert got["cp"] == [2 * (r // 2), 2 * (r // 2) + 1], (r, got)  # cp inside dp
        assert got["dp"] == [r % 2, r % 2 + 2], (r, got)
        assert got["dp_cp"] == [0, 1, 2, 3] and got["dp_cp_sum"] == 6.0
        assert got["coords"] == (r // 2, r % 2, r, 4)
        assert got["cp_of_tp2"] == [r % 2, r % 2 + 2] and got["dp_cp_of_tp2"] == got["cp_of_tp2"]  # tp innermost
        assert got["from_mesh"] == ({"pp": 1, "dp": 2, "cp": 2, "tp": 1}, [0, 1, 2, 3])


def test_resolve_sizes_with_cp():
    assert ParallelContext.resolve_sizes(8, cp=2, tp=2) == {"pp": 1, "dp": 2, "cp": 2, "tp": 2}
    with pytest.raises(ValueError, match=r"pp\*cp\*tp = 1\*3\*1"):
        ParallelContext.resolve_sizes(8, cp=3)
    with pytest.raises(ValueError, match="cp must be >= 1"):
        ParallelContext.resolve_sizes(8, cp=0)


def _from_mesh_body() -> tuple[dict, list[int]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with ParallelContext.from_mesh(mesh) as ctx:
        assert ctx.group("dp") is mesh.get_group("dp")
        sizes, pp_ranks = ctx.sizes, dist.get_process_group_ranks(ctx.group("pp"))
    with pytest.raises(ValueError, match="ordered"):
        ParallelContext.from_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp")))
    return sizes, pp_ranks


def test_from_mesh_adds_missing_axes(dist_pool):
    for r, (sizes, pp_ranks) in enumerate(dist_pool.run(_from_mesh_body, world_size=4)):
        assert sizes == {"pp": 1, "dp": 2, "cp": 1, "tp": 2} and pp_ranks == [r]


# ---- timeouts ----------------------------------------------------------------------------------
def _timeout_body() -> str:
    """Rank 1 never issues the collectives; rank 0's must fail fast, naming the op."""
    message = ""
    with ParallelContext.from_world(timeout=timedelta(seconds=2)) as ctx:
        if dist.get_rank() == 0:
            expected = r"all_reduce on group shardkit_dp\[0, 1\] timed out after 2 s"
            with pytest.raises(CommTimeoutError, match=expected) as info:
                all_reduce(torch.ones(4), group=ctx.group("dp"))
            assert isinstance(info.value, RuntimeError)
            message = str(info.value)
        dist.barrier()  # rank 1 keeps its end of the group open until rank 0 has timed out
    with ParallelContext.from_world(timeout=timedelta(seconds=1)) as ctx:
        if dist.get_rank() == 0:
            h = all_gather(torch.empty(8), torch.ones(4), group=ctx.group("dp"), async_op=True)
            with pytest.raises(CommTimeoutError, match="all_gather .* timed out after 1 s"):
                h.wait()
        dist.barrier()
    return message


def _still_works_body() -> float:
    x = torch.ones(3)
    dist.all_reduce(x)
    with ParallelContext.from_world() as ctx:
        all_reduce(x, group=ctx.group("dp"))
    return float(x[0])


def test_timeout_names_the_op(dist_pool):
    messages = dist_pool.run(_timeout_body, world_size=2, timeout=30)
    assert "all_reduce" in messages[0] and messages[1] == ""
    # the default group and new groups still work for the next test
    assert dist_pool.run(_still_works_body, world_size=2) == [4.0, 4.0]


# ---- blocking wait (NCCL opt-in; what can be checked on gloo) -----------------------------------
def _blocking_wait_gloo_body() -> tuple[str | None, str | None]:
    """On gloo ``blocking_wait=True`` is accepted, leaves the environment alone, and a timeout
    still raises CommTimeoutError (gloo always blocks)."""
    before = os.environ.get(NCCL_BLOCKING_WAIT_ENV)
    with ParallelContext.from_world(timeout=timedelta(seconds=1), blocking_wait=True) as ctx:
        during = os.environ.get(NCCL_BLOCKING_WAIT_ENV)
        if dist.get_rank() == 0:
            with pytest.raises(CommTimeoutError, match="all_reduce .* timed out after 1 s"):
                all_reduce(torch.ones(2), group=ctx.group("dp"))
        dist.barrier()
    with pytest.raises(TypeError, match="blocking_wait must be a bool"):
        ParallelContext.from_world(blocking_wait="yes")  # validated before any group exists
    assert os.environ.get(NCCL_BLOCKING_WAIT_ENV) == before
    return before, during


def test_blocking_wait_on_gloo(dist_pool):
    for before, during in dist_pool.run(_blocking_wait_gloo_body, world_size=2, timeout=30):
        assert during == before  # gloo groups: the NCCL variable is not touched


@pytest.mark.parametrize("previous", [None, "0", "1"])
def test_nccl_blocking_wait_env_is_scoped_to_group_creation(monkeypatch, previous):
    """The variable ProcessGroupNCCL reads at construction is "1" inside the block only, then
    restored (or removed) even if group creation raised; disabled, it is not touched."""
    if previous is None:
        monkeypatch.delenv(NCCL_BLOCKING_WAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(NCCL_BLOCKING_WAIT_ENV, previous)
    with _nccl_blocking_wait(True):
        assert os.environ[NCCL_BLOCKING_WAIT_ENV] == "1"
    assert os.environ.get(NCCL_BLOCKING_WAIT_ENV) == previous
    with pytest.raises(RuntimeError, match="boom"), _nccl_blocking_wait(True):
        raise RuntimeError("boom")
    assert os.environ.get(NCCL_BLOCKING_WAIT_ENV) == previous
    with _nccl_blocking_wait(False):
        assert os.environ.get(NCCL_BLOCKING_WAIT_ENV) == previous


def test_from_env_creates_nccl_groups_under_blocking_wait(monkeypatch):
    """from_env(backend="nccl", blocking_wait=True) initializes the default group with the
    variable set (checked with init_process_group patched: no GPU here), and only then."""
    seen = []
    monkeypatch.delenv(NCCL_BLOCKING_WAIT_ENV, raising=False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)

    class Stop(Exception):
        pass

    def fake_init(*args, **kwargs):
        seen.append(os.environ.get(NCCL_BLOCKING_WAIT_ENV))
        raise Stop

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *_: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one (pretend) GPU for rank 0
    for flag in (True, False):
        with pytest.raises(Stop):
            ParallelContext.from_env(backend="nccl", blocking_wait=flag)
        with pytest.raises(Stop):
            ParallelContext.from_env(backend="gloo", blocking_wait=flag)
    assert seen == ["1", None, None, None]
    assert NCCL_BLOCKING_WAIT_ENV not in os.environ


@pytest.mark.parametrize(
    "message",
    [
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, "
        "NumelIn=4, NumelOut=4, Timeout(ms)=2000) ran for 2001 milliseconds before timing out.",
        "Work ran for 2001 milliseconds before timing out.",
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for recv operation to complete",
    ],
)
def test_backend_timeout_messages_become_comm_timeout_error(message):
    """The words each backend uses for a timeout (NCCL watchdog / blocking wait, gloo) are
    recognized; other errors are not."""
    group = mock.Mock(spec=dist.ProcessGroup)
    group.rank.return_value, group.size.return_value = 0, 2
    with (
        mock.patch("shardkit.comm.handle.group_label", return_value="shardkit_dp[0, 1]"),
        mock.patch("shardkit.comm.handle._group_timeout", return_value=timedelta(seconds=2)),
    ):
        err = as_timeout_error(RuntimeError(message), "all_reduce", group, torch.device("cpu"))
        assert isinstance(err, CommTimeoutError)
        assert "all_reduce on group shardkit_dp[0, 1] timed out after 2 s (rank 0 of 2" in str(err)
        assert as_timeout_error(RuntimeError("NCCL error: unhandled system error"), "x", group, torch.device("cpu")) is None
        assert as_timeout_error(ValueError(message), "x", group, torch.device("cpu")) is None


@pytest.mark.parametrize(
    "local_rank, local_world, n_gpus",
    [(1, "2", 1), (0, "2", 1), (1, None, 1), (0, "1", 0), (3, "4", 2)],
)
def test_from_env_nccl_with_fewer_gpus_than_ranks_names_both(monkeypatch, local_rank, local_world, n_gpus):
    """Two ranks on a one-GPU node with NCCL: a ValueError naming the local rank, the ranks per
    node and torch.cuda.device_count(), on every rank (rank 0 too, via LOCAL_WORLD_SIZE), before
    set_device or any process group (both patched to fail: no GPU here)."""
    env = dict(RANK=str(local_rank), WORLD_SIZE="4", LOCAL_RANK=str(local_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    forbidden = mock.Mock(side_effect=AssertionError("must fail before this"))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(torch.cuda, "set_device", forbidden)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n_gpus)
    per_node = local_world if local_world is not None else str(local_rank + 1)
    with pytest.raises(ValueError, match=rf"local rank {local_rank} of {per_node} ranks per node.*device_count\(\) is {n_gpus}"):
        ParallelContext.from_env(backend="nccl")
    forbidden.assert_not_called()


def test_from_env_nccl_with_enough_gpus_sets_the_local_device(monkeypatch):
    """The check lets a node with a GPU per rank through: rank 1 of 2 on 2 GPUs sets device 1."""
    env = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    class Stop(Exception):
        pass

    set_device = mock.Mock()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", mock.Mock(side_effect=Stop))
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(Stop):
        ParallelContext.from_env(backend="nccl")
    set_device.assert_called_once_with(1)


def test_comm_handle_states_without_processes():
    """A handle without work is complete (a pending post-processing, e.g. gloo's avg division,
    still runs once in wait()); with work it asks the work until wait(); repr says which."""
    t = torch.ones(3)
    posts: list[int] = []
    h = CommHandle("all_reduce", t, post=lambda: posts.append(1))
    assert h.is_completed() and posts == [] and "pending" in repr(h)
    assert h.wait() is t and h.wait() is t and posts == [1]  # idempotent: post ran once
    assert repr(h) == "CommHandle(all_reduce, completed, output=(3,) torch.float32)"
    work = mock.Mock(spec=dist.Work)
    work.is_completed.return_value = False
    h = CommHandle("broadcast", t, work=work)
    assert not h.is_completed() and "pending" in repr(h)
    work.is_completed.return_value = True
    assert h.is_completed()
    h.wait()
    work.wait.assert_called_once()
    work.is_completed.return_value = False  # no longer asked once waited
    assert h.is_completed() and "completed" in repr(h)
    assert "completed" in repr(CommHandle("broadcast", t))  # the size-1 local path
    with pytest.raises(TypeError, match="positional argument"):
        CommHandle("broadcast", t, work)  # type: ignore[misc]


def test_timeout_message_survives_an_unreadable_group_timeout():
    """The group's timeout comes from private c10d accessors: if they fail, the timeout error
    is still raised, saying "the group timeout" instead of a number."""
    group = mock.Mock(spec=dist.ProcessGroup)
    group.rank.return_value, group.size.return_value = 1, 2
    group._get_backend.side_effect = AttributeError("no such backend accessor")
    with mock.patch("shardkit.comm.handle.group_label", return_value="shardkit_dp[0, 1]"):
        err = as_timeout_error(RuntimeError("Timed out waiting 2000ms"), "all_reduce", group, torch.device("cpu"))
    assert isinstance(err, CommTimeoutError)
    assert "timed out after the group timeout (rank 1 of 2 in that group)" in str(err)


def _p2p_defaults_body() -> None:
    with ParallelContext.from_world() as ctx:
        group, me = ctx.group("dp"), ctx.rank("dp")
        with pytest.raises(ValueError, match="src"):
            recv(torch.empty(4), src=me, group=group)  # from itself: an error, never a hang
        with pytest.raises(ValueError, match="dst"):
            send(torch.ones(4), dst=me, group=group)
        if me == 0:
            t = torch.arange(4.0)
            handle = send(t, dst=1, group=group)  # default: synchronous
            assert handle.is_completed()  # the caller may reuse ``t`` right away
        elif me == 1:
            handle = recv(torch.empty(4), src=0, group=group)
            assert handle.is_completed()
            torch.testing.assert_close(handle.output, torch.arange(4.0), rtol=0, atol=0)


def test_send_recv_default_to_blocking_and_refuse_self(dist_pool):
    dist_pool.run(_p2p_defaults_body, world_size=2)


def test_from_env_without_torchrun_says_how_to_launch(monkeypatch) -> None:
    """A tp/pp layout started with plain ``python`` is a one-process world: the error says to use
    torchrun, with the process count the layout needs, before any process group exists."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match=r"not started by torchrun.*torchrun --nproc-per-node 4 your_script\.py"):
        ParallelContext.from_env(tp=2, pp=2)
    assert not torch.distributed.is_initialized()


def test_tp_spanning_machines_is_warned_about() -> None:
    from shardkit.comm.context import warn_if_tp_spans_machines

    with pytest.warns(UserWarning, match="tp=4 does not divide the 2 ranks per machine"):
        assert warn_if_tp_spans_machines(world_size=8, per_machine=2, tp=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_tp_spans_machines(world_size=8, per_machine=4, tp=2)  # inside a machine
        assert not warn_if_tp_spans_machines(world_size=4, per_machine=4, tp=4)  # one machine


# ---- all_to_all and ring_shift ---------------------------------------------------------------------
def _all_to_all_and_ring_body() -> tuple:
    r, n = dist.get_rank(), dist.get_world_size()
    with ParallelContext.from_world() as ctx:
        group, stats = ctx.group("dp"), CommStats()
        x = torch.arange(2 * n, dtype=torch.float32) + 100 * r  # slice j (2 values) goes to rank j
        out = all_to_all(torch.empty_like(x), x, group=group, stats=stats).output
        shifted = ring_shift(torch.empty(3), torch.full((3,), float(r)), group=group, async_op=True, stats=stats).wait()
        with pytest.raises(ValueError, match="divisible by the group size"):
            all_to_all(torch.empty(2 * n + 1), torch.empty(2 * n + 1), group=group)
        with pytest.raises(ValueError, match="must not be input"):
            t = torch.empty(3)
            ring_shift(t, t, group=group)
        return out.tolist(), shifted.tolist(), stats.bytes("all_to_all"), stats.bytes("ring_shift")


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_and_ring_shift(dist_pool, world_size):
    n = world_size
    for r, (out, shifted, a2a_bytes, ring_bytes) in enumerate(dist_pool.run(_all_to_all_and_ring_body, world_size=n)):
        assert out == [float(100 * src + 2 * r + i) for src in range(n) for i in range(2)]
        assert shifted == [float((r - 1) % n)] * 3
        assert a2a_bytes == 2 * n * 4 and ring_bytes == 3 * 4


def _dp_cp_blocks() -> tuple[list[int], int, int, bool]:
    with ParallelContext.from_world(cp=2) as ctx:  # 4 ranks: dp 2 x cp 2, the dp_cp group is all four
        group, place = ctx.dp_cp_blocks(2)
        again = ctx.dp_cp_blocks(2)[0] is group
        with pytest.raises(ValueError, match="block_size must be a positive divisor of the dp_cp size 4, got 3"):
            ctx.dp_cp_blocks(3)
        return dist.get_process_group_ranks(group), place, ctx.rank("dp_cp"), again


def test_dp_cp_blocks_are_consecutive_dp_cp_ranks(dist_pool) -> None:
    for rank, (ranks, place, dp_cp_rank, again) in enumerate(dist_pool.run(_dp_cp_blocks, world_size=4, timeout=60)):
        assert ranks == ([0, 1] if rank < 2 else [2, 3]) and place == dp_cp_rank % 2 == rank % 2 and again
