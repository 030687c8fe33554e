"""split="time": measure_block_times (ranks costly blocks higher, leaves grads/buffers/RNG as they
were), partition on float weights against brute force, and PipelineParallel on gloo pp=2: the
ranks agree on one split from their summed timings even when their own timings would split
differently, train like the single-process model, and a missing split_example raises before
any collective."""

from __future__ import annotations

import itertools
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from tolerances import FP32

from shardkit.comm import ParallelContext
from shardkit.parallel.pipeline import executor
from shardkit.parallel.pipeline.executor import PipelineParallel
from shardkit.parallel.pipeline.split import measure_block_times, partition, split_blocks

D, VOCAB = 8, 11


# ---- measure_block_times (no processes) ------------------------------------------------------
def test_measure_ranks_costly_block_higher_and_leaves_state():
    torch.manual_seed(0)
    cheap = nn.Linear(64, 64)
    costly = nn.Sequential(nn.Linear(64, 2048), nn.Linear(2048, 64))  # 64x the FLOPs of `cheap`
    norm = nn.Sequential(nn.BatchNorm1d(64), nn.Dropout(0.5))
    blocks = [cheap, costly, norm]
    before = {id(q): None if q.grad is None else q.grad.clone() for b in blocks for q in b.parameters()}
    cheap.weight.grad = torch.full_like(cheap.weight, 3.0)  # an existing grad must stay as it is
    before[id(cheap.weight)] = cheap.weight.grad.clone()
    stats = [b.clone() for b in norm.buffers()]
    example = torch.randn(256, 64)
    torch.manual_seed(123)
    want_rand = torch.rand(4)
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two intra-op threads on a shared 2-core host time the contention
    try:
        times = measure_block_times(blocks, example, repeats=5, warmup=1)
    finally:
        torch.set_num_threads(threads)
    got_rand = torch.rand(4)
    assert len(times) == 3 and all(t > 0 for t in times)
    # loose: a 64x FLOP gap measured > 3x even on a loaded 2-core machine
    assert times[1] > 3 * times[0], times
    for b in blocks:
        for q in b.parameters():
            want = before[id(q)]
            assert (q.grad is None) == (want is None)
            if want is not None:
                torch.testing.assert_close(q.grad, want, rtol=0, atol=0)
    for got, want in zip(norm.buffers(), stats, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # BatchNorm running stats restored
    torch.testing.assert_close(got_rand, want_rand, rtol=0, atol=0)  # Dropout's draws did not leak


def test_measure_int_input_and_bad_args():
    blocks = [nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)]
    assert len(measure_block_times(blocks, torch.randint(0, VOCAB, (4, 3)), repeats=1, warmup=0)) == 2
    with pytest.raises(ValueError, match="repeats"):
        measure_block_times(blocks, torch.zeros(1, dtype=torch.long), repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        measure_block_times(blocks, torch.zeros(1, dtype=torch.long), warmup=-1)
    with pytest.raises(TypeError, match="example"):
        measure_block_times(blocks, [1, 2])


# ---- partition on float weights ---------------------------------------------------------------
def _brute_min_max(weights: list[float], k: int) -> float:
    n = len(weights)
    return min(
        max(sum(weights[a:b]) for a, b in itertools.pairwise((0, *cuts, n)))
        for cuts in itertools.combinations(range(1, n), k - 1)
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e-2, allow_nan=False), min_size=1, max_size=8), st.data())
def test_time_partition_of_floats_is_optimal(weights, data):
    k = data.draw(st.integers(1, len(weights)))
    sizes = partition(weights, k, "time")
    assert len(sizes) == k and sum(sizes) == len(weights) and min(sizes) >= 1
    bounds = list(itertools.accumulate(sizes, initial=0))
    cost = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
    assert cost == pytest.approx(_brute_min_max(weights, k), rel=1e-9, abs=1e-15)


def test_time_partition_examples_and_errors():
    assert partition([0.5, 0.1, 0.1, 0.2], 2, "time") == [1, 3]
    assert partition([0.5, 0.1, 0.1, 0.2], 2, "params") == [1, 3]  # floats for "params" too
    with pytest.raises(ValueError, match="weights"):
        partition([0.1, float("nan")], 2, "time")
    with pytest.raises(ValueError, match="weights"):
        partition([0.1, -1.0], 2, "time")
    mods = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(ValueError, match="weights="):
        split_blocks(mods, 2, "time")
    with pytest.raises(ValueError, match="weights has 2"):
        split_blocks(mods, 2, "time", weights=[1.0, 2.0])
    assert [len(r) for r, _ in split_blocks(mods, 2, "time", weights=[3.0, 1.0, 1.0])] == [1, 2]


# ---- PipelineParallel(split="time") on gloo --------------------------------------------------
def _blocks(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    body = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)]
    wide = nn.Sequential(nn.Linear(D, 512), nn.Tanh(), nn.Linear(512, D))
    return [nn.Embedding(VOCAB, D), wide, *body, nn.Linear(D, VOCAB)]  # 6 blocks


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (8, 3), generator=g), torch.randint(0, VOCAB, (8, 3), generator=g)


# Fake timings (ms) where each rank alone would split differently from the agreed sum: rank 0
# alone -> [1, 5], rank 1 (its times doubled and skewed) alone -> [4, 2], their sum
# [6, 3, 3, 3, 3, 9] -> [3, 3] (max 15; [4, 2] ties at 15 and loses the tie to fewer blocks
# in earlier stages).
_FAKE = {0: [4e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3], 1: [2e-3, 2e-3, 2e-3, 2e-3, 2e-3, 8e-3]}


