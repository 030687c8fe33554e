"""Hugging Face GPT-2 and Llama (GQA, rotary) under context parallelism equal the dense model.

The cp plan is applied to a copy of the model; each cp rank runs its tokens of the batch, the
loss is :class:`SequenceShardedLoss`'s, and the gradients summed over cp must equal the dense
model's (same seed, full sequences), as must the gathered logits. A right-padded batch (targets
``ignore_index`` on the padding) weighs the valid tokens over the whole replica.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.comm import ParallelContext
from shardkit.parallel import parallelize
from shardkit.parallel.context import (
    SequenceShardedLoss,
    context_parallelize,
    gather_sequence,
    hf_gpt2_cp_plan,
    llama_cp_plan,
    shard_sequence,
)
from tolerances import FP32

transformers = pytest.importorskip("transformers")

VOCAB, T = 59, 16


def _gpt2(attn="sdpa"):
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama(kv_heads=2):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=kv_heads, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _token_sum(logits, targets):
    t = targets.flatten()
    return F.cross_entropy(logits.flatten(0, -2).float(), t, reduction="sum"), (t != -100).sum()


def _hf_body(family: str, mode: str, padded: bool):
    dense = _gpt2() if family == "gpt2" else _llama()
    model = copy.deepcopy(dense)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (2, T), generator=g)
    targets = torch.randint(VOCAB, (2, T), generator=g)
    if padded:  # row 1 right-padded after 5 tokens: its padding predicts nothing
        targets[1, 5:] = -100
    logits_d = dense(input_ids=ids, use_cache=False).logits
    F.cross_entropy(logits_d.flatten(0, 1), targets.flatten()).backward()
    with ParallelContext.from_world(cp=dist.get_world_size()) as ctx:
        plan = hf_gpt2_cp_plan() if family == "gpt2" else llama_cp_plan()
        context_parallelize(model, ctx, plan, mode=mode)
        split = SequenceShardedLoss(ctx, "zigzag", _token_sum)
        x, y = split.shard(ids, targets)
        logits = model(input_ids=x, use_cache=False).logits
        for_backward, loss = split(logits, y)
        for_backward.backward()
        torch.testing.assert_close(gather_sequence(logits.detach(), ctx), logits_d.detach(), **FP32)
        ref = F.cross_entropy(logits_d.detach().flatten(0, 1), targets.flatten())
        torch.testing.assert_close(loss, ref, **FP32)
        cp = ctx.size("cp")
        for (name, p), pd in zip(model.named_parameters(), dense.parameters(), strict=True):
            g = p.grad / cp  # for_backward carries cp x the share (the dp_cp average divides it back)
            dist.all_reduce(g, group=ctx.group("cp"))
            torch.testing.assert_close(g, pd.grad, **FP32, msg=lambda m, name=name: f"{name}: {m}")
    return True


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_hf_gpt2_under_cp_equals_dense(dist_pool, mode):
    assert all(dist_pool.run(_hf_body, "gpt2", mode, False, world_size=2, timeout=120))


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_hf_llama_gqa_rotary_under_cp_equals_dense(dist_pool, mode):
    """8 query heads over 2 kv heads, rotary positions from this rank's token positions."""
    assert all(dist_pool.run(_hf_body, "llama", mode, False, world_size=2, timeout=120))


def test_padded_batch_weighs_tokens_over_the_replica(dist_pool):
    """Row 1 has 5 valid targets (zigzag chunks of 4: four on cp rank 0, one on rank 1, so the
    ranks hold 12 and 9 valid tokens): the loss is the mean over the replica's 21, not a mean
    of the two ranks' means."""
    assert all(dist_pool.run(_hf_body, "llama", "ring", True, world_size=2, timeout=120))


