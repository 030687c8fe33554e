"""The engine attributes DeepSpeed scripts use beyond the step: ``save_16bit_model``, ``no_sync``,
``step(lr_kwargs=)``, ``local_rank`` / ``dp_world_size`` / ``optimizer_name()`` (the last three are
also compared with DeepSpeed's in tests/engine/test_deepspeed_module_api.py).

Each against an independent reference: the saved 16-bit file against the model built with the same
seed (cast to bf16), ``no_sync`` accumulation against one process stepping on the summed loss,
``lr_kwargs`` against ReduceLROnPlateau's written-out rule.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _save_16bit_at_zero3(tmp: str) -> tuple[int, int]:
    import shardkit

    config = {**CONFIG, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    engine, _, _, _ = shardkit.initialize(model=_model(), config=config)
    assert engine.save_16bit_model(tmp, "model16.bin") is True
    return engine.dp_world_size, engine.local_rank


def test_save_16bit_model_gathers_zero3_shards_into_one_bf16_file(dist_pool, tmp_path: Path) -> None:
    out = dist_pool.run(_save_16bit_at_zero3, str(tmp_path), world_size=2, timeout=120)
    assert [o[0] for o in out] == [2, 2]
    saved = torch.load(tmp_path / "model16.bin")
    want = {k: v.to(torch.bfloat16) for k, v in _model().state_dict().items()}
    assert saved.keys() == want.keys()
    for key, value in want.items():
        assert saved[key].dtype == torch.bfloat16 and torch.equal(saved[key], value), key


def _no_sync_then_step(quiet: bool) -> tuple[list[torch.Tensor], int]:
    import contextlib

    import shardkit

    config = {**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = shardkit.initialize(model=_model(), config=config)
    gen = torch.Generator().manual_seed(3)
    xs = torch.randn(2, 2, 4, 8, generator=gen)  # [micro-batch, rank, rows, features]
    ys = torch.randn(2, 2, 4, 2, generator=gen)
    rank = dist.get_rank()
    before = sum(s.calls("all_reduce") for s in engine.parallel.comm_stats())
    with engine.no_sync() if quiet else contextlib.nullcontext():  # the first micro-batch only accumulates
        engine.backward(torch.nn.functional.mse_loss(engine(xs[0, rank]), ys[0, rank]))
    engine.backward(torch.nn.functional.mse_loss(engine(xs[1, rank]), ys[1, rank]))
    engine.step()
    reductions = sum(s.calls("all_reduce") for s in engine.parallel.comm_stats()) - before
    return [p.detach().clone() for p in engine.module.parameters()], reductions


def test_no_sync_accumulates_then_reduces_the_sum_once(dist_pool) -> None:
    out = [params for params, _ in dist_pool.run(_no_sync_then_step, True, world_size=2, timeout=120)]
    quiet = dist_pool.run(_no_sync_then_step, True, world_size=2, timeout=120)[0][1]
    loud = dist_pool.run(_no_sync_then_step, False, world_size=2, timeout=120)[0][1]
    assert 0 < quiet and 2 * quiet == loud  # inside no_sync the first backward did not communicate
    reference = _model()  # one process: the dp mean of each rank's summed micro-batch losses
    gen = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(2, 2, 4, 8, generator=gen), torch.randn(2, 2, 4, 2, generator=gen)
    loss = sum(torch.nn.functional.mse_loss(reference(xs[m, r]), ys[m, r]) for m in range(2) for r in range(2)) / 2
    loss.backward()
    with torch.no_grad():
        want = [p - 0.1 * p.grad for p in reference.parameters()]
    for rank in out:
        for got, expected in zip(rank, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def _plateau_with_lr_kwargs() -> list[float]:
    import shardkit

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    engine, _, _, _ = shardkit.initialize(model=model, optimizer=optimizer, lr_scheduler=plateau, config=CONFIG)
    lrs = []
    for metric in (1.0, 2.0, 3.0):  # never better after the first: halve on every later step
        engine.backward(engine(torch.ones(4, 8)).sum())
        engine.step(lr_kwargs={"metrics": metric})
        lrs.append(engine.get_lr()[0])
    return lrs


def test_step_passes_lr_kwargs_to_the_scheduler(dist_pool) -> None:
    out = dist_pool.run(_plateau_with_lr_kwargs, world_size=2, timeout=120)
    assert out[0] == out[1] == [0.1, 0.05, 0.025]
