"""The engine attributes DeepSpeed scripts use beyond the step: ``save_16bit_model``, ``no_sync``,
``step(lr_kwargs=)``, ``local_rank`` / ``dp_world_size`` / ``optimizer_name()`` (the last three are
also compared with DeepSpeed's in tests/engine/test_deepspeed_module_api.py).

Each against an independent reference: the saved 16-bit file against the model built with the same
seed (cast to bf16), ``no_sync`` accumulation against one process stepping on the summed loss,
``lr_kwargs`` against ReduceLROnPlateau's written-out rule.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0}


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


def _grow_the_batch(switch: bool) -> list[float]:
    import shardkit

    config = {**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if not switch:
        config["gradient_accumulation_steps"] = 2  # the reference: the larger batch from the start
    engine, _, _, _ = shardkit.initialize(model=_model(), config=config)
    errors = []
    if switch:
        for bad in (12, 0):  # not a multiple of micro (4) × dp (2); not positive
            with pytest.raises(ValueError, match="train_batch_size"):
                engine.set_train_batch_size(bad)
        engine.set_train_batch_size(16)
        errors.append(engine.gradient_accumulation_steps())
    gen = torch.Generator().manual_seed(4)
    xs, ys = torch.randn(4, 2, 4, 8, generator=gen), torch.randn(4, 2, 4, 2, generator=gen)
    for m in range(4):
        engine.backward(torch.nn.functional.mse_loss(engine(xs[m, dist.get_rank()]), ys[m, dist.get_rank()]))
        engine.step()
        if switch and m == 0:  # one micro-batch of the window of two is in the gradients
            with pytest.raises(ValueError, match="inside an accumulation window"):
                engine.set_train_batch_size(8)
    return [p.sum().item() for p in engine.module.parameters()] + [engine.global_steps, engine.train_batch_size()] + errors


def test_set_train_batch_size_trains_like_a_config_with_that_batch(dist_pool) -> None:
    switched = dist_pool.run(_grow_the_batch, True, world_size=2, timeout=120)
    configured = dist_pool.run(_grow_the_batch, False, world_size=2, timeout=120)
    assert switched[0][-1] == 2  # 16 samples = 4 per micro-batch × 2 ranks × 2 micro-batches
    assert switched[0][:-1] == configured[0]  # bitwise: the same windows, two optimizer steps of 16
    assert configured[0][-2:] == [2, 16]


def test_throughput_timer_counts_after_the_warm_up_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's rule: the first ``start_step`` optimizer steps are not timed; each later
    micro-step counts from its start (the engine's forward) to its stop (the engine's step)."""
    from shardkit.engine import throughput

    clock = iter(float(t) for t in range(1, 100))
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    timer = throughput.ThroughputTimer(batch_size=32, start_step=2)
    assert timer.avg_samples_per_sec() == float("-inf")
    for step in range(5):  # two micro-steps per optimizer step, each one clock tick long
        for micro in range(2):
            timer.start()
            timer.stop(global_step=micro == 1)
    # steps 3-5 timed: 6 micro-steps of 1 s = 2 s per optimizer step of 32 samples
    assert timer.global_step_count == 5 and timer.total_elapsed_time == 6.0
    assert timer.avg_samples_per_sec() == 16.0


def _timer_and_monitor() -> tuple[int, float, bool]:
    import shardkit

    engine, _, _, _ = shardkit.initialize(model=_model(), config={**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for _ in range(4):
        engine.backward(engine(torch.ones(4, 8)).sum())
        engine.step()
    engine.monitor.write_events([("Train/loss", 1.0, 4)])  # accepted, logged at debug level
    return engine.tput_timer.global_step_count, engine.tput_timer.avg_samples_per_sec(), engine.monitor.enabled


def test_the_engine_feeds_its_throughput_timer(dist_pool) -> None:
    for steps, samples_per_sec, monitor_enabled in dist_pool.run(_timer_and_monitor, world_size=2, timeout=120):
        assert steps == 4 and samples_per_sec > 0 and not monitor_enabled


def _odd_switch() -> tuple[int, int, bool]:
    import shardkit

    engine, _, _, _ = shardkit.initialize(model=_model(), config={**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for _ in range(3):
        engine.backward(engine(torch.ones(4, 8)).sum())
        engine.step()
    engine.set_train_batch_size(16)  # accumulation 2 from micro-step 3
    for _ in range(5):
        engine.backward(engine(torch.ones(4, 8)).sum())
        engine.step()
    return engine.global_steps, engine.global_samples, engine.is_gradient_accumulation_boundary()


def test_set_train_batch_size_keeps_deepspeeds_boundaries_at_multiples_of_the_accumulation(dist_pool) -> None:
    """DeepSpeed 0.19.8 counts boundaries on the absolute micro_steps: after 3 steps at accumulation
    1, the new accumulation 2 ends windows at micro-steps 4, 6, 8 (the first one a single
    micro-batch): 6 steps and 3 × 8 + 3 × 16 = 72 samples (DeepSpeed's numbers for this run)."""
    for steps, samples, boundary_next in dist_pool.run(_odd_switch, world_size=2, timeout=120):
        assert (steps, samples, boundary_next) == (6, 72, False)


def _norm_without_clipping(stage: int) -> float | None:
    import shardkit

    config = {**CONFIG, "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = shardkit.initialize(model=_model(), config=config)  # gradient_clipping 0: no clipping
    gen = torch.Generator().manual_seed(6)
    xs, ys = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 2, generator=gen)
    engine.backward(torch.nn.functional.mse_loss(engine(xs[dist.get_rank()]), ys[dist.get_rank()]))
    engine.step()
    return engine.get_global_grad_norm()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_reports_the_global_grad_norm_without_clipping_as_deepspeed(dist_pool, stage: int) -> None:
    reference = _model()  # one process: the dp mean of both ranks' losses
    gen = torch.Generator().manual_seed(6)
    xs, ys = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 2, generator=gen)
    (sum(torch.nn.functional.mse_loss(reference(xs[r]), ys[r]) for r in range(2)) / 2).backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    for norm in dist_pool.run(_norm_without_clipping, stage, world_size=2, timeout=120):
        assert norm == pytest.approx(want, rel=1e-5)


def test_a_deepspeed_name_not_offered_says_where_the_supported_ones_are_listed():
    import shardkit.deepspeed as deepspeed

    for get in (lambda: deepspeed.runtime, lambda: deepspeed.utils.safe_get_full_grad):
        with pytest.raises(AttributeError, match=r"not offered under shardkit; docs/engine\.md"):
            get()
    assert not hasattr(deepspeed, "no_such_name") and hasattr(deepspeed.utils, "RepeatingLoader")
