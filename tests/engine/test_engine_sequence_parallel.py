"""The DeepSpeed-config engine's ``sequence_parallel_size``: a DeepSpeed loop trains with each
sequence split over cp ranks, and equals the one-process model on the whole sequences.

The script is unchanged: ``engine(input_ids=x, labels=x).loss`` (HF GPT-2) or
``lm_loss(engine(x), y)`` (TinyGPT), every cp rank given the replica's whole batch. References
are plain torch in one process (HF's own ``labels=`` loss, SGD + momentum, clipping).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardkit.comm import ParallelContext
from distributed import forbid_collectives
from tolerances import FP32
from engine_cases import GAS, LR, MICRO, SEQ, STEPS, VOCAB, dense_gpt2_run, gpt2_batch, tp_config

transformers = pytest.importorskip("transformers")


def _gpt2_sdpa(seed: int = 0):
    """engine_cases' tiny GPT-2 (the same weights for the same seed), with SDPA attention: the
    cp plan routes SDPA calls over the shards (eager attention is refused)."""
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def _sp_config(stage: int, cp: int, mode: str) -> dict:
    return tp_config(stage, 1) | {"sequence_parallel_size": cp, "context_parallel": {"mode": mode}}


def _hf_body(stage: int, mode: str) -> list[float]:
    import shardkit

    cp = dist.get_world_size()
    with ParallelContext.from_world(cp=cp) as ctx:
        engine, *_ = shardkit.initialize(model=_gpt2_sdpa(), config=_sp_config(stage, cp, mode), ctx=ctx)
        assert engine.ctx.sizes == {"pp": 1, "dp": 1, "cp": cp, "tp": 1} and engine.dp_world_size == 1
        assert engine.train_batch_size() == MICRO * GAS  # dp = world / cp: one replica
        losses = []
        for step in range(STEPS):
            for micro in range(GAS):
                x = gpt2_batch(step, micro)  # the whole batch on every cp rank
                out = engine(input_ids=x, labels=x)
                assert out.logits.shape == (MICRO, SEQ // cp, VOCAB)  # this rank's positions
                engine.backward(out.loss)
                engine.step()
                losses.append(float(out.loss))
        state, dense_losses, dense_norms = dense_gpt2_run()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(dense_losses), **FP32)
        full = engine.full_state_dict()
        for name, want in state.items():
            if name in full:  # HF's state_dict holds non-persistent buffers the engine's does not
                torch.testing.assert_close(full[name], want, **FP32, msg=lambda m, n=name: f"{n}: {m}")
        assert engine.get_global_grad_norm() is None or abs(engine.get_global_grad_norm() - dense_norms[-1]) < 1e-4
        # num_items_in_batch (HF's sum over that many items), return_dict=False, an all-ones mask
        x = gpt2_batch(7, 0)
        with torch.no_grad():
            dense = _gpt2_sdpa()
            dense.load_state_dict(full, strict=False)
            want = dense(input_ids=x, labels=x, num_items_in_batch=torch.tensor(5)).loss
            got = engine(input_ids=x, labels=x, num_items_in_batch=torch.tensor(5)).loss
            as_tuple = engine(input_ids=x, labels=x, return_dict=False)
            masked = engine(input_ids=x, labels=x, attention_mask=torch.ones_like(x)).loss
            plain = dense(input_ids=x, labels=x).loss
        torch.testing.assert_close(got, want, **FP32)
        torch.testing.assert_close(as_tuple[0], plain, **FP32)
        torch.testing.assert_close(masked, plain, **FP32)
        return losses


@pytest.mark.parametrize("stage, mode", [(0, "ulysses"), (3, "ring")], ids=["ddp-ulysses", "zero3-ring"])
def test_hf_labels_loop_with_the_sequence_split_equals_one_process(dist_pool, stage, mode):
    out = dist_pool.run(_hf_body, stage, mode, world_size=2, timeout=180)
    assert out[0] == out[1]  # the replica's loss, the same on every cp rank


def _padded_body(fused: bool) -> None:
    """Right-padded rows: the padding's labels are -100 (HF's collator), so the replica's loss
    weighs the valid tokens over both cp ranks, whose halves hold different counts of them.
    With ``fused_cross_entropy`` the head forms each rank's sum with no logits at all."""
    import shardkit

    config = _sp_config(0, 2, "ring") | {"gradient_accumulation_steps": 1}  # this backward reduces
    if fused:
        config["fused_cross_entropy"] = {"enabled": True, "chunk_tokens": 5}  # chunks across the rows
    with ParallelContext.from_world(cp=2) as ctx:
        engine, *_ = shardkit.initialize(model=_gpt2_sdpa(), config=config, ctx=ctx)
        x = gpt2_batch(0, 0)
        labels = x.clone()
        # zigzag over 2 ranks, chunks of 3: rank 0 holds positions 0-2 and 9-11, rank 1 holds 3-8;
        # target i is label i + 1, so rank 0 has 2 + 3 valid targets and rank 1 has 0 + 2
        labels[0, 3:] = -100
        labels[1, 6:] = -100
        out = engine(input_ids=x, labels=labels)
        assert (out.logits is None) == fused
        engine.backward(out.loss)
        dense = _gpt2_sdpa()
        want = dense(input_ids=x, labels=labels).loss
        want.backward()
        torch.testing.assert_close(out.loss.detach(), want.detach(), **FP32)
        # the gradients, reduced over cp, are the dense model's
        engine.parallel.clip(None)
        for (name, p), pd in zip(engine.module.named_parameters(), dense.parameters(), strict=True):
            torch.testing.assert_close(p.grad, pd.grad, **FP32, msg=lambda m, n=name: f"{n}: {m}")
        # refused, on every rank alike: a mask with zeros, position_ids
        with pytest.raises(ValueError, match="only a mask of ones"):
            mask = torch.ones_like(x)
            mask[1, 9:] = 0
            engine(input_ids=x, labels=labels, attention_mask=mask)
        with pytest.raises(ValueError, match="position_ids"):
            engine(input_ids=x, labels=labels, position_ids=torch.arange(SEQ).expand(MICRO, SEQ))


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused-ce"])
def test_padded_batch_weighs_every_valid_token_of_the_replica(dist_pool, fused: bool):
    dist_pool.run(_padded_body, fused, world_size=2, timeout=120)


