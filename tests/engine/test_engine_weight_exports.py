"""Getting the weights out as DeepSpeed scripts do: ``zero_to_fp32`` (the script written next to
each checkpoint and the ``deepspeed.utils.zero_to_fp32`` functions), ``engine.state_dict()`` /
``module_state_dict()`` / ``_zero3_consolidated_16bit_state_dict()`` at ZeRO-3.

References: the fp32 masters the run trained (gathered from the engine), which must differ from
the bf16 weights widened so the test can tell them apart; the model built with the same seed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model.register_buffer("seen", torch.arange(3))  # a buffer keeps its dtype
    return model


def _train_bf16_and_save(stage: int, tmp: str) -> dict[str, torch.Tensor]:
    import shardkit

    config = {**CONFIG, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}
    engine, *_ = shardkit.initialize(model=_model(), config=config)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 2, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x[dist.get_rank()].bfloat16()).float(), y[dist.get_rank()])
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(tmp)
    # the trained fp32 masters, gathered: each rank's shard segments into full flat tensors
    names = {p: n for n, p in engine.module.named_parameters()}
    full = {n: torch.zeros(p.numel()) for p, n in names.items()}
    for sb in engine._wrapped.sharded_buckets:
        for seg in sb.segments:
            p = sb.grad_bucket.params[seg.index]
            lo = seg.flat_offset - sb.start
            full[names[p]][seg.tensor_offset : seg.tensor_offset + seg.numel] = sb.master[lo : lo + seg.numel]
    for t in full.values():
        dist.all_reduce(t)  # each element lives on one rank, zeros elsewhere
    return {n: full[n].view(p.shape) for p, n in names.items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_gives_the_trained_fp32_masters_not_the_bf16_weights(dist_pool, tmp_path: Path, stage: int) -> None:
    from shardkit.deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    masters = dist_pool.run(_train_bf16_and_save, stage, str(tmp_path / "ckpt"), world_size=2, timeout=120)[0]
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert set(state) == set(_model().state_dict())
    for name, master in masters.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], master), name
        assert not torch.equal(master, master.bfloat16().float()), name  # the masters are not bf16 values
    assert state["seen"].dtype == torch.int64 and torch.equal(state["seen"], torch.arange(3))

    path = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out", tag="global_step3")
    assert path == tmp_path / "out" / "pytorch_model.bin"
    assert all(torch.equal(v, state[k]) for k, v in torch.load(path).items())
    model = load_state_dict_from_zero_checkpoint(_model(), tmp_path / "ckpt")
    assert torch.equal(model[0].weight, masters["0.weight"])


def test_the_zero_to_fp32_script_next_to_the_checkpoint_runs_as_deepspeed_users_run_it(dist_pool, tmp_path: Path) -> None:
    dist_pool.run(_train_bf16_and_save, 2, str(tmp_path / "ckpt"), world_size=2, timeout=120)
    script = tmp_path / "ckpt" / "zero_to_fp32.py"
    assert script.is_file()
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "out"), "-t", "global_step3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    from shardkit.consolidate import fp32_state_dict

    written = torch.load(tmp_path / "out" / "pytorch_model.bin")
    want = fp32_state_dict(tmp_path / "ckpt")
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="exclude_frozen_parameters"):
        from shardkit.deepspeed.utils.zero_to_fp32 import main

        main([str(tmp_path / "ckpt"), str(tmp_path / "out2"), "--exclude_frozen_parameters"])


def _zero3_state_dicts() -> tuple[dict, dict, dict, str]:
    import shardkit

    engine, *_ = shardkit.initialize(model=_model(), config={**CONFIG, "zero_optimization": {"stage": 3}})
    try:
        engine.module.state_dict()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return engine.state_dict(), engine.module_state_dict(), engine._zero3_consolidated_16bit_state_dict(), refused


def test_zero3_engine_state_dict_gathers_the_full_tensors(dist_pool) -> None:
    out = dist_pool.run(_zero3_state_dicts, world_size=2, timeout=120)
    want = _model().state_dict()
    for rank, (engine_sd, module_sd, consolidated, refused) in enumerate(out):
        assert engine_sd.keys() == {f"module.{k}" for k in want}
        assert all(torch.equal(engine_sd[f"module.{k}"], v) and torch.equal(module_sd[k], v) for k, v in want.items())
        assert (consolidated.keys() == want.keys()) if rank == 0 else consolidated == {}
        assert "full_state_dict" in refused  # the module's own state_dict names the way out


def _batchnorm_diverges_then_saves(stage: int, tmp: str) -> dict[str, torch.Tensor]:
    import shardkit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    engine, *_ = shardkit.initialize(model=model, config={**CONFIG, "zero_optimization": {"stage": stage}})
    gen = torch.Generator().manual_seed(3 + dist.get_rank())  # other data per rank: other statistics
    for _ in range(2):
        x = torch.randn(4, 8, generator=gen) * (1 + dist.get_rank())
        engine.backward(engine(x).square().mean())
        engine.step()
    engine.save_checkpoint(tmp)
    return {k: getattr(engine.module[1], k).clone() for k in ("running_mean", "running_var")}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_keeps_rank_0s_buffers_whole_when_the_replicas_differ(dist_pool, tmp_path: Path, stage: int) -> None:
    from shardkit.consolidate import fp32_state_dict

    ranks = dist_pool.run(_batchnorm_diverges_then_saves, stage, str(tmp_path / "ckpt"), world_size=2, timeout=120)
    assert not torch.equal(ranks[0]["running_var"], ranks[1]["running_var"])  # the replicas differ
    state = fp32_state_dict(tmp_path / "ckpt")
    for key in ("running_mean", "running_var"):  # both from rank 0, as DeepSpeed saves them
        assert torch.equal(state[f"1.{key}"], ranks[0][key]), key
