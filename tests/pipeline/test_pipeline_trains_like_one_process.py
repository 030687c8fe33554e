"""PipelineParallel on gloo (2 and 4 ranks) against the single-process model: every schedule
trains identically (fp32, SGD and AdamW, several steps), m < p, the token-weighted loss rule,
shape mismatches between stages and bad arguments raise on every rank instead of hanging."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32

from shardkit.comm import CommStats, ParallelContext
from shardkit.parallel.pipeline import executor, is_checkpointed
from shardkit.parallel.pipeline.executor import PipelineParallel
from shardkit.parallel.pipeline.schedules import Kind

D, VOCAB = 8, 11


def _blocks(n: int, seed: int = 0, d: int = D) -> list[nn.Module]:
    torch.manual_seed(seed)
    body = [nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n - 2)]
    return [nn.Embedding(VOCAB, d), *body, nn.Linear(d, VOCAB)]


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _batch(step: int, b: int = 8, t: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (b, t), generator=g), torch.randint(0, VOCAB, (b, t), generator=g)


def _opt(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)


def _train_equal_body(
    schedule: str,
    m: int,
    v: int,
    n_blocks: int,
    opt_name: str,
    steps: int,
    pp: int | None = None,
    checkpointing: bool | str = False,
) -> list[float]:
    with ParallelContext.from_world(pp=pp or dist.get_world_size(), dp=-1) as ctx:
        blocks = _blocks(n_blocks)
        pipe = PipelineParallel(
            blocks, ctx, schedule=schedule, microbatches=m, loss_fn=_ce, virtual_stages=v, checkpointing=checkpointing
        )
        calls = {j: 0 for s in pipe.stages for j in pipe.stage_blocks[s] if 0 < j < n_blocks - 1}
        for j in calls:  # the hook fires on every run of the block's Linear, recomputations included
            blocks[j][0].register_forward_pre_hook(lambda *_, j=j: calls.__setitem__(j, calls[j] + 1))
        opt = _opt(opt_name, pipe.parameters())
        ref = nn.Sequential(*_blocks(n_blocks))
        ref_opt = _opt(opt_name, ref.parameters())
        losses = []
        for step in range(steps):
            x, y = _batch(step)
            calls.update(dict.fromkeys(calls, 0))
            loss = pipe.step(x, y)
            opt.step()
            opt.zero_grad()
            ref_loss = _ce(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert loss == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-6)
            assert len(pipe.microbatch_losses) == m
            losses.append(loss)
        mine = [j for s in pipe.stages for j in pipe.stage_blocks[s]]
        assert mine, "every rank holds at least one block"
        for j in mine:
            for (name, got), want in zip(blocks[j].named_parameters(), ref[j].parameters(), strict=True):
                torch.testing.assert_close(got, want, **FP32, msg=f"block {j} {name}")
        full = pipe.full_state_dict()
        want_sd = ref.state_dict()
        assert list(full) == list(want_sd)
        for k, want in want_sd.items():
            torch.testing.assert_close(full[k], want, **FP32, msg=k)
        # blocks that are not ours were never touched
        for j in set(range(n_blocks)) - set(mine):
            assert all(q.grad is None for q in blocks[j].parameters())
        kinds = {ta.action.kind for ta in pipe.timeline}
        assert (Kind.BW in kinds) == (schedule == "zb-h1")
        # each micro-batch's forward, plus one recomputation per backward pass that needs the
        # block's activations: ZB-H1's input and weight passes recompute separately
        stage_of = {j: s for s in pipe.stages for j in pipe.stage_blocks[s]}
        for j, n in calls.items():
            runs = 1 + (2 if schedule == "zb-h1" and stage_of[j] > 0 else 1) * bool(checkpointing)
            assert n == runs * m, (j, n, runs)
        assert all(is_checkpointed(blocks[j]) == checkpointing for j in mine)
        return losses


CASES = [
    ("gpipe", 4, 1, 6),
    ("1f1b", 4, 1, 6),
    ("1f1b", 8, 1, 7),
    ("zb-h1", 4, 1, 6),
    ("interleaved", 4, 2, 9),
]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("schedule, m, v, n_blocks", CASES)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_trains_like_single_process(dist_pool, world_size, schedule, m, v, n_blocks, opt_name):
    if world_size * v > n_blocks:
        n_blocks = world_size * v + 1
    res = dist_pool.run(_train_equal_body, schedule, m, v, n_blocks, opt_name, 5, world_size=world_size, timeout=120)
    assert all(r == res[0] for r in res), "every pp rank returns the same losses"


@pytest.mark.parametrize("checkpointing", [True, "cpu"])
@pytest.mark.parametrize("schedule, m, v, n_blocks", CASES[:2] + CASES[3:])
def test_checkpointing_trains_like_single_process(dist_pool, schedule, m, v, n_blocks, checkpointing):
    # every schedule, ZB-H1's split backward included: only memory and recomputation change
    dist_pool.run(_train_equal_body, schedule, m, v, n_blocks, "sgd", 3, None, checkpointing, world_size=2, timeout=120)


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("zb-h1", 1), ("interleaved", 3)])
def test_single_rank_pipeline(dist_pool, schedule, v):
    # pp = 1 (dp = 2): no P2P at all; with v = 3 the stages hand tensors over locally
    dist_pool.run(_train_equal_body, schedule, 4, v, 5, "adamw", 3, 1, world_size=2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_fewer_microbatches_than_stages(dist_pool, schedule):
    # m = 1 and m = 2 on 4 stages: peers hang or refuse here
    for m in (1, 2):
        dist_pool.run(_train_equal_body, schedule, m, 1, 5, "sgd", 3, world_size=4, timeout=120)


def _token_weighted_body(m: int) -> None:
    # (loss_sum, count) with ignored tokens spread unevenly over the micro-batches: the gradient
    # is the global token mean's, for any m
    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1), reduction="sum", ignore_index=-1), (y != -1).sum()

    with ParallelContext.from_world(pp=dist.get_world_size(), dp=1) as ctx:
        blocks = _blocks(5)
        pipe = PipelineParallel(blocks, ctx, schedule="1f1b", microbatches=m, loss_fn=loss_fn)
        x, y = _batch(0, b=8, t=4)
        y[:2] = -1  # first two rows fully ignored
        y[5, 1:] = -1
        loss = pipe.step(x, y)
        ref = nn.Sequential(*_blocks(5))
        ref_loss = F.cross_entropy(ref(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-1)
        ref_loss.backward()
        assert loss == pytest.approx(float(ref_loss), rel=1e-6)
        for s in pipe.stages:
            for j in pipe.stage_blocks[s]:
                for got, want in zip(blocks[j].parameters(), ref[j].parameters(), strict=True):
                    torch.testing.assert_close(got.grad, want.grad, **FP32)
        if m == 4:  # micro-batch 0 has no counted token at all
            assert pipe.microbatch_losses[0] != pipe.microbatch_losses[0]  # nan: 0 / 0


@pytest.mark.parametrize("m", [1, 2, 4])
def test_token_weighted_normalization(dist_pool, m):
    dist_pool.run(_token_weighted_body, m, world_size=2)


class _Widen(nn.Module):
    def forward(self, x):
        return torch.cat([x, x], dim=-1)


def _mismatch_body() -> None:
    with ParallelContext.from_world(pp=dist.get_world_size(), dp=1) as ctx:
        blocks = _blocks(4)
        blocks[1] = nn.Sequential(blocks[1], _Widen())  # stage 0 now outputs 2D features
        stats = CommStats()
        pipe = PipelineParallel(blocks, ctx, schedule="1f1b", microbatches=2, loss_fn=_ce, stats=stats)
        x, y = _batch(0)
        with pytest.raises(
            ValueError,
            match=r"pipeline stage 1 \(pp rank 1, blocks 2..3\) cannot run its forward on stage 0's output \(pp rank 0, float32\[4, 3, 16\]\)",
        ):
            pipe.step(x, y)
        assert stats.calls("send") == 0 and stats.calls("recv") == 0, "no activation was sent"
        # the pipeline is usable again once the shapes agree
        blocks[1][1] = nn.Identity()
        assert pipe.step(x, y) > 0


def test_shape_mismatch_raises_on_every_rank(dist_pool):
    dist_pool.run(_mismatch_body, world_size=2, timeout=30)


def _bad_batch_body() -> None:
    with ParallelContext.from_world(pp=dist.get_world_size(), dp=1) as ctx:
        pipe = PipelineParallel(_blocks(4), ctx, schedule="gpipe", microbatches=3, loss_fn=_ce)
        x, y = _batch(0)  # batch 8, not a multiple of 3
        with pytest.raises(ValueError, match=r"pp rank\(s\) \[0, 1\]"):
            pipe.step(x, y)
        # rejected by the agreement, before any P2P: nothing in flight, so the next step runs
        # ([Note: a failed step's transfers])
        x, y = x[:6], y[:6]
        ref = nn.Sequential(*_blocks(4))
        assert pipe.step(x, y) == pytest.approx(float(_ce(ref(x), y)), rel=1e-5)


def test_bad_batch_raises_on_every_rank(dist_pool):
    dist_pool.run(_bad_batch_body, world_size=2, timeout=30)


def _bad_args_body() -> None:
    with ParallelContext.from_world(pp=dist.get_world_size(), dp=1) as ctx:
        calls = {
            n: mock.patch.object(dist, n, side_effect=AssertionError(n)) for n in ("isend", "irecv", "all_reduce", "broadcast")
        }
        for c in calls.values():
            c.start()
        try:
            with pytest.raises(ValueError, match="cannot split 3 blocks into 4 pipeline stages"):
                PipelineParallel(_blocks(3), ctx, schedule="interleaved", microbatches=2, loss_fn=_ce, virtual_stages=2)
            with pytest.raises(ValueError, match="multiple of the pp size 2"):
                PipelineParallel(_blocks(6), ctx, schedule="interleaved", microbatches=3, loss_fn=_ce, virtual_stages=2)
            with pytest.raises(ValueError, match="schedule must be one of"):
                PipelineParallel(_blocks(6), ctx, schedule="pipedream", microbatches=3, loss_fn=_ce)
            with pytest.raises(TypeError, match="loss_fn must be callable"):
                PipelineParallel(_blocks(6), ctx, microbatches=3, loss_fn=None)
            with pytest.raises(ValueError, match="checkpointing must be False, True or 'cpu', got 'gpu'"):
                PipelineParallel(_blocks(6), ctx, microbatches=3, loss_fn=_ce, checkpointing="gpu")
            with pytest.raises(ValueError, match=r"tied\[0\]: '9.weight' is no parameter"):
                PipelineParallel(_blocks(6), ctx, microbatches=3, loss_fn=_ce, tied=[("0.weight", "9.weight")])
        finally:
            for c in calls.values():
                c.stop()


def test_bad_arguments_raise_before_any_communication(dist_pool):
    dist_pool.run(_bad_args_body, world_size=2)


def _timeline_body() -> dict:
    with ParallelContext.from_world(pp=dist.get_world_size(), dp=1) as ctx:
        stats = CommStats()
        pipe = PipelineParallel(_blocks(6), ctx, schedule="1f1b", microbatches=4, loss_fn=_ce, stats=stats)
        pipe.step(*_batch(0))
        stats.reset()
        pipe.step(*_batch(1))
        tl = pipe.timeline
        assert [ta.action for ta in tl] == list(pipe.schedule.actions[ctx.rank("pp")])
        assert all(0 <= ta.start <= ta.end for ta in tl)
        assert all(ta.wait == 0 for ta in tl if ta.action.kind not in (Kind.RECV_F, Kind.RECV_B))
        # one activation and one gradient per micro-batch cross each boundary: [4, 3, 8] fp32
        nbytes = 4 * 2 * 3 * D * 4 // 4  # micro-batch of 2 rows
        r, p = ctx.rank("pp"), ctx.size("pp")
        n_send = 4 * ((r < p - 1) + (r > 0))
        assert stats.calls("send") == n_send and stats.bytes("send") == n_send * nbytes
        summary = pipe.timeline_summary()
        assert 0 < summary["compute"] <= summary["wall"] and summary["p2p_wait"] <= summary["wall"]
        # a new micro-batch shape re-runs the shape exchange and still matches the reference
        x, y = _batch(2, b=4, t=5)
        ref = nn.Sequential(*_blocks(6))
        assert pipe.step(x, y) == pytest.approx(float(_ce(ref(x), y)), rel=1e-5)  # no optimizer step ran
        return {"recv_wait": sum(ta.wait for ta in tl)}


def test_timeline_and_p2p_accounting(dist_pool):
    res = dist_pool.run(_timeline_body, world_size=4)
    assert res[-1]["recv_wait"] > 0  # the last stage waits for the pipe to fill


class _AddParam(nn.Module):
    """``x + p`` with ``p`` shaped like the micro-batch: autograd returns the incoming gradient
    itself as both ``dx`` and ``dp``, so accumulating ``dp`` in place must not reuse it."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p


