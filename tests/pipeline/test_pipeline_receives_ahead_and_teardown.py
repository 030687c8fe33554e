"""Pipeline edges: receives posted ahead on gloo ([Note: receives ahead
on gloo]) at the edges (m < p, m = 1, interleaved m = p, checkpointing, evaluate between steps);
a step that fails mid-schedule; contexts destroyed after the world; initialize failing."""

from __future__ import annotations

import time
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from pipeline_checks import assert_stage_grads_match

from shardkit.comm import ParallelContext
from shardkit.parallel.pipeline import PipelineParallel, build_schedule, executor
from shardkit.parallel.pipeline.executor import GLOO_RECV_AHEAD

D, VOCAB = 8, 11


class _Interrupt(BaseException):
    """Not an ``Exception``, as ``KeyboardInterrupt``: the executor does not drain the step's
    transfers for it ([Note: a stage failing mid-step] covers exceptions in compute)."""


class _Tripwire(nn.Module):
    """Identity that raises :class:`_Interrupt` on the forward calls numbered in ``fail_on`` (0-based)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.fail_on, self.delay = 0, set(), 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, self.calls = self.calls, self.calls + 1
        if n in self.fail_on:
            time.sleep(self.delay)  # let the sends posted before the failure reach their peer
            raise _Interrupt("tripwire")
        return x


def _blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Embedding(VOCAB, D),
        _Tripwire(),
        nn.Sequential(nn.Linear(D, D), nn.Tanh()),
        _Tripwire(),
        nn.Linear(D, VOCAB),
    ]


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _reference_check(pipe: PipelineParallel, blocks: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> float:
    for q in pipe.parameters():
        q.grad = None
    loss = pipe.step(x, y)
    ref = nn.Sequential(*_blocks())
    ref_loss = _ce(ref(x), y)
    ref_loss.backward()
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    assert_stage_grads_match(pipe, blocks, ref)
    return loss


def _failed_step_then_good_body(recv_ahead: int) -> float:
    """gpipe p=2 m=4. Step 1 is interrupted on both ranks (not an Exception: nothing is
    drained): rank 0 in F0.1 (after SEND_F0.0 matched), rank 1 in F1.0 (after waiting
    RECV_F1.0). With receives posted ahead, rank 1 still has
    RECV_F1.1/RECV_F1.2 posted; their tags are the next step's too ([Note: a failed step's
    transfers]): the next step must raise the same RuntimeError on every rank before any P2P,
    and a new context and pipeline on the same blocks must train like one process."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, VOCAB, (8, 3), generator=g), torch.randint(0, VOCAB, (8, 3), generator=g)
    # a short pp timeout: a stale receive stealing the next step's data shows as a timeout, not a hang
    with ParallelContext.from_world(pp=2, dp=1, timeout=timedelta(seconds=4)) as ctx:
        with mock.patch.object(executor, "GLOO_RECV_AHEAD", recv_ahead):
            blocks = _blocks()
            pipe = PipelineParallel(blocks, ctx, schedule="gpipe", microbatches=4, loss_fn=_ce, split=[2, 3])
        pipe.step(x, y)  # a good step first: the shape exchange runs the stages once
        for w in (blocks[1], blocks[3]):
            w.calls = 0
        blocks[1].fail_on, blocks[3].fail_on = {1}, {0}  # F0.1 on rank 0, F1.0 on rank 1
        blocks[1].delay = 1.0  # a send dropped unwaited never arrives: rank 1 must get F0.0 first
        with pytest.raises(_Interrupt, match="tripwire"):
            pipe.step(x, y)
        blocks[1].fail_on, blocks[3].fail_on = set(), set()
        dist.barrier()  # both ranks are past the failed step
        # rank 0: F0.0's send (gloo reports a send complete only once waited); rank 1: RECV_F1.1/F1.2
        with pytest.raises(RuntimeError, match=r"in flight on pp rank\(s\) \{0: 1, 1: 2\}"):
            pipe.step(x, y)
    with ParallelContext.from_world(pp=2, dp=1, timeout=timedelta(seconds=4)) as fresh:
        pipe = PipelineParallel(blocks, fresh, schedule="gpipe", microbatches=4, loss_fn=_ce, split=[2, 3])
        return _reference_check(pipe, blocks, x, y)