def _eager_body():
    with ParallelContext.from_world(cp=2) as ctx:
        model = _gpt2("eager")
        context_parallelize(model, ctx, hf_gpt2_cp_plan())
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            model(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)
        mask = torch.ones(1, 8, dtype=torch.long)
        mask[0, :2] = 0
        sdpa = _gpt2()
        context_parallelize(sdpa, ctx, hf_gpt2_cp_plan())
        with pytest.raises(ValueError, match="pass no attention_mask"):
            sdpa(input_ids=torch.zeros(1, 8, dtype=torch.long), attention_mask=mask, use_cache=False)
        # an all-ones mask too: the rank whose shard has padding would refuse while this one attends
        with pytest.raises(ValueError, match="pass no attention_mask"):
            sdpa(input_ids=torch.zeros(1, 8, dtype=torch.long), attention_mask=torch.ones_like(mask), use_cache=False)
    return True


def test_eager_attention_and_padding_masks_are_refused(dist_pool):
    """Eager attention never calls SDPA (it would attend over the local tokens only: silently
    wrong), and an attention_mask is refused on every rank alike, all-ones or not (a mask with
    padding on one rank's shard only would send that rank's peers into the ring alone)."""
    assert all(dist_pool.run(_eager_body, world_size=2))


def _autocast_body(mode: str):
    """Llama's rotary step leaves q, k in fp32 and v in bf16 under autocast: the plan casts them
    as SDPA's own autocast would, so the cp logits follow the unparallelized bf16 ones."""
    dense = _llama()
    model = copy.deepcopy(dense)
    ids = torch.randint(VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = dense(input_ids=ids, use_cache=False).logits.float()
    with ParallelContext.from_world(cp=dist.get_world_size()) as ctx:
        context_parallelize(model, ctx, llama_cp_plan(), mode=mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            part = model(input_ids=shard_sequence(ids, ctx), use_cache=False).logits.float()
        torch.testing.assert_close(gather_sequence(part, ctx), ref, atol=5e-2, rtol=5e-2)
    return True


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_llama_under_bf16_autocast(dist_pool, mode):
    assert all(dist_pool.run(_autocast_body, mode, world_size=2, timeout=120))


def _edge_body():
    with ParallelContext.from_world(cp=2) as ctx:
        model = _llama()
        context_parallelize(model, ctx, llama_cp_plan(), layout="contiguous")
        with pytest.raises(ValueError, match="one token per cp rank"):
            model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=False)  # S = 2 over cp 2
        with pytest.raises(ValueError, match="pass position_ids of the local tokens"):
            model(input_ids=torch.zeros(1, 4, dtype=torch.long), position_ids=torch.arange(4, 8)[None], use_cache=False)
        gpt2 = _gpt2()  # 32 positions
        context_parallelize(gpt2, ctx, hf_gpt2_cp_plan())
        with pytest.raises(ValueError, match="the full sequence has 64 tokens"):
            gpt2(input_ids=torch.zeros(1, 32, dtype=torch.long), use_cache=False)
        # a second plan would map the positions twice (the error would blame a KV cache)
        with pytest.raises(ValueError, match="a cp plan is already applied to this model"):
            context_parallelize(gpt2, ctx, hf_gpt2_cp_plan(), mode="ulysses")
        with pytest.raises(ValueError, match="a cp plan is already applied to this model"):
            parallelize(gpt2, ctx, dp="ddp", cp={"plan": hf_gpt2_cp_plan(), "mode": "ring"})
        fresh = _gpt2()
        for h in context_parallelize(fresh, ctx, hf_gpt2_cp_plan()):  # undone, it may be applied again
            h.remove()
        context_parallelize(fresh, ctx, hf_gpt2_cp_plan())
    return True


def test_edge_cases_are_named(dist_pool):
    """One token per rank (HF drops the causal flag), sharded position_ids, a sequence longer
    than the position table, a plan applied twice: each a ValueError saying what to do, on every
    rank."""
    assert all(dist_pool.run(_edge_body, world_size=2, timeout=120))
