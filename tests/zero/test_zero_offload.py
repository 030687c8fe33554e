"""ZeRO-Offload (``offload="cpu"``) and NVMe offload (``offload="nvme"``) against ``offload=None``.

Every body trains the same model twice on the same dp ranks, once without offload (the path
tests/zero/test_zero12_trains_like_one_process.py checks against one process) and once with, and requires the params to be
BITWISE equal after every step: the offloaded step must do the same arithmetic on the same
fp32 values, only elsewhere. fp32 runs are also compared with a single-process replica
(tolerance FP32). Plus: the memory report against the written-out formula, state_dict round
trips (offload <-> no offload), a full disk during an NVMe write, fp16 overflow, bad arguments.
"""

from __future__ import annotations

import copy
import errno
import glob
import os
from unittest import mock

import pytest
import torch
from torch import nn

from shardkit.comm import CommStats, ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel import DynamicLossScaler
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer, nvme
from tolerances import FP32
from offload_cases import OPTIMIZERS, offload_rows, offload_batch, offload_groups, offload_model, offload_train_step


def _build(ctx, stage, offload, opt_name, dtype, nvme_dir, bucket_mb=0.004):
    cls, kw = OPTIMIZERS[opt_name]
    sdp = ShardedDataParallel(
        offload_model(dtype), ctx, stage, bucket_mb=bucket_mb, offload=offload, nvme_dir=nvme_dir if offload == "nvme" else None
    )
    groups = offload_groups(sdp.module) if "adamw" in opt_name else None
    opt = ZeroOptimizer(sdp, cls, groups, **kw)
    return sdp, opt