def _aliased_grad_body(schedule: str, v: int) -> None:
    pp = dist.get_world_size() if v == 1 else 1
    with ParallelContext.from_world(pp=pp, dp=-1) as ctx:

        def make():
            blocks = _blocks(6)
            torch.manual_seed(1)
            blocks[4:4] = [_AddParam((2, 3, D)), _AddParam((2, 3, D))]  # micro-batch [2, 3, D]
            return blocks  # at pp = 2 the last stage starts with them: dp is the gradient it sends

        blocks = make()
        pipe = PipelineParallel(blocks, ctx, schedule=schedule, microbatches=4, loss_fn=_ce, virtual_stages=v)
        sent: list[tuple[torch.Tensor, torch.Tensor]] = []
        real_post, real_finalize = executor.post, PipelineParallel.finalize

        def post(ops, **kw):
            sent.extend((t, t.clone()) for op, t, *_ in ops if op == "send")
            return real_post(ops, **kw)

        def finalize(self, st):  # every send is still in flight until finalize waits for it
            for t, snapshot in sent:
                assert torch.equal(t, snapshot), "a tensor changed while its send was in flight"
            return real_finalize(self, st)

        x, y = _batch(0)
        with mock.patch.object(executor, "post", post), mock.patch.object(PipelineParallel, "finalize", finalize):
            pipe.step(x, y)
        assert sent or pp == 1
        ref = nn.Sequential(*make())
        # the reference runs the micro-batches one by one (its p would broadcast over them)
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            (_ce(ref(xs), ys) / 4).backward()
        for s in pipe.stages:
            for j in pipe.stage_blocks[s]:
                for got, want in zip(blocks[j].parameters(), ref[j].parameters(), strict=True):
                    torch.testing.assert_close(got.grad, want.grad, **FP32, msg=f"block {j}")


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 4)])
def test_gradient_aliasing_its_seed_is_not_reused(dist_pool, schedule, v):
    dist_pool.run(_aliased_grad_body, schedule, v, world_size=2, timeout=60)


