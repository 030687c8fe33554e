"""The pipeline used the way people use it, against the dense
single-process model with the same seed:

* padded batches with the default loss (``ignore_index`` targets spread unevenly over the
  micro-batches and the dp replicas, one micro-batch all padding) train like the dense model
  on the global batch, and ``evaluate`` returns the loss the step reports;
* ``evaluate`` that fails on one rank raises the same error on every rank instead of leaving
  the others waiting for the timeout;
* a stage raising in the middle of a step raises the same ``RuntimeError`` on every rank at the
  end of that step (no peer waits for the timeout), leaves ``param.grad`` as it was, and the
  next step trains like the dense model.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from pipeline_checks import assert_stage_grads_match

from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT, gpt_blocks
from shardkit.parallel import parallelize
from shardkit.parallel.pipeline import PipelineParallel
from tolerances import FP32

VOCAB, B, T, IGNORE = 59, 8, 8, -100


# ---- padded batches with the default loss --------------------------------------------
def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, d_model=16, n_layers=2, n_heads=2, seq_len=T, tie_embeddings=False)


def _padded_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 rows of 8 tokens: rows 0-1 all padding (a whole micro-batch at m = 4, dp = 1, and two at
    dp = 2), row 4 with 7 padded tokens; the dp replicas' valid counts differ (16 vs 25)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randint(VOCAB, (B, T), generator=g), torch.randint(VOCAB, (B, T), generator=g)
    y[0:2] = IGNORE
    y[4, 1:] = IGNORE
    return x, y


def _dense_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)


def _padded_body(dp_strategy: str, schedule: str) -> list[float]:
    world = dist.get_world_size()
    with ParallelContext.from_world(pp=2, dp=world // 2) as ctx:
        dense = _gpt()
        dense_opt = torch.optim.SGD(dense.parameters(), lr=0.5)
        par = parallelize(_gpt(), ctx, pp={"microbatches": 4, "schedule": schedule}, blocks=gpt_blocks, dp=dp_strategy)
        opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.5)
        dp, r = ctx.size("dp"), ctx.rank("dp")
        rows = slice(r * B // dp, (r + 1) * B // dp)
        losses = []
        for step in range(2):
            x, y = _padded_batch(step)
            with torch.no_grad():
                want_mine = float(_dense_ce(dense(x[rows]), y[rows]))  # this replica's rows
            evaluated = par.evaluate(x[rows], y[rows])
            loss = float(par.forward_backward(x[rows], y[rows]))
            norm = float(par.clip(1e9))  # no clipping: the global norm of the global gradient
            par.step(opt)
            opt.zero_grad(set_to_none=True)
            dense_loss = _dense_ce(dense(x), y)  # the whole global batch
            dense_loss.backward()
            want_norm = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), 1e9))
            dense_opt.step()
            dense_opt.zero_grad()
            assert loss == pytest.approx(want_mine, rel=1e-5), (step, loss, want_mine)
            assert evaluated == pytest.approx(loss, rel=1e-5), "train and evaluate disagree"
            assert norm == pytest.approx(want_norm, rel=1e-5), (step, norm, want_norm)
            losses.append(float(dense_loss.detach()))
        full = par.pipeline.full_state_dict()
        for key, want in nn.Sequential(*gpt_blocks(dense)).state_dict().items():
            torch.testing.assert_close(full[key], want, **FP32, msg=lambda m, key=key: f"{key}: {m}")
        par.close()
        return losses


@pytest.mark.parametrize(
    "world_size, dp_strategy, schedule",
    [(2, "ddp", "1f1b"), (4, "ddp", "gpipe"), (4, "zero1", "zb-h1")],
)
def test_default_loss_weights_micro_batches_and_replicas_by_their_valid_tokens(dist_pool, world_size, dp_strategy, schedule):
    """pp 2 (and dp 2 × pp 2 with ddp and ZeRO-1): the step's loss is the token mean of the
    replica's batch, its gradient (norm and two SGD steps) the dense model's on the global batch,
    with an all-padding micro-batch (no nan) and padding spread unevenly over the replicas."""
    dist_pool.run(_padded_body, dp_strategy, schedule, world_size=world_size, timeout=120)


# ---- a rank raising -----------------------------------------------------------
D = 8


class _Tripwire(nn.Module):
    """Identity whose forward (or backward) raises on the calls numbered in ``fail_forward``
    (``fail_backward``), 0-based, counted from the last :meth:`arm`."""

    def __init__(self) -> None:
        super().__init__()
        self.arm()

    def arm(self, fail_forward: set[int] = frozenset(), fail_backward: set[int] = frozenset()) -> None:
        self.forwards, self.backwards = 0, 0
        self.fail_forward, self.fail_backward = set(fail_forward), set(fail_backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, self.forwards = self.forwards, self.forwards + 1
        if n in self.fail_forward:
            raise RuntimeError("tripwire in forward")
        return _BackwardTrip.apply(x, self) if x.requires_grad else x


class _BackwardTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, wire: _Tripwire) -> torch.Tensor:
        ctx.wire = wire
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        wire = ctx.wire
        n, wire.backwards = wire.backwards, wire.backwards + 1
        if n in wire.fail_backward:
            raise RuntimeError("tripwire in backward")
        return g, None


def _blocks(n_wires: int) -> list[nn.Module]:
    """Embedding, then ``n_wires`` × (Linear + Tanh, tripwire), then the head."""
    torch.manual_seed(0)
    body = [m for _ in range(n_wires) for m in (nn.Sequential(nn.Linear(D, D), nn.Tanh()), _Tripwire())]
    return [nn.Embedding(VOCAB, D), *body, nn.Linear(D, VOCAB)]


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (8, 3), generator=g), torch.randint(0, VOCAB, (8, 3), generator=g)


_TIMEOUT_S = 4  # the pp group's: before the fixes a peer waited this long, then timed out


def _failing_evaluate_body() -> None:
    p = dist.get_world_size()
    with ParallelContext.from_world(pp=p, dp=1, timeout=timedelta(seconds=_TIMEOUT_S)) as ctx:
        blocks = _blocks(p)
        pipe = PipelineParallel(blocks, ctx, schedule="1f1b", microbatches=2, loss_fn=_ce)
        ref = nn.Sequential(*_blocks(p))
        x, y = _batch(1)
        cases = [
            # the last stage's loss cannot take the targets (a sequence one token short)
            (x, y[:, :-1], rf"stage {p - 1} \(pp rank {p - 1}\) failed in the loss"),
            # the first stage has no inputs: the failure travels through every stage after it
            (None, y, r"stage 0 \(pp rank 0\) failed in its forward: TypeError"),
        ]
        for inputs, targets, match in cases:
            start = time.monotonic()
            with pytest.raises(ValueError, match=match):
                pipe.evaluate(inputs, targets)
            assert time.monotonic() - start < _TIMEOUT_S / 2, "a rank waited for the timeout"
        # nothing left in flight: evaluate and step run and match the dense model
        with torch.no_grad():
            assert pipe.evaluate(x, y) == pytest.approx(float(_ce(ref(x), y)), rel=1e-5)
        ref_loss = _ce(ref(x), y)
        ref_loss.backward()
        assert pipe.step(x, y) == pytest.approx(float(ref_loss), rel=1e-5)
        assert_stage_grads_match(pipe, blocks, ref)


@pytest.mark.parametrize("world_size", [2, 4])
def test_evaluate_failing_on_one_rank_raises_the_same_error_on_every_rank(dist_pool, world_size):
    dist_pool.run(_failing_evaluate_body, world_size=world_size, timeout=60)


def _mid_step_body(schedule: str, wire: int, fail_forward: set[int], fail_backward: set[int], match: str) -> None:
    """Tripwire ``wire`` (of one per pp rank, in stage order) raises part-way through the step,
    on its rank only: every rank raises the same RuntimeError promptly, keeps its gradients, and
    the next step (nothing left in flight) trains like the dense model."""
    p = dist.get_world_size()
    with ParallelContext.from_world(pp=p, dp=1, timeout=timedelta(seconds=_TIMEOUT_S)) as ctx:
        blocks = _blocks(p)
        # stage 0: embedding, Linear, tripwire 0; stage k: Linear, tripwire k; the last adds the head
        split = [3] + [2] * (p - 2) + [3]
        pipe = PipelineParallel(blocks, ctx, schedule=schedule, microbatches=4, loss_fn=_ce, split=split)
        ref = nn.Sequential(*_blocks(p))
        x, y = _batch(2)
        pipe.step(x, y)  # a good step first: the gradients the failed step must leave as they are
        _ce(ref(x), y).backward()
        before = [q.grad.clone() for q in pipe.parameters()]
        wires = [b for b in blocks if isinstance(b, _Tripwire)]
        wires[wire].arm(fail_forward, fail_backward)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=match):
            pipe.step(*_batch(3))
        assert time.monotonic() - start < _TIMEOUT_S / 2, "a rank waited for the timeout"
        for q, b in zip(pipe.parameters(), before, strict=True):
            assert torch.equal(q.grad, b), "a gradient of the failed step reached param.grad"
        wires[wire].arm()
        ref_loss = _ce(ref(x), y)
        ref_loss.backward()  # the second good step adds to the first's gradients, as the pipeline's
        assert pipe.step(x, y) == pytest.approx(float(ref_loss), rel=1e-5)
        assert_stage_grads_match(pipe, blocks, ref)


@pytest.mark.parametrize(
    "world_size, schedule, wire, fail_forward, fail_backward, match",
    [
        # stage 0 raises in micro-batch 1's forward: pp rank 1 waits for that activation
        (2, "1f1b", 0, {1}, set(), r"pp rank 0: F0\.1 \(stage 0, blocks 0\.\.2, micro-batch 1\) raised RuntimeError: tripwire"),
        # the last stage raises in micro-batch 2's forward: pp rank 0 waits for its gradients
        (2, "gpipe", 1, {2}, set(), r"pp rank 1: F1\.2 .* raised RuntimeError: tripwire in forward"),
        # a middle stage raises in a backward (ZB-H1's BI): the ranks on both sides wait for it
        (4, "zb-h1", 1, set(), {1}, r"pp rank 1: BI1\.1 .* raised RuntimeError: tripwire in backward"),
    ],
)
def test_a_stage_raising_mid_step_raises_on_every_rank_and_the_next_step_runs(
    dist_pool, world_size, schedule, wire, fail_forward, fail_backward, match
):
    dist_pool.run(_mid_step_body, schedule, wire, fail_forward, fail_backward, match, world_size=world_size, timeout=60)