def _equal_to_no_offload(
    stage: int, offload: str, opt_name: str, dtype: torch.dtype, nvme_dir: str | None, bucket_mb: float, steps: int = 10
) -> int:
    ctx = ParallelContext.from_world()
    base, base_opt = _build(ctx, stage, None, opt_name, dtype, None, bucket_mb)
    sdp, opt = _build(ctx, stage, offload, opt_name, dtype, nvme_dir, bucket_mb)
    # one LR scheduler per run, on the ONE param_groups list the wrapped optimizer exposes
    scheds = [torch.optim.lr_scheduler.StepLR(o.optimizer, step_size=3, gamma=0.5) for o in (base_opt, opt)]
    ref = offload_model(dtype).float()
    cls, kw = OPTIMIZERS[opt_name]
    ref_opt = cls(offload_groups(ref) if "adamw" in opt_name else ref.parameters(), **kw)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    for step in range(steps):
        offload_train_step(base, base_opt, ctx, step, dtype)
        offload_train_step(sdp, opt, ctx, step, dtype)
        x, y = offload_batch(step)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for s in (*scheds, ref_sched):
            s.step()
        full, base_full = sdp.full_state_dict(), base.full_state_dict()  # stage 3: gathered
        for name, r in ref.state_dict().items():
            assert torch.equal(full[name], base_full[name]), f"{offload}: {name} differs from offload=None at step {step}"
            if dtype == torch.float32:
                torch.testing.assert_close(full[name], r, **FP32, msg=lambda m, n=name, s=step: f"{n}, step {s}: {m}")
    lr0 = 0.005 if "adamw" in opt_name else OPTIMIZERS[opt_name][1]["lr"]
    assert opt.param_groups[-1]["lr"] == base_opt.param_groups[-1]["lr"] == lr0 * 0.5 ** (steps // 3)
    assert opt.shard_slots() == base_opt.shard_slots()
    ctx.destroy()
    return len(sdp.sharded_buckets)


@pytest.mark.reduction_order
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offload_bitwise_equal_to_no_offload(dist_pool, tmp_path, offload, opt_name, stage, dtype) -> None:
    """Several buckets (sub-groups streamed with read-ahead for nvme), 2 ranks, 10 steps."""
    buckets = dist_pool.run(
        _equal_to_no_offload, stage, offload, opt_name, dtype, str(tmp_path), 0.004, world_size=2, timeout=120
    )
    assert buckets[0] > 2


@pytest.mark.parametrize("opt_name", ["fused_adamw", "torch_adamw"])
def test_nvme_one_bucket_bitwise(dist_pool, tmp_path, opt_name) -> None:
    """One sub-group: the same params step with new state tensors every step (a fused optimizer
    reusing a cached plan over the previous step's tensors would diverge here)."""
    buckets = dist_pool.run(
        _equal_to_no_offload, 2, "nvme", opt_name, torch.float32, str(tmp_path), 25.0, world_size=2, timeout=120
    )
    assert buckets[0] == 1


# ---- memory ------------------------------------------------------------------------------------
def _memory_formula(offload: str, nvme_dir: str | None) -> None:
    """Model state on the device = params + gradient shard only; off the device: the fp32 master
    (4Ψ/N) + Adam's m and v (8Ψ/N) + one 4-byte ``step`` per shard param. The tensors' sizes are
    multiples of 64, so the shards carry no padding and Ψ/N is exact."""
    ctx = ParallelContext.from_world()
    n = ctx.size("dp")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    sdp = ShardedDataParallel(model, ctx, 2, bucket_mb=0.01, offload=offload, nvme_dir=nvme_dir)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-3)
    opt.zero_grad()
    sdp(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    psi = sum(p.numel() for p in sdp.module.parameters())
    assert sum(sb.shard for sb in sdp.sharded_buckets) * n == psi  # no padding
    pieces = sum(len(sb.segments) for sb in sdp.sharded_buckets)
    report = sdp.memory_report()
    assert report["optimizer_state"] == 0 and report["master_params"] == 0
    assert report["model_state"] == 4 * psi + 4 * psi // n  # stage 2, fp32: params + grad shard
    off = report["offloaded"]
    expected = 4 * psi // n + 8 * psi // n + 4 * pieces
    assert off[offload] == expected, (off, expected)
    assert off["nvme" if offload == "cpu" else "cpu"] == 0
    assert off["cpu_buffers"] == 4 * psi // n
    assert off[offload] == pytest.approx(12 * psi / n, rel=0.02)  # the ZeRO-Offload formula
    ctx.destroy()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offload_memory_report_matches_formula(dist_pool, tmp_path, offload) -> None:
    dist_pool.run(_memory_formula, offload, str(tmp_path) if offload == "nvme" else None, world_size=2, timeout=60)


# ---- state_dict --------------------------------------------------------------------------------
def _round_trip(offload: str, dtype: torch.dtype, nvme_dir: str) -> None:
    """Save with offload, load into a fresh run WITH offload and into one WITHOUT (and back):
    every continuation is bitwise the run that never stopped."""
    ctx = ParallelContext.from_world()
    dirs = iter(os.path.join(nvme_dir, d) for d in ("a", "b", "c"))

    def build(mode: str | None):
        d = next(dirs) if mode == "nvme" else None
        if d is not None and ctx.rank("dp") == 0:
            os.makedirs(d, exist_ok=True)
        torch.distributed.barrier()
        return _build(ctx, 2, mode, "fused_adamw", dtype, d)

    def train(sdp, opt, steps) -> None:
        for step in steps:
            offload_train_step(sdp, opt, ctx, step, dtype)

    sdp, opt = build(offload)
    train(sdp, opt, range(3))
    model_state, opt_state = sdp.full_state_dict(), copy.deepcopy(opt.state_dict())
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in opt_state["master"])
    assert sorted(opt_state["optimizer"]["state"]) == list(range(len(opt.shard_slots())))
    train(sdp, opt, range(3, 6))
    for mode in (offload, None):
        sdp2, opt2 = build(mode)
        sdp2.load_full_state_dict(model_state)  # params first, then the optimizer: masters win
        opt2.load_state_dict(copy.deepcopy(opt_state))  # torch.optim adopts the tensors it is given
        train(sdp2, opt2, range(3, 6))
        for p, q in zip(sdp.module.parameters(), sdp2.module.parameters()):
            assert torch.equal(p, q), f"load into offload={mode!r} continues differently"
    back, back_opt = build(offload)  # no offload -> offload
    back.load_full_state_dict(sdp2.full_state_dict())
    back_opt.load_state_dict(copy.deepcopy(opt2.state_dict()))
    train(back, back_opt, range(6, 8))
    train(sdp, opt, range(6, 8))
    for p, q in zip(sdp.module.parameters(), back.module.parameters()):
        assert torch.equal(p, q), "no offload -> offload continues differently"
    ctx.destroy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offload_state_dict_round_trip(dist_pool, tmp_path, offload, dtype) -> None:
    dist_pool.run(_round_trip, offload, dtype, str(tmp_path), world_size=2, timeout=120)