def _stack(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Embedding(VOCAB, D), *(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(n - 2)), nn.Linear(D, VOCAB)]


def _edge_body(schedule: str, m: int, v: int, checkpointing: bool) -> None:
    """Receives posted GLOO_RECV_AHEAD computes early where that reaches past the step's start
    (m < p, m = 1, interleaved m = p): two steps and an evaluate() in between all match the
    single-process model, and each step leaves nothing posted."""
    p = dist.get_world_size()
    with ParallelContext.from_world(pp=p, dp=1) as ctx:
        blocks = _stack(p * v + 1)
        pipe = PipelineParallel(
            blocks, ctx, schedule=schedule, microbatches=m, loss_fn=_ce, virtual_stages=v, checkpointing=checkpointing
        )
        ahead = build_schedule(schedule, num_ranks=p, microbatches=m, virtual_stages=v, recv_ahead=GLOO_RECV_AHEAD)
        assert pipe.schedule == ahead  # gloo: receives posted ahead, some before any compute
        ref = nn.Sequential(*_stack(p * v + 1))
        g = torch.Generator().manual_seed(5)
        for step in range(2):
            x, y = torch.randint(0, VOCAB, (2 * m, 3), generator=g), torch.randint(0, VOCAB, (2 * m, 3), generator=g)
            for q in [*pipe.parameters(), *ref.parameters()]:
                q.grad = None
            loss = pipe.step(x, y)
            ref_loss = _ce(ref(x), y)
            ref_loss.backward()
            assert loss == pytest.approx(float(ref_loss), rel=1e-5)
            assert_stage_grads_match(pipe, blocks, ref, f"step {step}")
            xe = torch.randint(0, VOCAB, (3, 3), generator=g)  # another batch size: no step shape
            with torch.no_grad():
                want = float(_ce(ref(xe), xe))
            assert pipe.evaluate(xe, xe) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize(
    "schedule, m, v, checkpointing",
    [("zb-h1", 1, 1, True), ("1f1b", 1, 1, False), ("gpipe", 3, 1, False), ("interleaved", 2, 2, True)],
)
def test_receives_ahead_at_the_edges_train_and_evaluate_like_one_process(dist_pool, schedule, m, v, checkpointing):
    dist_pool.run(_edge_body, schedule, m, v, checkpointing, world_size=2, timeout=60)


def test_a_failed_step_leaves_no_receive_for_the_next_ahead(dist_pool):
    """The gloo default (GLOO_RECV_AHEAD computes ahead): the next step refuses on every rank
    (rank 1 holds RECV_F1.1/F1.2); a new context starts clean."""
    dist_pool.run(_failed_step_then_good_body, executor.GLOO_RECV_AHEAD, world_size=2, timeout=40)


# ---- ParallelContext.destroy() owning the world ----------------------------------------------------
def _no_torchrun_env(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_a_sibling_context_destroyed_after_the_world_is_a_no_op(monkeypatch):
    """destroy() is documented idempotent and local; a context built on from_env's world (as
    parallelize/ZeRO/tied groups do) destroyed after the owner must not raise."""
    _no_torchrun_env(monkeypatch)
    assert not dist.is_initialized()
    try:
        owner = ParallelContext.from_env(backend="gloo")
        sibling = ParallelContext.from_world()  # its own axis groups, on the same world
        owner.destroy()
        assert not dist.is_initialized()
        sibling.destroy()  # its groups went with the world: nothing left to release
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_initialize_leaves_no_world_when_it_fails_after_creating_it(monkeypatch):
    """shardkit.initialize() without ctx creates the world through from_env; a config error
    raised afterwards (the batch rule needs the world size) leaves a world nobody owns."""
    import shardkit

    _no_torchrun_env(monkeypatch)
    assert not dist.is_initialized()
    bad = {"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    try:
        with pytest.raises(ValueError, match="batch"):
            shardkit.initialize(model=nn.Linear(2, 2), config=bad)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
