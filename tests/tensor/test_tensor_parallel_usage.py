"""Tensor parallelism used the way models use it, against dense torch.

13. dropout under TP: masks differ across tp ranks where the activations are sharded (heads, MLP
    features, sequence shards) and agree where they are replicated; together they are one dense
    mask (the dense model with those masks gives the TP gradients), and activation checkpointing
    replays them.
14. vocab-parallel CE whose logits have another consumer (a z-penalty): dense gradients with
    both backends; in-place only on request, and then an error instead of a wrong gradient.
15. vocab-parallel CE on non-contiguous logits (HF's ``logits[:, :-1, :]``).
16. out-of-range ids (VocabParallelEmbedding) and targets (vocab_parallel_cross_entropy) raise
    IndexError on every tp rank, as the dense ops do; unchecked ids touch no pad row.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.parallel.pipeline import checkpoint_blocks
from shardkit.parallel.tensor import (
    Colwise,
    ColumnParallelLinear,
    Heads,
    Rowwise,
    ScatterSequence,
    SequenceParallel,
    VocabParallelEmbedding,
    tensor_parallelize,
    vocab_parallel_cross_entropy,
)
from tolerances import FP32

BACKENDS = ["triton", "torch"]  # "triton" on CPU tensors = Triton's interpreter


def _tp_ctx() -> ParallelContext:
    return ParallelContext.from_world(tp=dist.get_world_size())


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Every tp rank's ``t`` concatenated along ``dim`` in rank order (no autograd)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


# ---- 13. dropout: a mask per rank on shards, one mask on replicas, replayed by checkpointing ------
D, HEADS, S, B, P = 16, 4, 8, 2, 0.3


class _Attention(nn.Module):
    """Eager attention (HF's eager path): dropout on the probabilities and on the output."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads = HEADS
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.attn_drop, self.resid_drop = nn.Dropout(P), nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]  # under sequence parallelism x holds t / tp tokens, qkv all t
        q, k, v = qkv.view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        probs = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        y = (self.attn_drop(probs) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.proj(y))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.hidden_drop, self.drop = nn.Dropout(P), nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.hidden_drop(F.gelu(self.fc(x)))))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), _Attention(), nn.LayerNorm(D), _MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _FixedMask(nn.Module):
    """Dropout with a given mask (True = dropped), for the dense reference."""

    def __init__(self, dropped: torch.Tensor) -> None:
        super().__init__()
        self.dropped = dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(self.dropped, 0.0) / (1 - P)


def _plan(sp: bool) -> dict:
    plan = {
        "blocks.*.attn": Heads("n_heads"),
        "blocks.*.attn.qkv": Colwise(fused_chunks=3, sequence_parallel=sp),
        "blocks.*.attn.proj": Rowwise(sequence_parallel=sp),
        "blocks.*.mlp.fc": Colwise(sequence_parallel=sp),
        "blocks.*.mlp.proj": Rowwise(sequence_parallel=sp),
    }
    if sp:
        plan.update({"blocks.0": ScatterSequence(), "blocks.*.ln1": SequenceParallel(), "blocks.*.ln2": SequenceParallel()})
    return plan