def _user_writes_params(offload: str, nvme_dir: str, stage: int = 2) -> None:
    """Params replaced mid-training (``load_full_state_dict`` only, no optimizer state): the
    next step continues from them on the CPU master, as the device master does without offload.
    Stage 3 writes the param shards directly (no ``_version`` moves): the load itself must tell
    the offloaded masters."""
    ctx = ParallelContext.from_world()
    base, base_opt = _build(ctx, stage, None, "fused_adamw", torch.bfloat16, None)
    sdp, opt = _build(ctx, stage, offload, "fused_adamw", torch.bfloat16, nvme_dir)
    for step in range(2):
        offload_train_step(base, base_opt, ctx, step, torch.bfloat16)
        offload_train_step(sdp, opt, ctx, step, torch.bfloat16)
    torch.manual_seed(7)
    new = {k: torch.randn_like(v) for k, v in sdp.full_state_dict().items()}
    base.load_full_state_dict(new)
    sdp.load_full_state_dict(new)
    for step in range(2, 4):
        offload_train_step(base, base_opt, ctx, step, torch.bfloat16)
        offload_train_step(sdp, opt, ctx, step, torch.bfloat16)
    ours, ref = sdp.full_state_dict(), base.full_state_dict()
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k
    ctx.destroy()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offload_step_continues_from_params_the_user_wrote(dist_pool, tmp_path, offload, stage) -> None:
    dist_pool.run(_user_writes_params, offload, str(tmp_path), stage, world_size=2, timeout=60)


# ---- a full disk -------------------------------------------------------------------------------
def _full_disk(nvme_dir: str, opt_name: str) -> tuple[str, str]:
    """Rank 1's disk fills up in the middle of step 3's writes: every rank raises, no rank
    commits (params and optimizer state exactly as before the step), and once space is back the
    same step and the following ones train bitwise like a run that never failed."""
    ctx = ParallelContext.from_world()
    base, base_opt = _build(ctx, 2, None, opt_name, torch.float32, None)
    sdp, opt = _build(ctx, 2, "nvme", opt_name, torch.float32, nvme_dir)
    for step in range(3):
        offload_train_step(base, base_opt, ctx, step, torch.float32)
        offload_train_step(sdp, opt, ctx, step, torch.float32)
    params = [p.detach().clone() for p in sdp.module.parameters()]
    state = copy.deepcopy(opt.state_dict())
    calls = [0]

    def write(f, data) -> None:
        calls[0] += 1
        if calls[0] == 3:  # after some files of this step were written: a partial generation
            raise OSError(errno.ENOSPC, "No space left on device")
        f.write(data)

    message = ""
    with mock.patch.object(nvme, "_write_chunk", side_effect=write if ctx.rank("dp") == 1 else nvme._write_chunk):
        x, y = offload_batch(3)
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[offload_rows(ctx)]), y[offload_rows(ctx)]).backward()
        with pytest.raises((OSError, RuntimeError)) as info:
            opt.step()
        message = str(info.value)
    if ctx.rank("dp") == 1:
        assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
        assert nvme_dir in message and ".bin" in message, message
    else:
        assert isinstance(info.value, RuntimeError) and "other rank" in message, message
    with pytest.raises(RuntimeError, match="zero_grad"):  # the new params were staged over the gradients
        opt.step()
    for p, q in zip(sdp.module.parameters(), params):
        assert torch.equal(p, q), "a failed NVMe write changed the params"
    after = opt.state_dict()
    for k, v in state["optimizer"]["state"].items():
        for key, t in v.items():
            assert torch.equal(after["optimizer"]["state"][k][key], t), f"state {k}/{key} changed"
    for m, saved in zip(after["master"], state["master"]):
        assert torch.equal(m, saved)
    assert not glob.glob(os.path.join(nvme_dir, "rank*", "**", "*.tmp"), recursive=True)
    for step in range(3, 6):
        offload_train_step(base, base_opt, ctx, step, torch.float32)
        offload_train_step(sdp, opt, ctx, step, torch.float32)
    for p, q in zip(sdp.module.parameters(), base.module.parameters()):
        assert torch.equal(p, q)
    ctx.destroy()
    return type(info.value).__name__, message


