"""``deepspeed.zero.Init`` and ``zero.GatheredParameters`` on shardkit, 2 gloo ranks.

References: an engine built from a model that holds the written values before ``initialize``
(the modifier's writes must then train bitwise alike: the fp32 masters got them too), and the
model built with the same seed (read-only gathers see it; discarded writes leave it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _written() -> torch.Tensor:
    return torch.linspace(-1, 1, 32).reshape(2, 16)  # what rank 0 writes into the head's weight


def _train(engine, steps: int = 3) -> list[float]:
    gen, losses = torch.Generator().manual_seed(2), []
    for _ in range(steps):
        x, y = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 2, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x[dist.get_rank()].bfloat16()).float(), y[dist.get_rank()])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _modify_after_initialize() -> tuple[list[float], list[float], bool, bool, bool]:
    import shardkit
    import shardkit.deepspeed as deepspeed

    engine, *_ = shardkit.initialize(model=_model(), config=CONFIG)
    head = engine.module[2].weight
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # read only
        seen_full = torch.equal(head.float(), _model()[2].weight.bfloat16().float())
        head.data.fill_(7.0)  # no modifier_rank: discarded
    discarded = torch.equal(engine.full_state_dict()["2.weight"], _model()[2].weight.bfloat16())
    with deepspeed.zero.GatheredParameters(head, modifier_rank=0):
        head.data.copy_(_written() if dist.get_rank() == 0 else torch.zeros(2, 16))
    kept = torch.equal(engine.full_state_dict()["2.weight"], _written().bfloat16())
    got = _train(engine)

    reference = _model()
    with torch.no_grad():
        reference[2].weight.copy_(_written())
    ref_engine, *_ = shardkit.initialize(model=reference, config=CONFIG)
    return got, _train(ref_engine), seen_full, discarded, kept


def test_gathered_parameters_at_zero3_reads_full_params_and_keeps_the_modifiers_writes(dist_pool) -> None:
    for got, want, seen_full, discarded, kept in dist_pool.run(_modify_after_initialize, world_size=2, timeout=120):
        assert seen_full  # the full, gathered tensor inside the block
        assert discarded  # without modifier_rank a write does not survive the block
        assert kept  # rank 0's values on every rank's shard
        assert got == want  # bitwise: the fp32 masters got the write too (a stale master would undo it)


def _init_then_modify_before_initialize() -> tuple[bool, bool, list[str]]:
    import shardkit
    import shardkit.deepspeed as deepspeed

    with deepspeed.zero.Init(config_dict_or_path=CONFIG, remote_device="cpu", pin_memory=False):
        model = _model()
    with deepspeed.zero.GatheredParameters(list(model[2].parameters()), modifier_rank=0):
        model[2].weight.data.copy_(_written() if dist.get_rank() == 0 else torch.ones(2, 16))
    same_everywhere = torch.equal(model[2].weight.data, _written())
    engine, *_ = shardkit.initialize(model=model, config=CONFIG)
    sharded_right = torch.equal(engine.full_state_dict()["2.weight"], _written().bfloat16())
    errors = []
    for params, kwargs in (([1.0], {}), ([engine.module[0].weight], {"modifier_rank": 2})):
        try:
            with deepspeed.zero.GatheredParameters(params, **kwargs):
                pass
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return same_everywhere, sharded_right, errors


def test_zero_init_builds_a_plain_model_and_gathered_parameters_broadcasts_the_modifiers_values(dist_pool) -> None:
    for same_everywhere, sharded_right, errors in dist_pool.run(_init_then_modify_before_initialize, world_size=2, timeout=120):
        assert same_everywhere and sharded_right
        assert errors[0].startswith("TypeError: params") and errors[1].startswith("ValueError: modifier_rank"), errors


@pytest.mark.parametrize("stage", [1, 2])
def test_gathered_parameters_at_zero12_is_a_plain_write_the_masters_follow(dist_pool, stage: int) -> None:
    out = dist_pool.run(_modify_at_stage, stage, world_size=2, timeout=120)
    for got, want in out:
        assert got == want


def _modify_at_stage(stage: int) -> tuple[list[float], list[float]]:
    import shardkit
    import shardkit.deepspeed as deepspeed

    config = {**CONFIG, "zero_optimization": {"stage": stage}}
    engine, *_ = shardkit.initialize(model=_model(), config=config)
    with deepspeed.zero.GatheredParameters(engine.module[2].weight, modifier_rank=0):
        engine.module[2].weight.data.copy_(_written() if dist.get_rank() == 0 else torch.zeros(2, 16))
    reference = _model()
    with torch.no_grad():
        reference[2].weight.copy_(_written())
    ref_engine, *_ = shardkit.initialize(model=reference, config=config)
    return _train(engine), _train(ref_engine)