def _tinygpt_body() -> list[float]:
    """TinyGPT without labels=: engine(x) returns the whole sequence's logits, the script forms
    its own loss, and dp 2 × cp 2 trains as one process on the concatenated dp batches."""
    import shardkit
    from shardkit.models import TinyGPT, lm_loss

    seq, micro, steps = 16, 2, 3
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # unclipped: a gradient off by a factor would not be hidden
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": 2},
        "sequence_parallel_size": 2,
        "context_parallel": {"mode": "ring", "layout": "contiguous"},
    }

    def model():
        torch.manual_seed(0)
        return TinyGPT(59, d_model=32, n_layers=2, n_heads=4, seq_len=seq)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randint(59, (2 * micro, seq + 1), generator=g)  # both dp ranks' rows

    with ParallelContext.from_world(cp=2) as ctx:
        engine, *_ = shardkit.initialize(model=model(), config=config, ctx=ctx)
        dp_rank = engine.ctx.rank("dp")
        assert engine.ctx.sizes == {"pp": 1, "dp": 2, "cp": 2, "tp": 1} and engine.train_batch_size() == 2 * micro
        losses = []
        for step in range(steps):
            rows = batch(step)[dp_rank * micro : (dp_rank + 1) * micro]
            logits = engine(rows[:, :-1])
            assert logits.shape == (micro, seq, 59)  # gathered: the whole sequence
            loss = lm_loss(logits, rows[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        dense = model()
        opt = torch.optim.SGD(dense.parameters(), lr=LR, momentum=0.9)
        for step in range(steps):
            rows = batch(step)
            lm_loss(dense(rows[:, :-1]), rows[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        full = engine.full_state_dict()
        for name, want in dense.state_dict().items():
            torch.testing.assert_close(full[name], want, **FP32, msg=lambda m, n=name: f"{n}: {m}")
        return losses


def test_tinygpt_loss_from_gathered_logits_at_dp2_cp2(dist_pool):
    out = dist_pool.run(_tinygpt_body, world_size=4, timeout=180)
    assert out[0] == out[1] and out[2] == out[3]  # cp ranks of a replica report alike


def _pipeline_body() -> None:
    """pipeline.stages 2 × sequence_parallel_size 2 (ZeRO-1, zigzag ring): train_batch over the
    pipeline with each stage running this cp rank's tokens equals one process on the whole batch."""
    import shardkit
    from shardkit.models import TinyGPT, gpt_blocks, lm_loss

    seq, micro, gas, steps = 16, 2, 2, 3
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": 1},
        "pipeline": {"stages": 2, "microbatches": 2},
        "sequence_parallel_size": 2,
        "context_parallel": {"mode": "ring"},
    }

    def model():
        torch.manual_seed(0)
        return TinyGPT(59, d_model=32, n_layers=2, n_heads=4, seq_len=seq)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randint(59, (gas * micro, seq + 1), generator=g)

    with ParallelContext.from_world(pp=2, cp=2) as ctx:
        with pytest.raises(ValueError, match="and a loss_fn"):  # a custom loss cannot be split over shards
            shardkit.initialize(model=model(), config=config, ctx=ctx, loss_fn=lambda out, y: out.sum())
        engine, *_ = shardkit.initialize(model=model(), config=config, ctx=ctx)
        losses = []
        for step in range(steps):
            rows = batch(step)
            data = [(rows[i * micro : (i + 1) * micro, :-1], rows[i * micro : (i + 1) * micro, 1:]) for i in range(gas)]
            losses.append(float(engine.train_batch(iter(data))))
        full = engine.full_state_dict()
        engine.close()
    dense = model()
    opt = torch.optim.SGD(dense.parameters(), lr=LR, momentum=0.9)
    want = []
    for step in range(steps):
        rows = batch(step)
        loss = lm_loss(dense(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), **FP32)
    want_state = torch.nn.Sequential(*gpt_blocks(dense)).state_dict()
    assert sorted(full) == sorted(want_state)
    for name, q in want_state.items():
        torch.testing.assert_close(full[name], q, **FP32, msg=lambda m, n=name: f"{n}: {m}")


def test_pipeline_with_the_sequence_split_equals_one_process(dist_pool):
    dist_pool.run(_pipeline_body, world_size=4, timeout=180)


def test_sequence_parallel_size_config_keys():
    from shardkit.engine import load_config

    cfg = load_config(_sp_config(1, 2, "ring") | {"train_micro_batch_size_per_gpu": 2}, world_size=8)
    assert (cfg.context_parallel.size, cfg.context_parallel.mode, cfg.context_parallel.layout) == (2, "ring", "zigzag")
    assert cfg.dp_size == 4 and cfg.train_batch_size == 2 * GAS * 4  # DeepSpeed: world / sequence_parallel_size
    assert load_config(tp_config(0, 1), world_size=2).context_parallel.size == 1
    with pytest.raises(ValueError, match="sequence_parallel_size must be >= 1"):
        load_config(tp_config(0, 1) | {"sequence_parallel_size": 0}, world_size=2)
    with pytest.raises(ValueError, match=r"not divisible by .* sequence_parallel_size \(4\)"):
        load_config(tp_config(0, 1) | {"sequence_parallel_size": 4}, world_size=6)
    with pytest.raises(ValueError, match="context_parallel.mode"):
        load_config(_sp_config(0, 2, "a2a"), world_size=2)
    hybrid = load_config(_sp_config(0, 4, "hybrid") | {"context_parallel": {"mode": "hybrid", "ulysses_size": 2}}, world_size=4)
    assert hybrid.context_parallel.ulysses_size == 2
    with pytest.raises(ValueError, match="needs context_parallel.ulysses_size"):
        load_config(_sp_config(0, 4, "hybrid"), world_size=4)
    with pytest.raises(ValueError, match="applies to mode 'hybrid' only"):
        load_config(tp_config(0, 1) | {"context_parallel": {"ulysses_size": 2}}, world_size=2)
    with pytest.raises(ValueError, match="context_parallel.layout"):
        load_config(tp_config(0, 1) | {"context_parallel": {"layout": "striped"}}, world_size=2)
    fused = load_config(_sp_config(0, 2, "ring") | {"fused_cross_entropy": {"enabled": True}}, world_size=2)
    assert fused.fused_cross_entropy.enabled and fused.context_parallel.size == 2
    with pytest.raises(ValueError, match="gather_logits true"):
        sp_tp = _sp_config(0, 2, "ring") | {"tensor_parallel": {"size": 2, "gather_logits": False}}
        load_config(sp_tp, world_size=4)


def _gpt2_dropout_body() -> tuple[list[float], float, float]:
    """GPT-2 as Hugging Face builds it (attention, residual and embedding dropout 0.1) under
    Ulysses: it trains; in eval mode its loss is the dense model's with the same weights."""
    import shardkit

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB, attn_implementation="sdpa")
    assert cfg.attn_pdrop == cfg.resid_pdrop == cfg.embd_pdrop == 0.1
    torch.manual_seed(0)
    with ParallelContext.from_world(cp=2) as ctx:
        engine, *_ = shardkit.initialize(model=transformers.GPT2LMHeadModel(cfg), config=_sp_config(0, 2, "ulysses"), ctx=ctx)
        torch.manual_seed(1)
        losses = []
        for step in range(2):
            for micro in range(GAS):
                x = gpt2_batch(step, micro)
                out = engine(input_ids=x, labels=x)
                engine.backward(out.loss)
                engine.step()
                losses.append(float(out.loss))
        engine.module.eval()
        x = gpt2_batch(5, 0)
        with torch.no_grad():
            cp_eval = float(engine(input_ids=x, labels=x).loss)
        dense = transformers.GPT2LMHeadModel(cfg).eval()
        dense.load_state_dict(engine.full_state_dict(), strict=False)
        with torch.no_grad():
            dense_eval = float(dense(input_ids=x, labels=x).loss)
        return losses, cp_eval, dense_eval


def test_gpt2_with_its_default_dropout_trains_under_ulysses(dist_pool):
    (losses, cp_eval, dense_eval), _ = dist_pool.run(_gpt2_dropout_body, world_size=2, timeout=120)
    assert all(math.isfinite(v) for v in losses)
    assert cp_eval == pytest.approx(dense_eval, rel=1e-5)


def _refusals_body() -> None:
    """Refused by name in initialize, before any collective of the engine."""
    import shardkit
    from shardkit.models import TinyGPT

    with ParallelContext.from_world(cp=2) as ctx:
        cases = [
            (tp_config(0, 1), {"cp_plan": {"blocks.*.attn": "attention"}}, "sequence_parallel_size is 1"),
            (_sp_config(0, 2, "ring"), {"cp_plan": {"nothing.here": "attention"}}, "names no module"),
            # the model's heads and attention dropout, named with the config's keys
            (_sp_config(0, 2, "ulysses"), {"n_heads": 3}, r"context_parallel.mode='ulysses': the model's 3 heads"),
            (_sp_config(0, 2, "ring"), {"dropout": 0.1}, r"config.dropout=0.1 drops attention weights"),
        ]
        for config, kwargs, match in cases:
            model_kw = {k: kwargs.pop(k) for k in ("n_heads", "dropout") if k in kwargs}
            d = 48 if model_kw.get("n_heads") == 3 else 32
            model = TinyGPT(59, d_model=d, n_layers=2, seq_len=16, **model_kw)
            patcher = forbid_collectives()
            try:
                with pytest.raises(ValueError, match=match):
                    shardkit.initialize(model=model, config=config, ctx=ctx, **kwargs)
            finally:
                patcher.stop()
        model = torch.nn.Linear(4, 4)  # no built-in cp plan
        with pytest.raises(ValueError, match=r"initialize\(cp_plan="):
            shardkit.initialize(model=model, config=_sp_config(0, 2, "ring"), ctx=ctx)


def test_sequence_split_refusals_name_the_key(dist_pool):
    dist_pool.run(_refusals_body, world_size=2, timeout=60)
