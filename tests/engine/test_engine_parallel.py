"""``shardkit.initialize`` with shardkit's ``tensor_parallel`` and ``pipeline`` config sections.

References are single-process plain torch runs of the dense model on the same global batch
(``torch.optim.SGD`` / ``AdamW``, ``torch.nn.utils.clip_grad_norm_``); the engine's state is
gathered back to the dense layout (``engine.full_state_dict()``) and compared key by key.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from shardkit.comm import ParallelContext
from distributed import forbid_collectives
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32
from engine_cases import (
    CLIP,
    GAS,
    P_GAS,
    STEPS,
    VOCAB,
    dense_gpt2_run,
    gpt2_batch,
    pp_config,
    pp_micro_batches,
    pp_mlp,
    tiny_gpt2,
    tp_config,
)


def _tp_body(stage: int) -> dict:
    import shardkit

    with ParallelContext.from_world(tp=2) as ctx:  # world 2: tp 2, dp 1
        engine, *_ = shardkit.initialize(model=tiny_gpt2(), config=tp_config(stage, 2), ctx=ctx)
        head = engine.module.lm_head
        assert head.weight is engine.module.transformer.wte.weight  # still tied after the split
        if stage == 0:  # (ZeRO-3 frees the unit's params between steps)
            assert head.weight.shape[0] == VOCAB // 2
        losses, norms = [], []
        for step in range(STEPS):
            for micro in range(GAS):
                x = gpt2_batch(step, micro)  # every tp rank reads the whole (dp-rank) batch
                out = engine(input_ids=x, labels=x)
                assert out.logits.shape[-1] == VOCAB  # gathered: HF's own loss ran on full logits
                engine.backward(out.loss)
                engine.step()
                losses.append(float(out.loss))
            norms.append(engine.get_global_grad_norm())
        ref, ref_losses, ref_norms = dense_gpt2_run()
        full = engine.full_state_dict()
        for k, r in ref.items():
            if k in full:  # GPT-2's causal-mask buffers are not in every transformers version
                torch.testing.assert_close(full[k], r, **FP32, msg=lambda m, k=k: f"{k}: {m}")
        assert set(ref) - set(full) <= {k for k in ref if k.endswith(".attn.bias") or k.endswith("masked_bias")}
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **FP32)
        assert min(ref_norms) > CLIP  # clipping acted on every step (its norm spans the tp shards)
        return {"losses": losses, "vocab_rows": full["lm_head.weight"].shape[0]}


@pytest.mark.reduction_order
@pytest.mark.parametrize("stage", [0, 3], ids=["stage0", "zero3"])
def test_tensor_parallel_config_trains_like_one_process(dist_pool, stage):
    out = dist_pool.run(_tp_body, stage, world_size=2, timeout=120)
    assert out[0]["losses"] == out[1]["losses"]
    assert out[0]["vocab_rows"] == VOCAB  # gathered back to the dense layout


def _pp_reference() -> tuple[dict, list[float]]:
    """One process, plain torch: cross-entropy of the global batch (all micro-batches), AdamW."""
    model = pp_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS_ACROSS_ORDERS)
    losses = []
    for step in range(STEPS):
        x, y = (torch.cat(t) for t in zip(*pp_micro_batches(step), strict=True))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return model.state_dict(), losses


def _pp_body(schedule: str, stage: int) -> dict:
    import shardkit
    from shardkit.parallel import ZeroOptimizer

    with ParallelContext.from_world(pp=2) as ctx:
        engine, *_ = shardkit.initialize(model=pp_mlp(), config=pp_config(stage, schedule=schedule), ctx=ctx)
        assert isinstance(engine.optimizer, ZeroOptimizer) == (stage > 0)
        assert engine.is_first_stage() == (ctx.rank("pp") == 0) and engine.is_last_stage() == (ctx.rank("pp") == 1)
        losses = [float(engine.train_batch(iter(pp_micro_batches(step)))) for step in range(STEPS)]
        ref, ref_losses = _pp_reference()
        full = engine.full_state_dict()
        assert sorted(full) == sorted(ref)
        for k, r in ref.items():
            torch.testing.assert_close(full[k], r, **FP32, msg=lambda m, k=k: f"{k}: {m}")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (STEPS, STEPS * P_GAS, STEPS * 16)
        assert engine.get_global_grad_norm() > CLIP  # the last step was clipped
        # eval_batch: the same mean loss as the reference model on the next batch, no step
        x, y = (torch.cat(t) for t in zip(*pp_micro_batches(99), strict=True))
        model = pp_mlp()
        model.load_state_dict(ref)
        expect = float(F.cross_entropy(model(x), y))
        assert float(engine.eval_batch(iter(pp_micro_batches(99)))) == pytest.approx(expect, rel=1e-5)
        assert engine.global_steps == STEPS
        # the DeepSpeed micro-step API is refused, naming train_batch
        for call in (lambda: engine(x), lambda: engine.backward(torch.ones(())), engine.step):
            with pytest.raises(RuntimeError, match="train_batch"):
                call()
        engine.close()
        return {"losses": losses}


@pytest.mark.reduction_order
@pytest.mark.parametrize("schedule,stage", [("1f1b", 0), ("gpipe", 1)], ids=["1f1b-stage0", "gpipe-zero1"])
def test_pipeline_config_train_batch_equals_one_process(dist_pool, schedule, stage):
    out = dist_pool.run(_pp_body, schedule, stage, world_size=2, timeout=120)
    assert out[0] == out[1]  # the loss is the same on every stage


def _pp_offload_body() -> dict:
    """A pipeline engine with ZeRO-1 and the optimizer offloaded reports the host bytes its ZeRO
    wrapper holds: the fp32 masters and AdamW's two moments of this rank's 1/dp share (review:
    the report said nothing was offloaded)."""
    import shardkit

    with ParallelContext.from_world(pp=2) as ctx:
        config = pp_config(1)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        engine, *_ = shardkit.initialize(model=pp_mlp(), config=config, ctx=ctx)
        engine.train_batch(iter(pp_micro_batches(0)))
        off = engine.memory_report()["offloaded"]
        numel = sum(p.numel() for p in engine.parallel.parameters())  # this pp rank's stages, dp 1
        engine.close()
        return {"cpu": off.get("cpu", 0), "numel": numel}


def test_pipeline_engine_memory_report_counts_offloaded_state(dist_pool):
    for out in dist_pool.run(_pp_offload_body, world_size=2, timeout=120):
        # master + exp_avg + exp_avg_sq in fp32 on the host (plus padding and staging buffers)
        assert out["cpu"] >= 12 * out["numel"], out


# ---- errors, before any collective -------------------------------------------------------------
def _errors_body() -> None:
    import shardkit

    with ParallelContext.from_world() as ctx:
        tp2 = tp_config(0, 2)

        def with_(base: dict, **sections) -> dict:
            c = copy.deepcopy(base)
            for name, value in sections.items():
                c[name] = {**c.get(name, {}), **value}
            return c

        frozen_front = pp_mlp()
        for q in frozen_front[:4].parameters():  # stage 0 (blocks 0-3 of 7) has nothing to train
            q.requires_grad_(False)
        subset = pp_mlp()  # the same, by leaving stage 0's parameters out of model_parameters
        cases = [
            (frozen_front, pp_config(1), {}, ValueError, "pipeline.stages=2: stage 0"),
            (
                subset,
                pp_config(),
                {"model_parameters": list(subset[4:].parameters())},
                ValueError,
                "left out of model_parameters",
            ),
            (tiny_gpt2(), with_(tp2, tensor_parallel={"size": 3}), {}, ValueError, "tensor_parallel.size"),
            (tiny_gpt2(), with_(tp2, tensor_parallel={"sise": 2}), {}, ValueError, "tensor_parallel.sise"),
            (tiny_gpt2(), with_(tp2, tensor_parallel={"plan": "megatron"}), {}, ValueError, "tensor_parallel.plan"),
            (pp_mlp(), with_(tp2), {}, ValueError, "tensor_parallel.plan"),  # "auto" knows no plan for an MLP
            (tiny_gpt2(), with_(tp2), {}, ValueError, "ctx"),  # a dp-only ctx for a tp-2 config
            (tiny_gpt2(), with_(tp2, fp16={"enabled": True}), {}, ValueError, "fp16.enabled"),
            (pp_mlp(), pp_config(stagez=2), {}, ValueError, "pipeline.stagez"),
            (pp_mlp(), pp_config(microbatches=3), {}, ValueError, "pipeline.microbatches"),
            (pp_mlp(), pp_config(virtual_stages=2), {}, ValueError, "pipeline.virtual_stages"),
            (tiny_gpt2(), pp_config(), {}, ValueError, "blocks"),  # not splittable as given
            (pp_mlp(), pp_config(3), {}, ValueError, "zero_optimization.stage"),
            (pp_mlp(), with_(pp_config(), pipeline={"stages": 1}), {"blocks": list}, ValueError, "blocks"),
            (pp_mlp(), pp_config(), {"optimizer": torch.optim.SGD(pp_mlp().parameters(), lr=0.1)}, ValueError, "optimizer"),
        ]
        for model, config, kwargs, exc, key in cases:
            stack = forbid_collectives()
            try:
                with pytest.raises(exc, match=key.replace(".", r"\.")):
                    shardkit.initialize(model=model, config=config, ctx=ctx, **kwargs)
            finally:
                stack.stop()


def test_bad_parallel_sections_raise_naming_the_key_before_any_collective(dist_pool):
    dist_pool.run(_errors_body, world_size=2, timeout=60)
