"""Tensor-parallel layers at tp = 2 and 4 (gloo) against the dense single-process layers.

Every body builds the dense reference inside the worker from the same seeds, so each rank checks
its own slice; weights are compared exactly where they are copies, activations and gradients with
the fp32 tolerance (the TP sums run in another order).
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.comm import CommStats, ParallelContext
from shardkit.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelGrads,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    reduce_from_tp_region,
    scatter_to_sequence_region,
    share_sequence_parallel_grads,
)
from tolerances import FP32


def _tp_ctx() -> ParallelContext:
    return ParallelContext.from_world(tp=dist.get_world_size())


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _twins(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.clone().requires_grad_(), x.clone().requires_grad_()


# ---- single layers --------------------------------------------------------------------------------
def _linear_body() -> None:
    with _tp_ctx() as ctx:
        tp, r = ctx.size("tp"), ctx.rank("tp")
        # [Note: TP initialization equals the dense layer]: same seed, same weights, split.
        torch.manual_seed(0)
        dense_c = nn.Linear(12, 8)
        torch.manual_seed(0)
        col = ColumnParallelLinear(12, 8, ctx=ctx, gather_output=True)
        assert torch.equal(col.weight, dense_c.weight.chunk(tp, 0)[r]) and torch.equal(col.bias, dense_c.bias.chunk(tp)[r])
        torch.manual_seed(1)
        dense_r = nn.Linear(8, 6)
        torch.manual_seed(1)
        row = RowParallelLinear(8, 6, ctx=ctx, input_is_parallel=False)
        assert torch.equal(row.weight, dense_r.weight.chunk(tp, 1)[r]) and torch.equal(row.bias, dense_r.bias)

        x, xd = _twins(_randn(2, 4, 12, seed=2))
        dy = _randn(2, 4, 8, seed=3)
        y, yd = col(x), dense_c(xd)
        torch.testing.assert_close(y, yd, **FP32)
        y.backward(dy)
        yd.backward(dy)
        torch.testing.assert_close(x.grad, xd.grad, **FP32)  # the all-reduce of the partial dX
        torch.testing.assert_close(col.weight.grad, dense_c.weight.grad.chunk(tp, 0)[r], **FP32)
        torch.testing.assert_close(col.bias.grad, dense_c.bias.grad.chunk(tp)[r], **FP32)

        h, hd = _twins(_randn(2, 4, 8, seed=4))
        dz = _randn(2, 4, 6, seed=5)
        z, zd = row(h), dense_r(hd)
        torch.testing.assert_close(z, zd, **FP32)
        z.backward(dz)
        zd.backward(dz)
        torch.testing.assert_close(h.grad, hd.grad, **FP32)  # the all-gather of the split's gradient
        torch.testing.assert_close(row.weight.grad, dense_r.weight.grad.chunk(tp, 1)[r], **FP32)
        torch.testing.assert_close(row.bias.grad, dense_r.bias.grad, **FP32)

        # fused [q; k; v]: each of the three blocks is split separately; gathered = dense order
        dense_qkv = nn.Linear(8, 3 * 8)
        qkv = ColumnParallelLinear.from_dense(dense_qkv, ctx=ctx, fused_chunks=3, gather_output=True)
        assert torch.equal(qkv.weight, torch.cat([w.chunk(tp, 0)[r] for w in dense_qkv.weight.chunk(3, 0)]))
        torch.testing.assert_close(qkv(hd.detach()), dense_qkv(hd.detach()), **FP32)


def _embedding_body() -> None:
    with _tp_ctx() as ctx:
        tp, r = ctx.size("tp"), ctx.rank("tp")
        torch.manual_seed(3)
        dense = nn.Embedding(10, 6, padding_idx=3)  # 10 rows: 5 + 5 at tp 2, 3 + 3 + 3 + 1 at tp 4
        torch.manual_seed(3)
        emb = VocabParallelEmbedding(10, 6, ctx=ctx, padding_idx=3)
        per = -(-10 // tp)
        expect = torch.zeros(per, 6)
        rows = dense.weight.detach()[r * per : (r + 1) * per]
        expect[: rows.shape[0]] = rows
        assert torch.equal(emb.weight, expect)
        ids = torch.tensor([[0, 3, 9, 4, 4, 7, 2, 5], [9, 8, 1, 3, 0, 6, 6, 2]])
        dy = _randn(2, 8, 6, seed=6)
        y, yd = emb(ids), dense(ids)
        torch.testing.assert_close(y, yd, **FP32)
        y.backward(dy)
        yd.backward(dy)
        expect_grad = torch.zeros(per, 6)
        g = dense.weight.grad[r * per : (r + 1) * per]
        expect_grad[: g.shape[0]] = g
        torch.testing.assert_close(emb.weight.grad, expect_grad, **FP32)  # pad row: none; padding_idx: 0

        sp = VocabParallelEmbedding.from_dense(dense, ctx=ctx, sequence_parallel=True)
        torch.testing.assert_close(sp(ids), yd.detach().chunk(tp, 1)[r], **FP32)


def _sequence_parallel_body() -> None:
    with _tp_ctx() as ctx:
        tp, r = ctx.size("tp"), ctx.rank("tp")
        dense_c, dense_r = nn.Linear(12, 8), nn.Linear(8, 6)
        col = ColumnParallelLinear.from_dense(dense_c, ctx=ctx, sequence_parallel=True)
        row = RowParallelLinear.from_dense(dense_r, ctx=ctx, sequence_parallel=True)
        x_full = _randn(2, 8, 12, seed=7)
        x, xd = x_full.chunk(tp, 1)[r].clone().requires_grad_(), x_full.clone().requires_grad_()
        dy = _randn(2, 8, 8, seed=8)
        y, yd = col(x), dense_c(xd)  # full sequence, this rank's output columns
        torch.testing.assert_close(y, yd.chunk(tp, -1)[r], **FP32)
        y.backward(dy.chunk(tp, -1)[r])
        yd.backward(dy)
        torch.testing.assert_close(x.grad, xd.grad.chunk(tp, 1)[r], **FP32)  # reduce-scattered dX
        torch.testing.assert_close(col.weight.grad, dense_c.weight.grad.chunk(tp, 0)[r], **FP32)

        h_full = _randn(2, 8, 8, seed=9)
        h, hd = h_full.chunk(tp, -1)[r].clone().requires_grad_(), h_full.clone().requires_grad_()
        dz = _randn(2, 8, 6, seed=10)
        z, zd = row(h), dense_r(hd)  # this rank's sequence chunk
        torch.testing.assert_close(z, zd.chunk(tp, 1)[r], **FP32)
        z.backward(dz.chunk(tp, 1)[r])
        zd.backward(dz)
        torch.testing.assert_close(h.grad, hd.grad.chunk(tp, -1)[r], **FP32)
        torch.testing.assert_close(row.weight.grad, dense_r.weight.grad.chunk(tp, 1)[r], **FP32)
        # the replicated bias saw only this rank's tokens: summed over tp, it is the dense gradient
        torch.testing.assert_close(row.bias.grad, dense_r.bias.grad, **FP32)

        ln = nn.LayerNorm(6)
        nn.init.normal_(ln.weight)
        sp_ln = SequenceParallelNorm(copy.deepcopy(ln), ctx=ctx)
        u_full = _randn(2, 8, 6, seed=11)
        sp_ln(scatter_to_sequence_region(u_full, group=ctx.group("tp"))).pow(2).sum().backward()
        ln(u_full).pow(2).sum().backward()
        torch.testing.assert_close(sp_ln.module.weight.grad, ln.weight.grad, **FP32)
        torch.testing.assert_close(sp_ln.module.bias.grad, ln.bias.grad, **FP32)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "body", [_linear_body, _embedding_body, _sequence_parallel_body], ids=["linear", "embedding", "sequence_parallel"]
)
def test_layer_equals_dense(dist_pool, world_size, body):
    dist_pool.run(body, world_size=world_size, timeout=60)


# ---- a transformer block, trained ----------------------------------------------------------------
H, HEADS, B, T = 16, 4, 2, 8


class _Block(nn.Module):
    """Pre-norm attention + MLP block (TinyGPT's shape) with a fused qkv projection."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc, self.out = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.heads = HEADS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)  # [b, s, heads/tp * hd] each under TP
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _tp_block(dense: _Block, ctx: ParallelContext, sp: bool, stats: CommStats) -> _Block:
    tp = ctx.size("tp")
    block = copy.deepcopy(dense)
    opts = dict(ctx=ctx, sequence_parallel=sp, stats=stats)
    block.qkv = ColumnParallelLinear.from_dense(dense.qkv, fused_chunks=3, **opts)
    block.proj = RowParallelLinear.from_dense(dense.proj, **opts)
    block.fc = ColumnParallelLinear.from_dense(dense.fc, **opts)
    block.out = RowParallelLinear.from_dense(dense.out, **opts)
    if sp:
        block.ln1 = SequenceParallelNorm(block.ln1, ctx=ctx, stats=stats)
        block.ln2 = SequenceParallelNorm(block.ln2, ctx=ctx, stats=stats)
        (sync,) = share_sequence_parallel_grads(block)  # what tensor_parallelize does
        assert len(sync.params) == 6  # 2 LayerNorms (w, b) + 2 row biases
    block.heads = HEADS // tp
    return block


def _train_block_body(sp: bool) -> list[float]:
    with _tp_ctx() as ctx:
        tp, r = ctx.size("tp"), ctx.rank("tp")
        torch.manual_seed(0)
        dense = _Block()
        stats = CommStats()
        block = _tp_block(dense, ctx, sp, stats)
        # SGD, not Adam: the key bias has a mathematically zero gradient (softmax ignores a
        # per-row shift), and Adam's m / sqrt(v) would blow its rounding noise up to lr-sized steps.
        opt_d = torch.optim.SGD(dense.parameters(), lr=0.1, momentum=0.9)
        opt = torch.optim.SGD(block.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(10):
            x = _randn(B, T, H, seed=100 + step)
            stats.reset()  # this step's forward and backward
            loss_d = dense(x).pow(2).mean()
            if sp:  # each rank holds s/tp tokens: its share of the mean; the sum is the loss
                local = block(x.chunk(tp, 1)[r]).pow(2).sum() / x.numel()
                loss = local.detach().clone()
                dist.all_reduce(loss, group=ctx.group("tp"))
            else:
                local = loss = block(x).pow(2).mean()
            torch.testing.assert_close(loss, loss_d.detach(), **FP32)
            for o in (opt_d, opt):
                o.zero_grad()
            local.backward()
            loss_d.backward()
            if step == 0:
                _check_block_comm(stats, sp)
            opt_d.step()
            opt.step()
            losses.append(float(loss.detach()))
        expect = _tp_block(dense, ctx, sp, CommStats())
        for (name, p), q in zip(block.named_parameters(), expect.parameters()):
            torch.testing.assert_close(p, q, **FP32, msg=lambda m, name=name: f"{name}: {m}")
        return losses


def _check_block_comm(stats: CommStats, sp: bool) -> None:
    """CommStats payload per step = the formula of docs/reference.md, "Tensor parallel"."""
    act = B * T * H * 4  # one [b, s, h] fp32 activation
    if not sp:  # two Column/Row pairs: 2 all-reduces forward (Row), 2 backward (Column)
        assert stats.calls("all_reduce") == 4 and stats.bytes("all_reduce") == 4 * act
        assert stats.calls() == 4
    else:  # each all-reduce becomes an all-gather + a reduce-scatter of the same payload
        assert stats.calls("all_gather") == 4 and stats.bytes("all_gather") == 4 * act
        assert stats.calls("reduce_scatter") == 4 and stats.bytes("reduce_scatter") == 4 * act
        # + the replicated parameters used on sequence chunks, 2 LayerNorms (w, b) and 2 Row
        # biases: ONE coalesced all-reduce of their summed bytes per backward (was one per param)
        assert stats.calls("all_reduce") == 1 and stats.bytes("all_reduce") == 6 * H * 4


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_block_trains_like_dense_for_10_steps(dist_pool, world_size, sp):
    losses = dist_pool.run(_train_block_body, sp, world_size=world_size, timeout=120)
    assert all(rank == losses[0] for rank in losses)
    assert losses[0][-1] < losses[0][0]  # it did train


def _sp_grads_body() -> None:
    """[Note: one coalesced all-reduce per backward]: gradient accumulation over micro-batches,
    a registered parameter left unused (grad None, as dense), no node under no_grad."""
    with _tp_ctx() as ctx:
        tp, r = ctx.size("tp"), ctx.rank("tp")
        torch.manual_seed(5)
        dense = nn.ModuleDict({"a": nn.LayerNorm(6), "b": nn.LayerNorm(6), "unused": nn.LayerNorm(6), "row": nn.Linear(8, 6)})
        for ln in ("a", "b"):
            nn.init.normal_(dense[ln].weight)
            nn.init.normal_(dense[ln].bias)
        stats = CommStats()
        sync = SequenceParallelGrads(group=ctx.group("tp"), stats=stats)
        model = nn.ModuleDict(
            {k: SequenceParallelNorm(copy.deepcopy(dense[k]), ctx=ctx, grad_sync=sync) for k in ("a", "b", "unused")}
        )
        model["row"] = RowParallelLinear.from_dense(dense["row"], ctx=ctx, sequence_parallel=True, grad_sync=sync)
        assert [tuple(p.shape) for p in sync.params] == [(6,)] * 7  # from_dense's bias, not the discarded one

        def run(m, x, h):  # x: [b, s(/tp), 6] tokens, h: [b, s, 8(/tp)] the row layer's input
            return (m["b"](m["a"](x) + m["row"](h))).pow(2).sum()

        for step in range(2):  # two micro-batches: each backward one all-reduce, grads accumulate
            x_full, h_full = _randn(2, 8, 6, seed=20 + step), _randn(2, 8, 8, seed=30 + step)
            run(dense, x_full, h_full).backward()
            stats.reset()
            run(model, x_full.chunk(tp, 1)[r], h_full.chunk(tp, -1)[r]).backward()
            assert stats.calls() - stats.calls("reduce_scatter") == 1 and stats.calls("all_reduce") == 1
            assert stats.bytes("all_reduce") == 7 * 6 * 4  # the unused norm's zeros included
        for k in ("a", "b"):
            torch.testing.assert_close(model[k].module.weight.grad, dense[k].weight.grad, **FP32)
            torch.testing.assert_close(model[k].module.bias.grad, dense[k].bias.grad, **FP32)
        torch.testing.assert_close(model["row"].bias.grad, dense["row"].bias.grad, **FP32)
        assert model["unused"].module.weight.grad is None and dense["unused"].weight.grad is None

        with torch.no_grad():  # evaluation: the parameters themselves, no node
            stats.reset()
            out = model["a"](x_full.chunk(tp, 1)[r])
            assert out.grad_fn is None and sync._views is None and stats.calls("all_reduce") == 0


def test_sequence_parallel_grads_one_all_reduce_per_backward(dist_pool):
    dist_pool.run(_sp_grads_body, world_size=2, timeout=60)


def _reduce_inplace_body() -> None:
    """reduce_from_tp_region sums in place only where allowed; the public default copies."""
    with _tp_ctx() as ctx:
        g, tp = ctx.group("tp"), ctx.size("tp")
        w = torch.ones(3, 4, requires_grad=True)
        partial = F.linear(torch.ones(2, 4), w)  # a fresh non-leaf: summed in its own storage
        y = reduce_from_tp_region(partial, group=g, inplace=True)
        assert y.data_ptr() == partial.data_ptr() and torch.equal(y, torch.full((2, 3), 4.0 * tp))
        y.sum().backward()
        assert torch.equal(w.grad, torch.full((3, 4), 2.0))  # identity backward (the dense grad)
        keep = torch.ones(2, 3)
        assert reduce_from_tp_region(keep, group=g).data_ptr() != keep.data_ptr() and torch.equal(keep, torch.ones(2, 3))
        leaf = torch.ones(2, 3, requires_grad=True)  # autograd forbids writing it: copied
        assert reduce_from_tp_region(leaf, group=g, inplace=True).data_ptr() != leaf.data_ptr()
        base = torch.ones(4, 3)
        view = base[:2]
        torch.testing.assert_close(reduce_from_tp_region(view, group=g, inplace=True), torch.full((2, 3), float(tp)))
        assert torch.equal(base, torch.ones(4, 3))  # a view is copied: its base is untouched


def test_reduce_from_tp_region_inplace_only_where_allowed(dist_pool):
    dist_pool.run(_reduce_inplace_body, world_size=2, timeout=60)


# ---- tp = 1 and validation -----------------------------------------------------------------------
def _tp1_body() -> None:
    with ParallelContext.from_world(dp=dist.get_world_size(), tp=1) as ctx:
        dense = nn.Linear(6, 4)
        stats = CommStats()
        col = ColumnParallelLinear.from_dense(dense, ctx=ctx, gather_output=True, stats=stats)
        row = RowParallelLinear.from_dense(dense, ctx=ctx, stats=stats)
        x = _randn(3, 6, seed=1)
        with mock.patch.object(dist, "all_reduce", side_effect=AssertionError("communicated")):
            torch.testing.assert_close(col(x), dense(x), rtol=0, atol=0)
            row(x).sum().backward()
        assert stats.calls() == 0


def _bad_input_body() -> None:
    with _tp_ctx() as ctx:
        tp = ctx.size("tp")
        col = ColumnParallelLinear(12, 8, ctx=ctx)
        row = RowParallelLinear(8, 6, ctx=ctx, sequence_parallel=True)
        emb = VocabParallelEmbedding(10, 4, ctx=ctx)
        forbid = {name: mock.DEFAULT for name in ("all_reduce", "all_gather_single", "reduce_scatter_single")}
        with mock.patch.multiple(dist, **forbid) as patched:
            for p in patched.values():
                p.side_effect = AssertionError("communicated before validating")
            cases = [
                (lambda: ColumnParallelLinear(12, 4 * tp + 1, ctx=ctx), "out_features=.* not divisible"),
                (lambda: ColumnParallelLinear(12, 6 * tp, ctx=ctx, fused_chunks=3 * 4), "fused_chunks"),
                (lambda: RowParallelLinear(4 * tp + 1, 6, ctx=ctx), "in_features=.* not divisible"),
                (lambda: col(torch.randn(2, 11)), "last dimension 12"),
                (lambda: row(torch.randn(2, 4, 8)), r"last dimension \d+ \(in_features / tp"),
                (lambda: row(torch.randn(2, 3, 8 // tp)), "sequence length 3"),
                (lambda: emb(torch.randn(2, 4)), "integer tensor"),
                (lambda: scatter_to_sequence_region(torch.randn(2, 3, 4), group=ctx.group("tp")), "not divisible"),
            ]
            for fn, match in cases:
                with pytest.raises(ValueError, match=match):
                    fn()


def test_tp1_takes_the_local_path(dist_pool):
    dist_pool.run(_tp1_body, world_size=2, timeout=60)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bad_input_raises_before_any_collective(dist_pool, world_size):
    dist_pool.run(_bad_input_body, world_size=world_size, timeout=60)


def _overlap_body() -> list[str]:
    """[Note: overlapping the input-gradient all-reduce]: issue dX's all-reduce async, compute dW,
    then wait — recorded in order by wrapping torch.matmul and the layer's all_reduce."""
    from shardkit.parallel.tensor import layers

    events: list[str] = []
    real_matmul = torch.matmul

    def recording_matmul(a, b, **kwargs):
        events.append(f"matmul{tuple(a.shape)}x{tuple(b.shape)}")
        return real_matmul(a, b, **kwargs)

    real = layers.all_reduce

    def recording_all_reduce(tensor, **kwargs):
        events.append(f"all_reduce(async_op={kwargs.get('async_op')})")
        handle = real(tensor, **kwargs)

        class Recorded:
            def wait(self):
                events.append("wait")
                return handle.wait()

        return Recorded()

    with _tp_ctx() as ctx:
        col = ColumnParallelLinear(12, 8, ctx=ctx)
        x = _randn(5, 12, seed=1).requires_grad_()
        y = col(x)
        with mock.patch.object(layers, "all_reduce", recording_all_reduce), mock.patch.object(torch, "matmul", recording_matmul):
            y.backward(torch.ones_like(y))
    return events


def test_column_backward_overlaps_dx_all_reduce_with_dw(dist_pool):
    events = dist_pool.run(_overlap_body, world_size=2, timeout=60)[0]
    # dX = dY W ([5, 4] x [4, 12]); async all-reduce; dW = dYᵀ X ([4, 5] x [5, 12]); then wait
    assert events == ["matmul(5, 4)x(4, 12)", "all_reduce(async_op=True)", "matmul(4, 5)x(5, 12)", "wait"]
