"""``Engine.load_checkpoint``'s DeepSpeed flags: ``load_optimizer_states=False`` and
``load_module_only=True`` (a warm start), at ZeRO 0, 2 and 3 on 2 gloo ranks.

The oracle for "weights loaded, optimizer fresh" is an engine built from nothing on a model that
holds the same weights (``load_state_dict`` before ``initialize``): the resumed run must train
bitwise like it. The fp32 masters of a bf16 run must be the checkpoint's own, not the bf16
weights widened (checked to differ, so the comparison can fail).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(steps, 2, 4, 8, generator=gen), torch.randn(steps, 2, 4, 2, generator=gen)


def _train(engine, first: int, last: int) -> list[float]:
    xs, ys = _batches(last)
    xs = xs.to(torch.bfloat16) if engine.bfloat16_enabled() else xs
    rank, losses = dist.get_rank(), []
    for step in range(first, last):
        loss = torch.nn.functional.mse_loss(engine(xs[step, rank]).float(), ys[step, rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _config(stage: int, lr: float = 1e-2) -> dict:
    return {**CONFIG, "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": lr}}}


def _resume_without_optimizer_state(stage: int, tmp: str) -> tuple[list[float], list[float], int, int]:
    import shardkit

    engine, *_ = shardkit.initialize(model=_model(), config=_config(stage))
    _train(engine, 0, 3)
    engine.save_checkpoint(tmp, tag="three")
    weights = engine.full_state_dict()
    _train(engine, 3, 4)  # moments now differ from a fresh optimizer's

    resumed, *_ = shardkit.initialize(model=_model(), config=_config(stage))
    path, client = resumed.load_checkpoint(tmp, tag="three", load_optimizer_states=False)
    assert path == str(Path(tmp) / "three") and client == {}
    got = _train(resumed, 3, 6)

    fresh_model = _model()
    fresh_model.load_state_dict(weights)
    fresh, *_ = shardkit.initialize(model=fresh_model, config=_config(stage))
    want = _train(fresh, 3, 6)
    return got, want, resumed.global_steps, engine.global_steps


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_load_without_optimizer_states_trains_like_a_fresh_optimizer_on_the_saved_weights(
    dist_pool, tmp_path: Path, stage: int
) -> None:
    out = dist_pool.run(_resume_without_optimizer_state, stage, str(tmp_path), world_size=2, timeout=120)
    for got, want, resumed_steps, _ in out:
        assert got == want  # bitwise: the same weights, moments from zero
        assert resumed_steps == 3 + 3  # the counters came back (3 saved + 3 trained)


def _masters(engine) -> list[torch.Tensor]:
    return [sb.master.clone() for sb in engine._wrapped.sharded_buckets]


def _warm_start_keeps_the_fp32_masters(tmp: str) -> tuple[bool, bool, int, float, bool]:
    import shardkit

    config = {**_config(2), "bf16": {"enabled": True}}
    engine, *_ = shardkit.initialize(model=_model(), config=config)
    _train(engine, 0, 3)
    engine.save_checkpoint(tmp, client_state={"epoch": 7})
    saved = _masters(engine)
    widened = [sb.local_param_shard().float() for sb in engine._wrapped.sharded_buckets]

    other = {**CONFIG, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
             "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}  # fmt: skip
    warm, *_ = shardkit.initialize(model=_model(), config=other)
    lr_before = warm.get_lr()[0]
    _, client = warm.load_checkpoint(tmp, load_module_only=True)
    same = all(torch.equal(a, b) for a, b in zip(_masters(warm), saved))
    differs_from_widened = any(not torch.equal(a, b) for a, b in zip(saved, widened))
    full_equal = all(torch.equal(warm.full_state_dict()[k], v) for k, v in engine.full_state_dict().items())
    return same and full_equal, differs_from_widened, warm.global_steps, warm.get_lr()[0] - lr_before, client == {"epoch": 7}


def test_load_module_only_takes_weights_and_fp32_masters_but_no_counters_or_schedule(dist_pool, tmp_path: Path) -> None:
    out = dist_pool.run(_warm_start_keeps_the_fp32_masters, str(tmp_path), world_size=2, timeout=120)
    for same, differs_from_widened, steps, lr_change, client_ok in out:
        assert differs_from_widened  # else the masters test below could not tell the two apart
        assert same  # weights and masters are the checkpoint's, bitwise
        assert steps == 0 and lr_change == 0.0  # counters and the (SGD, warm-up) schedule untouched
        assert client_ok


def _refusals(tmp: str) -> list[str]:
    import shardkit

    engine, *_ = shardkit.initialize(model=_model(), config=_config(0))
    engine.save_checkpoint(tmp)
    messages = []
    for kwargs in ({"load_module_strict": False}, {"custom_load_fn": lambda *a: None}):
        with pytest.raises(ValueError) as info:
            engine.load_checkpoint(tmp, **kwargs)
        messages.append(str(info.value))
    return messages


def test_load_options_not_offered_are_refused_by_name(dist_pool, tmp_path: Path) -> None:
    out = dist_pool.run(_refusals, str(tmp_path), world_size=2, timeout=60)
    assert "load_module_strict" in out[0][0] and "custom_load_fn" in out[0][1]