def _record_masks(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Every dropout's mask (True = dropped) per call, forward and recomputation alike."""
    masks: dict[str, list[torch.Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Dropout):
            masks[name] = []
            m.register_forward_hook(lambda m, args, out, n=name: masks[n].append((out == 0) & (args[0] != 0)))
    return masks


# where each dropout's activation lives: sharded along a dim (head, feature, sequence) or replicated
def _layout(name: str, sp: bool) -> int | None:
    if name.endswith("attn_drop"):
        return 1  # [b, heads/tp, s, s]
    if name.endswith("hidden_drop"):
        return -1  # [b, s, 4d/tp]
    return 1 if sp else None  # after a row-parallel layer: sequence shards, or replicated


def _tp_run(dense: nn.Module, ctx: ParallelContext, sp: bool, checkpointed: bool) -> tuple:
    model = tensor_parallelize(copy.deepcopy(dense), ctx, _plan(sp))
    if checkpointed:
        checkpoint_blocks(model.blocks)
    masks = _record_masks(model)
    x = _randn(B, S, D, seed=1).requires_grad_()
    w = _randn(B, S, D, seed=2)
    torch.manual_seed(1234)  # the same on every rank, as a training loop seeds dropout
    out = model(x)
    r, tp = ctx.rank("tp"), ctx.size("tp")
    loss = (out * (w.chunk(tp, 1)[r] if sp else w)).sum()  # SP: this rank's tokens of the dense loss
    forward_masks = {n: list(ms) for n, ms in masks.items()}
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), x.grad, grads, forward_masks, masks


def _dropout_body(sp: bool) -> None:
    with _tp_ctx() as ctx:
        torch.manual_seed(0)
        dense = _Model()
        loss, x_grad, grads, masks, _ = _tp_run(dense, ctx, sp, checkpointed=False)
        full_masks = {}
        for name, (mask,) in masks.items():
            everyone = _gather(mask.unsqueeze(0), 0)
            dim = _layout(name, sp)
            if dim is None:  # replicated activation: the ranks must drop the same elements
                assert all(torch.equal(m, mask) for m in everyone), f"{name}: replicas got different masks"
                full_masks[name] = mask
            else:  # this rank's shard: its own mask (same shape on every rank, so compare them)
                for i in range(1, len(everyone)):
                    assert not torch.equal(everyone[i], everyone[0]), f"{name}: tp ranks 0 and {i} drew the same mask"
                full_masks[name] = torch.cat(list(everyone), dim)
            assert 0.15 < full_masks[name].float().mean() < 0.45, name  # dropping about P, not all or none

        # the dense model with the gathered masks computes the TP model's loss and gradients
        ref = copy.deepcopy(dense)
        for name, mask in full_masks.items():
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, _FixedMask(mask))
        xd = _randn(B, S, D, seed=1).requires_grad_()
        ref_loss = (ref(xd) * _randn(B, S, D, seed=2)).sum()
        ref_loss.backward()
        total = loss.clone()
        if sp:
            dist.all_reduce(total)  # each rank held its tokens' part of the loss
        torch.testing.assert_close(total, ref_loss.detach(), **FP32)
        torch.testing.assert_close(x_grad, xd.grad, **FP32)
        for name in ("blocks.0.ln1.weight", "blocks.1.ln2.bias", "blocks.1.attn.proj.bias"):
            torch.testing.assert_close(grads[name], dict(ref.named_parameters())[name].grad, **FP32, msg=name)

        # activation checkpointing: the forward draws the same masks and the recomputation replays them
        loss2, x_grad2, grads2, masks2, all_masks2 = _tp_run(dense, ctx, sp, checkpointed=True)
        for name, (mask,) in masks.items():
            # forward, then the recomputation's draw (not seen for a block's last dropout: the
            # checkpoint stops recomputing once that op saved its mask, before the hook runs)
            calls = all_masks2[name]
            assert len(calls) == 2 or (len(calls) == 1 and name.endswith("mlp.drop")), (name, len(calls))
            assert all(torch.equal(m, mask) for m in calls), name
        assert torch.equal(loss2, loss) and torch.equal(x_grad2, x_grad)
        for name, g in grads.items():
            assert torch.equal(grads2[name], g), name


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_dropout_masks_differ_on_shards_agree_on_replicas_and_replay_under_checkpointing(dist_pool, world_size, sp):
    dist_pool.run(_dropout_body, sp, world_size=world_size, timeout=120)


# ---- 14 and 15. vocab-parallel CE: another consumer of the logits; non-contiguous logits ---------
V, H = 64, 16


def _ce_setup(ctx: ParallelContext, seq: int = 6) -> tuple:
    torch.manual_seed(0)
    dense_head = nn.Linear(H, V, bias=False)
    head = ColumnParallelLinear.from_dense(dense_head, ctx=ctx)
    h = _randn(2, seq, H, seed=3)
    target = torch.randint(0, V, (2, seq), generator=torch.Generator().manual_seed(4))
    return dense_head, head, h, target


