"""Hugging Face GPT-2 and Llama (built from tiny configs, no download) under ``hf_gpt2_plan`` /
``llama_plan`` at tp = 2 (gloo) against the dense single-process model: logits, one step's
gradients, several optimizer steps; plan validation without processes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from shardkit.comm import ParallelContext
from shardkit.models import lm_loss
from shardkit.parallel.tensor import (
    Colwise,
    Rowwise,
    gather_state_dict,
    hf_gpt2_plan,
    llama_plan,
    plan_modules,
    shard_state_dict,
    tensor_parallelize,
    vocab_parallel_cross_entropy,
)
from tolerances import FP32

transformers = pytest.importorskip("transformers")

VOCAB = 59  # not divisible by tp: the vocabulary is padded and masked


def _gpt2(tie: bool = True):
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=VOCAB, tie_word_embeddings=tie,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama(kv_heads: int):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=kv_heads, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


# ---- plans are data: no processes ----------------------------------------------------------------
def test_hf_gpt2_plan_resolves_and_reads_tying_from_config():
    found = plan_modules(_gpt2(), hf_gpt2_plan(), 2)
    assert found["transformer.h.1.attn.c_attn"][1] == Colwise(fused_chunks=3, transposed=True)
    assert found["transformer.h.0.mlp.c_proj"][1] == Rowwise(transposed=True)
    assert hf_gpt2_plan(_gpt2(tie=True))["lm_head"].tied_to == "transformer.wte"
    assert hf_gpt2_plan(_gpt2(tie=False))["lm_head"].tied_to is None


def test_conv1d_without_transposed_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="needs an nn.Linear, got Conv1D .*transposed=True"):
        plan_modules(_gpt2(), {"transformer.h.*.mlp.c_fc": Colwise()}, 2)
    plan = {"transformer.h.*.attn.c_attn": hf_gpt2_plan()["transformer.h.*.attn.c_attn"]}
    with pytest.raises(ValueError, match="out_features=192 is not divisible by tp \\* fused_chunks = 5 \\* 3"):
        plan_modules(_gpt2(), plan, 5)  # c_attn: [64, 3 * 64], read from the transposed weight


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_kv_heads_not_divisible_by_tp_names_them(tp):
    model = _llama(kv_heads=2)  # 8 query heads, 2 key/value heads: fine at tp 2, not at 4
    if tp == 2:
        plan_modules(model, llama_plan(model), tp)
        return
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by the tp size 4"):
        plan_modules(model, llama_plan(model), tp)


# ---- tp = 2 against the dense model -------------------------------------------------------------
def _check_equal_to_dense(dense, plan_fn, lr: float, steps: int) -> list[float]:
    """Logits, one step's grads (vs slices written out from the dense grads), ``steps`` SGD steps."""
    tp = dist.get_world_size()
    with ParallelContext.from_world(tp=tp) as ctx:
        r = ctx.rank("tp")
        model = tensor_parallelize(copy.deepcopy(dense), ctx, plan_fn(dense))
        plan = plan_fn(dense)
        gen = torch.Generator().manual_seed(3)
        ids, y = torch.randint(VOCAB, (2, 12), generator=gen), torch.randint(VOCAB, (2, 12), generator=gen)
        vs = -(-VOCAB // tp)
        n = min(vs, VOCAB - r * vs)

        logits_d, logits = dense(ids).logits, model(ids).logits
        assert logits.shape == (2, 12, vs)
        torch.testing.assert_close(logits[..., :n], logits_d[..., r * vs : r * vs + n], **FP32)
        lm_loss(logits_d, y).backward()
        vocab_parallel_cross_entropy(logits, y, ctx=ctx, vocab_size=VOCAB).backward()
        grads_d = {k: p.grad for k, p in dense.named_parameters()}
        got = {k: p.grad for k, p in model.named_parameters()}
        expect = shard_state_dict(grads_d, plan, ctx)
        assert sorted(got) == sorted(k for k in expect if k in got)
        for key, g in got.items():
            torch.testing.assert_close(g, expect[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")

        # SGD, not Adam: some gradients are mathematically ~0 (GPT-2's key bias: softmax ignores
        # a per-row shift), and Adam's m / sqrt(v) blows their rounding noise up to lr-sized steps.
        opt_d = torch.optim.SGD(dense.parameters(), lr=lr, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        losses = []
        for step in range(steps):
            if step:
                for o in (opt_d, opt):
                    o.zero_grad()
                loss_d = lm_loss(dense(ids).logits, y)
                loss = vocab_parallel_cross_entropy(model(ids).logits, y, ctx=ctx, vocab_size=VOCAB)
                torch.testing.assert_close(loss, loss_d, **FP32)
                loss_d.backward()
                loss.backward()
                losses.append(float(loss.detach()))
            opt_d.step()
            opt.step()
        vocab = {k: VOCAB for k in dense.state_dict() if "wte" in k or "embed_tokens" in k or "lm_head" in k}
        gathered = gather_state_dict(model.state_dict(), plan, ctx, vocab_sizes=vocab)
        for key, value in dense.state_dict().items():  # back in the HF layout (Conv1D [in, out])
            torch.testing.assert_close(gathered[key], value, **FP32, msg=lambda m, key=key: f"{key}: {m}")
        return losses


def _gpt2_body(tie: bool) -> list[float]:
    tp, r = dist.get_world_size(), dist.get_rank()
    dense = _gpt2(tie)
    with ParallelContext.from_world(tp=tp) as ctx:
        # The Conv1D transposition written out, independently of shard_state_dict: rank r's c_fc
        # keeps columns [r o/tp, (r+1) o/tp) of the [in, out] weight, as rows of its [out/tp, in];
        # a row-parallel c_proj keeps rows [r i/tp, (r+1) i/tp) of its [in, out] weight.
        probe = tensor_parallelize(copy.deepcopy(dense), ctx, hf_gpt2_plan(dense))
        h0 = probe.transformer.h[0]
        assert torch.equal(h0.mlp.c_fc.weight, dense.transformer.h[0].mlp.c_fc.weight.detach().chunk(tp, 1)[r].t())
        assert torch.equal(h0.attn.c_proj.weight, dense.transformer.h[0].attn.c_proj.weight.detach().chunk(tp, 0)[r].t())
        attn = h0.attn
        assert (attn.num_heads, attn.split_size, attn.embed_dim, attn.head_dim) == (4 // tp, 64 // tp, 64 // tp, 16)
        assert (probe.lm_head.weight is probe.transformer.wte.weight) == tie
    return _check_equal_to_dense(dense, hf_gpt2_plan, lr=0.1, steps=4)


def _llama_body() -> list[float]:
    return _check_equal_to_dense(_llama(kv_heads=2), llama_plan, lr=0.1, steps=4)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hf_gpt2_tp2_equals_dense(dist_pool, tie):
    losses = dist_pool.run(_gpt2_body, tie, world_size=2, timeout=180)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]


def test_hf_llama_gqa_tp2_equals_dense(dist_pool):
    """8 query heads over 2 key/value heads (groups of 4): rank r keeps 4 query heads, 1 kv head."""
    losses = dist_pool.run(_llama_body, world_size=2, timeout=180)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]