@pytest.mark.parametrize("opt_name", ["fused_adamw", "torch_adamw"])
def test_nvme_full_disk_keeps_previous_state(dist_pool, tmp_path, opt_name) -> None:
    results = dist_pool.run(_full_disk, str(tmp_path), opt_name, world_size=2, timeout=120)
    assert [r[0] for r in results] == ["RuntimeError", "OSError"]


# ---- fp16 overflow -----------------------------------------------------------------------------
def _fp16_overflow(offload: str, nvme_dir: str) -> None:
    ctx = ParallelContext.from_world()
    scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1)
    sdp = ShardedDataParallel(
        offload_model(torch.float16),
        ctx,
        2,
        loss_scaler=scaler,
        offload=offload,
        nvme_dir=nvme_dir if offload == "nvme" else None,
    )
    opt = ZeroOptimizer(sdp, FusedAdamW, lr=1e-2)
    before = [p.detach().clone() for p in sdp.module.parameters()]
    x, y = offload_batch(0)
    opt.zero_grad()
    if ctx.rank("dp") == 1:  # only the rank owning the element sees the inf in its shard
        hook = sdp.module[0].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    scaler.scale_loss(nn.functional.mse_loss(sdp(x[offload_rows(ctx)].half()).float(), y[offload_rows(ctx)])).backward()
    if ctx.rank("dp") == 1:
        hook.remove()
    opt.step()
    assert opt.last_step_skipped and scaler.scale == 2.0**7
    assert all(torch.equal(p, q) for p, q in zip(sdp.module.parameters(), before))
    opt.zero_grad()
    scaler.scale_loss(nn.functional.mse_loss(sdp(x[offload_rows(ctx)].half()).float(), y[offload_rows(ctx)])).backward()
    opt.step()
    assert not opt.last_step_skipped
    assert not all(torch.equal(p, q) for p, q in zip(sdp.module.parameters(), before))
    ctx.destroy()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offload_fp16_overflow_skips_everywhere(dist_pool, tmp_path, offload) -> None:
    dist_pool.run(_fp16_overflow, offload, str(tmp_path), world_size=2, timeout=60)


# ---- bad arguments -----------------------------------------------------------------------------
def _bad_nvme_dir(tmp: str) -> None:
    ctx = ParallelContext.from_world()
    a_file = os.path.join(tmp, f"file{ctx.rank('dp')}")
    open(a_file, "w").close()
    cases = [
        (os.path.join(tmp, "missing"), "does not exist"),
        (a_file, "not a directory"),
        ("/proc", "not writable"),  # a read-only directory, even for root
    ]
    for bad, words in cases:
        # the check depends on this rank's machine: it is agreed over dp in the wrapper's first
        # collective (check_same_model's all-reduce) and nothing else runs
        stats = CommStats()
        with pytest.raises(ValueError, match=f"nvme_dir .*{words}"):
            ShardedDataParallel(offload_model(), ctx, 2, offload="nvme", nvme_dir=bad, stats=stats)
        summary = stats.summary()
        assert set(summary) == {"all_reduce"} and summary["all_reduce"]["calls"] == 1, summary
        assert summary["all_reduce"]["bytes"] == 8 * (6 + ctx.size("dp"))  # the model check + one flag per rank
    ctx.destroy()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="uses /proc as a read-only directory")
def test_nvme_dir_validated_in_the_first_collective_only(dist_pool, tmp_path) -> None:
    dist_pool.run(_bad_nvme_dir, str(tmp_path), world_size=2, timeout=60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opt_name", ["fused_adamw", "torch_adamw"])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offload_stage3_bitwise_equal_to_no_offload(dist_pool, tmp_path, offload, opt_name, dtype) -> None:
    """Stage 3 (only the param shard persists on the device) with the same offload contract."""
    dist_pool.run(_equal_to_no_offload, 3, offload, opt_name, dtype, str(tmp_path), 0.004, world_size=2, timeout=120)
