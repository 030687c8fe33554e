"""Declarative TP plans: resolution and validation without processes, then TinyGPT at tp = 2 and 4
(gloo) trained against the dense model, and dense <-> TP state dicts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT, lm_loss
from shardkit.parallel.tensor import (
    Colwise,
    Heads,
    Rowwise,
    VocabParallel,
    VocabParallelHead,
    gather_state_dict,
    gpt_plan,
    plan_modules,
    shard_state_dict,
    tensor_parallelize,
    vocab_parallel_cross_entropy,
)
from tolerances import FP32

VOCAB = 59  # not divisible by 2 or 4: the vocabulary is padded and masked


def _model(tie: bool = True) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, d_model=32, n_layers=2, n_heads=4, seq_len=16, tie_embeddings=tie)


# ---- plans are data: no processes ----------------------------------------------------------------
def test_plan_tie_must_match_the_model():
    """A tied plan on an untied model (or the reverse) would silently train a different model."""
    with pytest.raises(ValueError, match="untied"):
        plan_modules(_model(tie=False), gpt_plan(tie_embeddings=True), 2)
    with pytest.raises(ValueError, match="tied_to=None"):
        plan_modules(_model(tie=True), gpt_plan(tie_embeddings=False), 2)
    assert plan_modules(_model(tie=False), gpt_plan(tie_embeddings=False), 2)


def test_gpt_plan_resolves_every_module_of_tinygpt():
    found = plan_modules(_model(), gpt_plan(), 4)
    assert sorted(found) == [
        "blocks.0.attn",
        "blocks.0.attn.proj",
        "blocks.0.attn.qkv",
        "blocks.0.mlp.fc",
        "blocks.0.mlp.proj",
        "blocks.1.attn",
        "blocks.1.attn.proj",
        "blocks.1.attn.qkv",
        "blocks.1.mlp.fc",
        "blocks.1.mlp.proj",
        "head",
        "tok_emb",
    ]
    assert found["blocks.1.mlp.fc"] == ("blocks.*.mlp.fc", Colwise())


@pytest.mark.parametrize(
    "plan,tp,match",
    [
        ({"blocks.*.attn.nope": Colwise()}, 2, "'blocks.\\*.attn.nope' names no module"),
        ({"blocks.*.attn": Heads()}, 8, "n_heads=4 is not divisible by the tp size 8"),
        ({"blocks.*.mlp.proj": Rowwise()}, 3, "in_features=128 is not divisible"),
        ({"blocks.*.attn.qkv": Colwise(fused_chunks=3)}, 64, "out_features=96 is not divisible by tp \\* fused_chunks"),
        ({"blocks.*.ln1": Colwise()}, 2, "needs an nn.Linear, got LayerNorm"),
        ({"head": VocabParallelHead(tied_to="tok_emb")}, 2, "tied_to='tok_emb' must name a module planned VocabParallel"),
        ({"pos_emb": VocabParallel(), "*": VocabParallel()}, 2, "matched by two TP plan patterns"),
        ({"blocks.*": Colwise()}, 2, "needs an nn.Linear, got Block"),  # * is one name component
    ],
)
def test_bad_plans_raise_naming_the_pattern_or_dimension(plan, tp, match):
    model = _model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        plan_modules(model, plan, tp)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---- TinyGPT over tp ------------------------------------------------------------------------------
def _tinygpt_body(tie: bool) -> list[float]:
    tp = dist.get_world_size()
    with ParallelContext.from_world(tp=tp) as ctx:
        dense = _model(tie)
        model = tensor_parallelize(copy.deepcopy(dense), ctx, gpt_plan(tie_embeddings=tie))
        if tie:
            assert model.head.weight is model.tok_emb.weight
        assert model.blocks[0].attn.n_heads == 4 // tp
        opt_d = torch.optim.SGD(dense.parameters(), lr=0.2, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        losses = []
        idx, y = torch.randint(VOCAB, (2, 16), generator=gen), torch.randint(VOCAB, (2, 16), generator=gen)
        for _ in range(10):  # one batch, memorized: the loss must fall
            loss_d = lm_loss(dense(idx), y)
            logits_shard = model(idx)
            assert logits_shard.shape == (2, 16, -(-VOCAB // tp))
            loss = vocab_parallel_cross_entropy(logits_shard, y, ctx=ctx, vocab_size=VOCAB)
            torch.testing.assert_close(loss, loss_d, **FP32)
            opt_d.zero_grad()
            opt.zero_grad()
            loss_d.backward()
            loss.backward()
            opt_d.step()
            opt.step()
            losses.append(float(loss.detach()))
        # the trained TP model is the trained dense model, sharded (and back)
        plan = gpt_plan(tie_embeddings=tie)
        sharded = shard_state_dict(dense.state_dict(), plan, ctx)
        got = model.state_dict()
        assert sorted(sharded) == sorted(got)
        for key, value in got.items():
            torch.testing.assert_close(value, sharded[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")
        vocab = {"tok_emb.weight": VOCAB, "head.weight": VOCAB}
        gathered = gather_state_dict(got, plan, ctx, vocab_sizes=vocab)
        for key, value in dense.state_dict().items():
            torch.testing.assert_close(gathered[key], value, **FP32, msg=lambda m, key=key: f"{key}: {m}")
        # a fresh TP model loads the dense checkpoint's shards and computes the dense logits' shard
        fresh = tensor_parallelize(_model(tie), ctx, plan)
        fresh.load_state_dict(sharded)
        idx = torch.randint(VOCAB, (2, 16), generator=gen)
        start = ctx.rank("tp") * logits_shard.shape[-1]
        full = dense(idx).detach()
        n = min(logits_shard.shape[-1], VOCAB - start)
        torch.testing.assert_close(fresh(idx)[..., :n], full[..., start : start + n], **FP32)
        return losses


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_tinygpt_with_gpt_plan_trains_like_dense(dist_pool, world_size, tie):
    losses = dist_pool.run(_tinygpt_body, tie, world_size=world_size, timeout=120)
    assert all(rank == losses[0] for rank in losses)
    assert losses[0][-1] < losses[0][0]


def test_untied_head_requires_linear_without_bias():
    model = _model(tie=False)
    model.head = nn.Linear(32, VOCAB, bias=True)
    with pytest.raises(ValueError, match="without bias"):
        plan_modules(model, {"head": VocabParallelHead()}, 2)


# ---- Hugging Face Llama, built from a tiny config -------------------------------------------------
def _llama_body() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.parallel.tensor import llama_plan

    tp = dist.get_world_size()
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4 if tp == 4 else 2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    with ParallelContext.from_world(tp=tp) as ctx:
        torch.manual_seed(0)
        dense = LlamaForCausalLM(cfg)
        model = tensor_parallelize(copy.deepcopy(dense), ctx, llama_plan())
        opt_d = torch.optim.SGD(dense.parameters(), lr=0.2)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        gen = torch.Generator().manual_seed(2)
        ids, y = torch.randint(VOCAB, (2, 12), generator=gen), torch.randint(VOCAB, (2, 12), generator=gen)
        for _ in range(3):
            loss_d = lm_loss(dense(ids).logits, y)
            loss = vocab_parallel_cross_entropy(model(ids).logits, y, ctx=ctx, vocab_size=VOCAB)
            torch.testing.assert_close(loss, loss_d, **FP32)
            for o in (opt_d, opt):
                o.zero_grad()
            loss_d.backward()
            loss.backward()
            opt_d.step()
            opt.step()
        vocab = {"model.embed_tokens.weight": VOCAB, "lm_head.weight": VOCAB}
        gathered = gather_state_dict(model.state_dict(), llama_plan(), ctx, vocab_sizes=vocab)
        for key, value in dense.state_dict().items():
            torch.testing.assert_close(gathered[key], value, **FP32, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_hf_llama_with_llama_plan_equals_dense(dist_pool, world_size):
    dist_pool.run(_llama_body, world_size=world_size, timeout=180)


# ---- gradient clipping over tp ----------------------------------------------------------------------
def _clip_body(backend: str) -> float:
    from shardkit.parallel.tensor import clip_grad_norm_tp_, is_tp_sharded

    tp = dist.get_world_size()
    with ParallelContext.from_world(tp=tp) as ctx:
        dense = _model()
        model = tensor_parallelize(copy.deepcopy(dense), ctx, gpt_plan())
        assert is_tp_sharded(model.blocks[0].attn.proj.weight) and not is_tp_sharded(model.blocks[0].attn.proj.bias)
        assert not is_tp_sharded(model.ln_f.weight) and is_tp_sharded(model.tok_emb.weight)
        idx, y = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(3)).unbind(0)
        lm_loss(dense(idx[None]), y[None]).backward()
        vocab_parallel_cross_entropy(model(idx[None]), y[None], ctx=ctx, vocab_size=VOCAB).backward()
        expect = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05)  # small: it clips
        norm = clip_grad_norm_tp_(model.parameters(), 0.05, ctx=ctx, backend=backend)
        torch.testing.assert_close(norm, expect, **FP32)
        dense_grads = {n: p.grad for n, p in dense.named_parameters()}
        sharded = shard_state_dict(dense_grads, gpt_plan(), ctx)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, sharded[name], **FP32, msg=lambda m, name=name: f"{name}: {m}")
        return float(norm)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_clip_grad_norm_tp_equals_dense_clip(dist_pool, world_size, backend):
    norms = dist_pool.run(_clip_body, backend, world_size=world_size, timeout=120)
    assert len(set(norms)) == 1


# ---- tp x dp: TP shards inside DataParallel -------------------------------------------------------
def _tp_dp_body() -> list[float]:
    from shardkit.parallel import DataParallel

    with ParallelContext.from_world(dp=2, tp=2) as ctx:
        dense = _model()
        model = DataParallel(tensor_parallelize(copy.deepcopy(dense), ctx, gpt_plan()), ctx)
        opt_d = torch.optim.SGD(dense.parameters(), lr=0.2, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        gen = torch.Generator().manual_seed(4)
        idx, y = torch.randint(VOCAB, (4, 16), generator=gen), torch.randint(VOCAB, (4, 16), generator=gen)
        rows = slice(2 * ctx.rank("dp"), 2 * ctx.rank("dp") + 2)  # this dp rank's half of the batch
        losses = []
        for _ in range(5):
            loss_d = lm_loss(dense(idx), y)
            loss = vocab_parallel_cross_entropy(model(idx[rows]), y[rows], ctx=ctx, vocab_size=VOCAB)
            for o in (opt_d, opt):
                o.zero_grad()
            loss_d.backward()
            loss.backward()
            opt_d.step()
            opt.step()
            losses.append(float(loss_d.detach()))
        sharded = shard_state_dict(dense.state_dict(), gpt_plan(), ctx)
        for key, value in model.module.state_dict().items():
            torch.testing.assert_close(value, sharded[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")
        return losses


def test_tp2_x_dp2_trains_like_dense(dist_pool):
    """tp = 2 inside dp = 2 (world 4): DataParallel averages each TP shard's grads over its dp peers."""
    losses = dist_pool.run(_tp_dp_body, world_size=4, timeout=120)
    assert losses[0][-1] < losses[0][0]