def _penalty(logits: torch.Tensor) -> torch.Tensor:
    """A z-penalty on the logits a rank holds: a second consumer of the logits."""
    return 1e-3 * logits.logsumexp(-1).pow(2).mean()


def _other_consumer_body(backend: str) -> None:
    with _tp_ctx() as ctx:
        r, tp = ctx.rank("tp"), ctx.size("tp")
        dense_head, head, h, target = _ce_setup(ctx)
        width = V // tp
        # dense reference: CE of the full logits + every rank's penalty of its columns
        hd = h.clone().requires_grad_()
        full = dense_head(hd)
        ref = F.cross_entropy(full.flatten(0, 1), target.flatten())
        ref_total = ref + sum(_penalty(full[..., i * width : (i + 1) * width]) for i in range(tp))
        ref_total.backward()

        x = h.clone().requires_grad_()
        logits = head(x)
        before = logits.detach().clone()
        # the penalty first: autograd runs the later CE node's backward before the penalty's,
        # which then reads the logits it saved
        penalty = _penalty(logits)
        ce = vocab_parallel_cross_entropy(logits, target, ctx=ctx, backend=backend)
        (ce + penalty).backward()
        torch.testing.assert_close(ce, ref.detach(), **FP32)
        torch.testing.assert_close(head.weight.grad, dense_head.weight.grad.chunk(tp, 0)[r], **FP32)
        torch.testing.assert_close(x.grad, hd.grad, **FP32)
        assert torch.equal(logits.detach(), before)  # the logits were not overwritten

        # in place on request: right when the CE is the only consumer...
        head.weight.grad = None
        only = head(h)
        vocab_parallel_cross_entropy(only, target, ctx=ctx, backend=backend, inplace_backward=True).backward()
        dense_head.weight.grad = None
        F.cross_entropy(dense_head(h).flatten(0, 1), target.flatten()).backward()
        torch.testing.assert_close(head.weight.grad, dense_head.weight.grad.chunk(tp, 0)[r], **FP32)
        # ...and an autograd error, not a wrong gradient, when it was not
        logits = head(h)
        penalty = _penalty(logits)
        ce = vocab_parallel_cross_entropy(logits, target, ctx=ctx, backend=backend, inplace_backward=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (ce + penalty).backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_ce_gradient_is_right_when_the_logits_have_another_consumer(dist_pool, world_size, backend):
    dist_pool.run(_other_consumer_body, backend, world_size=world_size, timeout=120)


def _shifted_logits_body(backend: str) -> None:
    with _tp_ctx() as ctx:
        r, tp = ctx.rank("tp"), ctx.size("tp")
        dense_head, head, h, ids = _ce_setup(ctx, seq=7)
        hd = h.clone().requires_grad_()
        full = dense_head(hd)
        ref = F.cross_entropy(full[:, :-1, :].flatten(0, 1), ids[:, 1:].flatten())  # HF's causal-LM shift
        ref.backward()
        for inplace in (False, True):
            head.weight.grad = None
            x = h.clone().requires_grad_()
            logits = head(x)
            shifted = logits[:, :-1, :]  # non-contiguous: [2, 6, Vs] with the row strides of [2, 7, Vs]
            assert not shifted.is_contiguous()
            loss = vocab_parallel_cross_entropy(shifted, ids[:, 1:], ctx=ctx, backend=backend, inplace_backward=inplace)
            loss.backward()
            torch.testing.assert_close(loss, ref.detach(), **FP32)
            torch.testing.assert_close(head.weight.grad, dense_head.weight.grad.chunk(tp, 0)[r], **FP32)
            torch.testing.assert_close(x.grad, hd.grad, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_ce_takes_non_contiguous_logits(dist_pool, backend):
    dist_pool.run(_shifted_logits_body, backend, world_size=2, timeout=120)


# ---- 16. out-of-range ids and targets: IndexError on every rank; pad rows get no gradient --------
VOCAB = 7  # tp 2: 4 + 3 rows (one pad row), tp 4: 2 + 2 + 2 + 1 (one pad row)


def _bad_ids_body() -> None:
    with _tp_ctx() as ctx:
        r, tp = ctx.rank("tp"), ctx.size("tp")
        torch.manual_seed(5)
        dense = nn.Embedding(VOCAB, 6, padding_idx=2)
        good = torch.tensor([[0, 2, 6, 4], [5, 1, 3, 2]])
        for bad_id in (VOCAB, -1, 100):  # VOCAB: the last rank's pad row
            bad = good.clone()
            bad[1, 2] = bad_id
            with pytest.raises(IndexError):  # the dense reference
                dense(bad)
            for sp in (False, True):
                emb = VocabParallelEmbedding.from_dense(dense, ctx=ctx, sequence_parallel=sp)
                with pytest.raises(IndexError, match=rf"ids must be in \[0, {VOCAB}\)"):
                    emb(bad)
                # only rank 0's ids are bad (a broken loader): every rank raises, none waits
                with pytest.raises(IndexError, match="ids must be in"):
                    emb(bad if r == 0 else good)

        # unchecked: a bad id gives a zero vector and no gradient; pad rows and padding_idx get none
        bad = good.clone()
        bad[0, 1], bad[1, 3] = VOCAB, -3
        emb = VocabParallelEmbedding.from_dense(dense, ctx=ctx, check_ids=False)
        dy = _randn(2, 4, 6, seed=6)
        y = emb(bad)
        y.backward(dy)
        valid = (bad >= 0) & (bad < VOCAB)
        yd = dense(bad.clamp(0, VOCAB - 1)) * valid.unsqueeze(-1)
        yd.backward(dy)
        torch.testing.assert_close(y, yd, **FP32)
        per = -(-VOCAB // tp)
        expect = torch.zeros(per, 6)
        rows = dense.weight.grad[r * per : (r + 1) * per]
        expect[: rows.shape[0]] = rows
        torch.testing.assert_close(emb.weight.grad, expect, **FP32)
        assert torch.all(dense.weight.grad[2] == 0)  # padding_idx: no gradient, as nn.Embedding


def _bad_targets_body() -> None:
    with _tp_ctx() as ctx:
        r, tp = ctx.rank("tp"), ctx.size("tp")
        width = -(-VOCAB // tp)
        full = _randn(2, 4, VOCAB, seed=7)
        padded = torch.cat([full, torch.zeros(2, 4, tp * width - VOCAB)], -1)
        shard = padded[..., r * width : (r + 1) * width]
        good = torch.tensor([[0, 6, 3, -100], [5, 1, 2, 4]])  # -100: ignore_index, allowed
        for bad_target in (VOCAB, -1, 50):
            bad = good.clone()
            bad[0, 2] = bad_target
            with pytest.raises(IndexError):  # the dense reference
                F.cross_entropy(full.flatten(0, 1), bad.flatten())
            with pytest.raises(IndexError, match=rf"targets outside \[0, {VOCAB}\)"):
                vocab_parallel_cross_entropy(shard, bad, ctx=ctx, vocab_size=VOCAB, backend="torch")
            with pytest.raises(IndexError, match="targets outside"):  # only rank 0's are bad: all raise
                vocab_parallel_cross_entropy(shard, bad if r == 0 else good, ctx=ctx, vocab_size=VOCAB, backend="torch")
            # unchecked: no error (and a finite, meaningless loss)
            vocab_parallel_cross_entropy(shard, bad, ctx=ctx, vocab_size=VOCAB, backend="torch", check_targets=False)
        # ignore_index targets stay allowed (out of range or not) and give the dense loss
        for ignore_index, target in ((-100, good), (3, good.masked_fill(good == -100, 3))):
            loss = vocab_parallel_cross_entropy(
                shard, target, ctx=ctx, vocab_size=VOCAB, ignore_index=ignore_index, backend="torch"
            )
            ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=ignore_index)
            torch.testing.assert_close(loss, ref, **FP32)


@pytest.mark.parametrize("world_size", [2, 4])
def test_out_of_range_ids_and_targets_raise_on_every_tp_rank_and_pad_rows_get_no_gradient(dist_pool, world_size):
    dist_pool.run(_bad_ids_body, world_size=world_size, timeout=120)
    dist_pool.run(_bad_targets_body, world_size=world_size, timeout=120)