def _caller_grads_body(schedule: str) -> None:
    """[Note: accumulating in param.grad]: gradients already in ``param.grad`` are added to, as
    by two backward calls of the unsplit model; a step that raises half-way leaves them as they
    were (no micro-batch of the failed step reaches them)."""
    with ParallelContext.from_world(pp=dist.get_world_size(), dp=-1) as ctx:
        pipe = PipelineParallel(_blocks(4), ctx, schedule=schedule, microbatches=4, loss_fn=_ce)
        ref = nn.Sequential(*_blocks(4))
        for step in range(2):  # no zero_grad in between: the second step adds to the first's
            x, y = _batch(step)
            pipe.step(x, y)
            _ce(ref(x), y).backward()
        grads = {n: q.grad for n, q in ref.named_parameters()}
        for s, mod in pipe.stages.items():
            for j, block in zip(pipe.stage_blocks[s], mod):
                for name, q in block.named_parameters():
                    torch.testing.assert_close(q.grad, grads[f"{j}.{name}"], **FP32)
        before = [q.grad.clone() for q in pipe.parameters()]
        boom = {"n": 0}

        def failing(out: torch.Tensor, yy: torch.Tensor) -> torch.Tensor:
            boom["n"] += 1
            if boom["n"] == 3:  # after two micro-batches' backward on the last stage
                raise RuntimeError("loss failed")
            return _ce(out, yy)

        pipe.loss_fn = failing
        with pytest.raises(RuntimeError, match="loss failed"):
            pipe.step(*_batch(5))
        for q, b in zip(pipe.parameters(), before, strict=True):
            assert torch.equal(q.grad, b)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_gradients_add_to_the_callers_and_a_failed_step_leaves_them(dist_pool, schedule):
    dist_pool.run(_caller_grads_body, schedule, world_size=1, timeout=60)