def _time_split_body(fake: bool, with_target: bool) -> dict:
    rank = dist.get_rank()
    with ParallelContext.from_world(pp=2, dp=-1) as ctx:
        x0, y0 = _batch(0)
        example = (x0[:2], y0[:2]) if with_target else x0[:2]  # one micro-batch (of 2 rows)
        seen = []
        real = executor.measure_block_times

        def measure(blocks, ex, **kw):
            seen.append((ex, kw))
            times = _FAKE[rank] if fake else real(blocks, ex, **kw)
            return times if fake or rank == 0 else [2 * t for t in times]  # rank 1 perturbed

        blocks = _blocks()
        with mock.patch.object(executor, "measure_block_times", measure):
            pipe = PipelineParallel(
                blocks, ctx, schedule="1f1b", microbatches=4, loss_fn=_ce, split="time", split_example=example
            )
        assert len(seen) == 1
        ex, kw = seen[0]
        if with_target:  # (input, target): the loss is timed with the last block
            assert ex is example[0] and kw["target"] is example[1] and kw["loss_fn"] is _ce
        else:
            assert ex is example and kw.get("loss_fn") is None and kw.get("target") is None
        ref = nn.Sequential(*_blocks())
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            x, y = _batch(step)
            loss = pipe.step(x, y)
            opt.step()
            opt.zero_grad()
            ref_loss = _ce(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert loss == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-6)
        for k, want in ref.state_dict().items():
            torch.testing.assert_close(pipe.full_state_dict()[k], want, **FP32, msg=k)
        return {"sizes": [len(r) for r in pipe.stage_blocks]}


@pytest.mark.parametrize("fake, with_target", [(True, False), (False, True)])
def test_time_split_agrees_across_ranks_and_trains(dist_pool, fake, with_target):
    res = dist_pool.run(_time_split_body, fake, with_target, world_size=2, timeout=60)
    assert res[0]["sizes"] == res[1]["sizes"], res
    if fake:
        ns = [round(a * 1e9) + round(b * 1e9) for a, b in zip(_FAKE[0], _FAKE[1], strict=True)]
        assert res[0]["sizes"] == partition(ns, 2, "time") == [3, 3]
        assert partition(_FAKE[0], 2, "time") != [3, 3] != partition(_FAKE[1], 2, "time")


def _missing_example_body() -> None:
    # only rank 0 constructs: a collective before the check would hang it (and fail the timeout)
    with ParallelContext.from_world(pp=2, dp=-1) as ctx:
        if dist.get_rank() == 0:
            with mock.patch.object(executor, "measure_block_times", side_effect=AssertionError("measured")):
                with pytest.raises(ValueError, match="split_example"):
                    PipelineParallel(_blocks(), ctx, microbatches=2, loss_fn=_ce, split="time")


def test_time_split_without_example_raises_before_communicating(dist_pool):
    dist_pool.run(_missing_example_body, world_size=2, timeout=30)


def _parallelize_body() -> list[int]:
    from shardkit.parallel.compose import parallelize

    with ParallelContext.from_world(pp=2, dp=-1) as ctx:
        fake = _FAKE[dist.get_rank()]
        with mock.patch.object(executor, "measure_block_times", lambda *a, **kw: fake):
            par = parallelize(
                nn.Sequential(*_blocks()),
                ctx,
                loss_fn=_ce,
                dp="none",
                pp={"microbatches": 2, "split": "time", "split_example": _batch(0)[0][:4]},
            )
        return [len(r) for r in par.pipeline.stage_blocks]


def test_parallelize_passes_split_example(dist_pool):
    assert dist_pool.run(_parallelize_body, world_size=2, timeout=60) == [[3, 3], [3, 3]]


class _Probe(nn.Module):
    """Records whether the measurement asked for its input's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.input_requires_grad: list[bool] = []

    def forward(self, x):
        self.input_requires_grad.append(x.requires_grad)
        return x * self.w


def test_measure_times_no_input_gradient_for_the_first_block():
    # the pipeline's first stage never computes its input's gradient (the input is data): timing
    # it would overweight stage 0 in split="time"; every later block's input gradient is timed
    probes = [_Probe(), _Probe()]
    measure_block_times(probes, torch.randn(2, 4), repeats=1, warmup=0)
    assert [p.input_requires_grad for p in probes] == [[False], [True]]


def test_measure_times_the_loss_with_the_last_block():
    # a loss that costs 20 ms lands on the last block only; (loss_sum, count) returns work too
    def slow_loss(out: torch.Tensor, y: torch.Tensor):
        time.sleep(0.02)
        return (out - y).pow(2).sum(), torch.tensor(out.numel())

    blocks = [nn.Linear(8, 8), nn.Linear(8, 8)]
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    plain = measure_block_times(blocks, x, repeats=1, warmup=0)
    timed = measure_block_times(blocks, x, repeats=1, warmup=0, loss_fn=slow_loss, target=y)
    assert timed[1] >= 0.02 > plain[1] and timed[0] < 0.02
    assert all(q.grad is None for b in blocks for q in b.parameters())  # measuring leaves no grads
    with pytest.raises(ValueError, match="loss_fn and target go together"):
        measure_block_times(blocks, x, loss_fn=slow_loss)
