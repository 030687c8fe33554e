"""``save_checkpoint``/``load_checkpoint`` (DCP): resume, resharding, atomicity, corruption.

A run trains ``K`` steps, saves, and trains ``K`` more; every other run loads that checkpoint
in another layout (dp 2 ↔ 4, stage 1 ↔ 2, DataParallel, one process, FusedAdamW ↔ torch AdamW,
bf16 + fp32 master) and trains the same ``K`` steps on the same global batches. Same layout:
the final params must be bitwise equal (resume continues bitwise on CPU); another dp size or
wrapper reduces in another order, so: equal to the one-process tolerance (tests/tolerances.py).
A loader that dropped any piece of state (a moment, the step, a master, an lr) moves the
params far outside that tolerance within ``K`` Adam steps.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel import DataParallel, load_checkpoint, save_checkpoint
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32

GLOBAL_BATCH, IN, HID, OUT, K = 8, 16, 24, 8, 3
OPTS = {"fused": FusedAdamW, "torch": torch.optim.AdamW}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(IN, HID), nn.LayerNorm(HID), nn.Linear(HID, OUT)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, OUT))  # a buffer travels too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x)))) + self.shift


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return Net().to(dtype)


def _groups(module: nn.Module) -> list[dict]:
    """No decay and another lr for 1-D params: groups must survive the flattening and the reshard."""
    return [
        {"params": [p for p in module.parameters() if p.dim() >= 2]},
        {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3},
    ]


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g).to(dtype), torch.randn(GLOBAL_BATCH, OUT, generator=g).to(dtype)


def _build(kind: str, stage: int, opt: str, dtype: torch.dtype) -> tuple[nn.Module, object, nn.Module, slice]:
    """(model, optimizer, unwrapped module, this rank's rows) for kind zero / zero+cpu (optimizer
    offload) / dp / module."""
    kw = dict(lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)  # layouts are compared across orders of additions
    if kind == "module":
        m = _model(dtype)
        extra = {"master_weights": True} if (opt == "fused" and dtype != torch.float32) else {}
        return m, OPTS[opt](_groups(m), **kw, **extra), m, slice(None)
    ctx = ParallelContext.from_world()
    r, n = ctx.rank("dp"), ctx.size("dp")
    rows = slice(r * GLOBAL_BATCH // n, (r + 1) * GLOBAL_BATCH // n)
    if kind.startswith("zero"):
        offload = kind.partition("+")[2] or None
        # several buckets, pieces split params
        sdp = ShardedDataParallel(_model(dtype), ctx, stage, bucket_mb=0.002, offload=offload)
        return sdp, ZeroOptimizer(sdp, OPTS[opt], _groups(sdp.module), **kw), sdp.module, rows
    dp = DataParallel(_model(dtype), ctx)
    return dp, OPTS[opt](_groups(dp.module), **kw), dp.module, rows


def _train(model: nn.Module, opt: object, rows: slice, steps: range, dtype: torch.dtype) -> None:
    for step in steps:
        x, y = _batch(step, dtype)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rows]).float(), y[rows].float()).backward()
        opt.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full state (stage 3 keeps only shards: gather through full_state_dict)."""
    if isinstance(model, ShardedDataParallel):
        return model.full_state_dict()
    return {k: v.detach().clone() for k, v in getattr(model, "module", model).state_dict().items()}


def run_then_save(path: str, kind: str, stage: int, opt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Train K steps, save at K, train K more: the uninterrupted run's final params."""
    model, optim, module, rows = _build(kind, stage, opt, dtype)
    _train(model, optim, rows, range(K), dtype)
    save_checkpoint(path, model, optim, extra={"step": K, "note": "hello"})
    _train(model, optim, rows, range(K, 2 * K), dtype)
    return _params(model)


def load_then_run(
    path: str, kind: str, stage: int, opt: str, dtype: torch.dtype, resave: str | None = None, until: int = 2 * K
) -> dict:
    """A fresh run that loads the checkpoint (optionally saves it again at once) and trains on
    to step ``until``."""
    model, optim, module, rows = _build(kind, stage, opt, dtype)
    extra = load_checkpoint(path, model, optim)
    assert extra == {"step": K, "note": "hello"}
    if resave is not None:
        save_checkpoint(resave, model, optim, extra=extra)
    _train(model, optim, rows, range(extra["step"], until), dtype)
    return _params(model)


def _same(a: dict, b: dict, tol: dict | None) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if tol is None:
            assert torch.equal(a[k], b[k]), f"{k}: not bitwise equal, max diff {(a[k].float() - b[k].float()).abs().max()}"
        else:
            torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def zero2_dp2(dist_pool, tmp_path_factory) -> tuple[str, dict]:
    """A ZeRO-2, dp 2, FusedAdamW fp32 checkpoint at step K and the uninterrupted run's params."""
    path = str(tmp_path_factory.mktemp("ck") / "zero2")
    out = dist_pool.run(run_then_save, path, "zero", 2, "fused", torch.float32, world_size=2, timeout=60)
    _same(out[0], out[1], None)
    return path, out[0]


def test_resume_same_layout_is_bitwise(dist_pool, zero2_dp2) -> None:
    path, ref = zero2_dp2
    out = dist_pool.run(load_then_run, path, "zero", 2, "fused", torch.float32, world_size=2, timeout=60)
    _same(out[0], ref, None)


@pytest.mark.reduction_order
def test_reshard_dp2_to_dp4_and_back(dist_pool, zero2_dp2, tmp_path) -> None:
    """2 → 4 trains like one process; 4's re-save read back on 2 is the original state exactly."""
    path, ref = zero2_dp2
    back = str(tmp_path / "from4")
    out4 = dist_pool.run(load_then_run, path, "zero", 2, "fused", torch.float32, back, world_size=4, timeout=60)
    _same(out4[0], ref, FP32)
    out2 = dist_pool.run(load_then_run, back, "zero", 2, "fused", torch.float32, world_size=2, timeout=60)
    _same(out2[0], ref, None)


@pytest.mark.reduction_order
@pytest.mark.parametrize("kind, stage, opt", [("zero", 1, "torch"), ("dp", 0, "torch"), ("dp", 0, "fused")])
def test_load_into_stage1_and_dataparallel(dist_pool, zero2_dp2, kind: str, stage: int, opt: str) -> None:
    path, ref = zero2_dp2
    out = dist_pool.run(load_then_run, path, kind, stage, opt, torch.float32, world_size=2, timeout=60)
    _same(out[0], ref, FP32)


@pytest.mark.reduction_order
def test_stage3_both_ways(dist_pool, zero2_dp2, tmp_path) -> None:
    """ZeRO-2 dp 2 → ZeRO-3 dp 4 (params sharded: each rank reads only its pieces), whose re-save
    → ZeRO-1 dp 2: both train like one process from step K."""
    path, ref = zero2_dp2
    three = str(tmp_path / "from3")
    out = dist_pool.run(load_then_run, path, "zero", 3, "fused", torch.float32, three, world_size=4, timeout=60)
    _same(out[0], ref, FP32)
    out = dist_pool.run(load_then_run, three, "zero", 1, "torch", torch.float32, world_size=2, timeout=60)
    _same(out[0], ref, FP32)


@pytest.mark.reduction_order
def test_single_process_roundtrip_with_zero(dist_pool, zero2_dp2, tmp_path) -> None:
    """ZeRO dp 2 → one process (no torch.distributed) → its own save → ZeRO dp 4."""
    path, ref = zero2_dp2
    _same(load_then_run(path, "module", 0, "torch", torch.float32, resave=str(tmp_path / "one")), ref, FP32)
    out = dist_pool.run(load_then_run, str(tmp_path / "one"), "zero", 2, "fused", torch.float32, world_size=4, timeout=60)
    _same(out[0], ref, FP32)


def _read_all(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, full, read by DCP in this (non-distributed) process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items() if hasattr(m, "size")}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def test_bf16_with_master(dist_pool, tmp_path) -> None:
    """bf16 params + fp32 masters: resume (stage 2 → 1) is bitwise; loaded into dp 4, or into one
    process with FusedAdamW(master_weights=True), and saved again at once, every tensor (params,
    masters, moments) is the saved one bit for bit. (Training on after a dp change is not
    compared: bf16 forward/backward over other row splits rounds the gradients differently.)"""
    path = str(tmp_path / "bf16")
    ref = dist_pool.run(run_then_save, path, "zero", 2, "fused", torch.bfloat16, world_size=2, timeout=60)[0]
    out = dist_pool.run(load_then_run, path, "zero", 3, "fused", torch.bfloat16, world_size=2, timeout=60)
    _same(out[0], ref, None)
    out = dist_pool.run(load_then_run, path, "zero", 1, "fused", torch.bfloat16, world_size=2, timeout=60)
    _same(out[0], ref, None)
    saved = _read_all(path)
    assert any(k.startswith("master.") for k in saved) and saved["model.fc1.weight"].dtype == torch.bfloat16
    again = str(tmp_path / "from4")
    dist_pool.run(load_then_run, path, "zero", 2, "fused", torch.bfloat16, again, world_size=4, timeout=60)
    _same(_read_all(again), saved, None)
    load_then_run(path, "module", 0, "fused", torch.bfloat16, resave=str(tmp_path / "one"))
    _same(_read_all(str(tmp_path / "one")), saved, None)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_with_cpu_offload_resumes_bitwise(dist_pool, tmp_path, stage: int) -> None:
    """With offload the fp32 masters live on the CPU (``sb.master`` is None): the saved masters
    must still be loaded, not rebuilt from the bf16-rounded params (0.0078 off before the fix);
    into offload and into no offload alike."""
    path = str(tmp_path / "bf16cpu")
    ref = dist_pool.run(run_then_save, path, "zero+cpu", stage, "fused", torch.bfloat16, world_size=2, timeout=60)[0]
    for kind in ("zero+cpu", "zero"):
        out = dist_pool.run(load_then_run, path, kind, stage, "fused", torch.bfloat16, world_size=2, timeout=60)
        _same(out[0], ref, None)


def test_fp32_offload_checkpoint_has_no_master_entries(dist_pool, tmp_path) -> None:
    """fp32 params are their own master: no ``master.*`` keys, with offload too (docs/checkpoint.md)."""
    path = str(tmp_path / "fp32cpu")
    dist_pool.run(run_then_save, path, "zero+cpu", 2, "fused", torch.float32, world_size=2, timeout=60)
    assert not any(k.startswith("master.") for k in _read_all(path))


# ---- atomicity -----------------------------------------------------------------------------------
def crash_mid_save(path: str) -> dict[str, torch.Tensor]:
    """Save at step K, train one more step, then a second save whose rank-1 writer raises after
    writing part of its file: every rank raises, the step-K checkpoint stays loadable."""
    from torch.distributed.checkpoint import filesystem

    model, optim, module, rows = _build("zero", 2, "fused", torch.float32)
    _train(model, optim, rows, range(K), torch.float32)
    save_checkpoint(path, model, optim, extra={"step": K, "note": "hello"})
    at_k = _params(model)
    _train(model, optim, rows, range(K, K + 1), torch.float32)
    real = filesystem._write_files_from_queue
    if torch.distributed.get_rank() == 1:

        def broken(create_stream, file_queue, *args, **kwargs):  # type: ignore[no-untyped-def]
            file_name, storage_key, _ = file_queue.get()
            with create_stream(file_name, "wb") as f:
                f.write(b"half a shard")
            raise OSError("No space left on device (simulated)")

        filesystem._write_files_from_queue = broken
    try:
        with pytest.raises(RuntimeError, match=r"writing failed on ranks \[1\]: OSError: No space left"):
            save_checkpoint(path, model, optim, extra={"step": K + 1, "note": "hello"})
    finally:
        filesystem._write_files_from_queue = real
    torch.distributed.barrier()
    leftovers = sorted(p.name for p in Path(path).parent.iterdir())
    model2, optim2, module2, _ = _build("zero", 2, "fused", torch.float32)
    assert load_checkpoint(path, model2, optim2)["step"] == K
    _same(_params(model2), at_k, None)
    return {"leftovers": leftovers}


def test_crash_mid_save_keeps_previous_checkpoint(dist_pool, tmp_path) -> None:
    path = str(tmp_path / "ck")
    out = dist_pool.run(crash_mid_save, path, world_size=2, timeout=60)
    assert out[0]["leftovers"] == ["ck"], out[0]["leftovers"]  # the failed save's temp dir is gone


def test_a_save_removes_leftovers_of_killed_saves(tmp_path) -> None:
    """A save killed before its manifest leaves ``<dir>.tmp-*``; one killed between the renames
    leaves ``<dir>.old-*``: the next successful save removes both (and nothing else)."""
    for stale in ("ck.tmp-0123456789ab", "ck.old-ba9876543210"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "part.distcp").write_bytes(b"x" * 10)
    (tmp_path / "ck.tmp-notes.txt").write_text("a user's file")  # not a directory: kept
    (tmp_path / "other.tmp-0123456789ab").mkdir()  # another checkpoint's: kept
    model, optim, _, rows = _build("module", 0, "fused", torch.float32)
    _train(model, optim, rows, range(1), torch.float32)
    save_checkpoint(str(tmp_path / "ck"), model, optim)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.tmp-notes.txt", "other.tmp-0123456789ab"]


def test_interrupted_publish_falls_back_to_a_complete_copy(tmp_path) -> None:
    """A kill between the two renames leaves ``dir`` missing: load finds the complete sibling."""
    path = tmp_path / "ck"
    ref = load_then_run_single_save(path)
    os.rename(path, tmp_path / "ck.old-123")
    m, o, module, _ = _build("module", 0, "torch", torch.float32)
    with pytest.warns(UserWarning, match="interrupted"):
        assert load_checkpoint(path, m, o)["step"] == K
    _same(_params(module), ref, None)


def load_then_run_single_save(path: Path) -> dict[str, torch.Tensor]:
    model, optim, module, rows = _build("module", 0, "torch", torch.float32)
    _train(model, optim, rows, range(K), torch.float32)
    save_checkpoint(path, model, optim, extra={"step": K, "note": "hello"})
    return _params(model)


# ---- corrupt / mismatched checkpoints: a clear error, nothing overwritten -------------------------
def _corrupt_cases(src: Path, tmp: Path) -> list[tuple[str, Path, str]]:
    cases = []
    for what in ("missing", "truncated", "flipped", "no_manifest"):
        d = tmp / what
        shutil.copytree(src, d)
        shard = next(d.glob("*.distcp"))
        if what == "missing":
            shard.unlink()
        elif what == "truncated":
            shard.write_bytes(shard.read_bytes()[:-7])
        elif what == "flipped":
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        else:
            (d / "manifest.json").unlink()
        cases.append((what, d, {"no_manifest": "manifest"}.get(what, shard.name)))
    return cases


def test_corrupt_or_mismatched_checkpoint_raises_and_changes_nothing(tmp_path) -> None:
    src = tmp_path / "good"
    load_then_run_single_save(src)
    model, optim, module, rows = _build("module", 0, "torch", torch.float32)
    _train(model, optim, rows, range(1), torch.float32)  # some state of its own to protect
    before, opt_before = _params(module), optim.state_dict()
    cases = _corrupt_cases(src, tmp_path)
    for what, d, needle in cases:
        with pytest.raises(ValueError, match=needle):
            load_checkpoint(d, model, optim)
    other = _model()
    other.extra = nn.Linear(2, 2)  # a model with a parameter the checkpoint lacks
    with pytest.raises(ValueError, match="extra.weight"):
        load_checkpoint(src, other, torch.optim.AdamW(other.parameters()))
    wide = Net()
    wide.fc1 = nn.Linear(IN + 1, HID)  # a shape mismatch
    with pytest.raises(ValueError, match=r"fc1.weight.*shape"):
        load_checkpoint(src, wide, torch.optim.AdamW(_groups(wide)))
    with pytest.raises(ValueError, match="param group"):  # the groups differ
        load_checkpoint(src, model, torch.optim.AdamW(model.parameters()))
    _same(_params(module), before, None)
    after = optim.state_dict()
    for i, s in opt_before["state"].items():
        for k, v in s.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    assert after["param_groups"] == opt_before["param_groups"]


# ---- shardkit consolidate ---------------------------------------------------------------------
_TORCH_ONLY = """
import sys, torch
from torch import nn
IN, HID, OUT, GLOBAL_BATCH, K = {consts}
{net}
{groups}
{batch}
model = Net()
model.load_state_dict(torch.load(sys.argv[1] + "/model.pt", weights_only=True))
opt = torch.optim.AdamW(_groups(model))
opt.load_state_dict(torch.load(sys.argv[1] + "/optimizer.pt", weights_only=True))
x, y = _batch(K, torch.float32)
opt.zero_grad()
nn.functional.mse_loss(model(x), y).backward()
opt.step()
assert not [m for m in sys.modules if m.split(".")[0] in ("shardkit", "kernels", "comm", "parallel")], "shardkit imported"
torch.save(model.state_dict(), sys.argv[2])
"""


@pytest.mark.slow  # starts its own processes: run first (conftest.py)
@pytest.mark.reduction_order
def test_consolidate_cli_loads_with_torch_only(dist_pool, zero2_dp2, tmp_path) -> None:
    """``shardkit consolidate`` (one process, no torch.distributed) of the ZeRO-2 dp-2 checkpoint;
    a process importing only torch loads model.pt + optimizer.pt into a fresh model and
    torch.optim.AdamW, takes one step, and lands where the ZeRO run's step K+1 lands."""
    path, _ = zero2_dp2
    out = tmp_path / "export"
    cli = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "consolidate", path, str(out)], capture_output=True, text=True, timeout=120
    )
    assert cli.returncode == 0, cli.stderr
    assert sorted(os.listdir(out)) == ["model.pt", "optimizer.pt"]
    exported = torch.load(out / "optimizer.pt", weights_only=True)
    assert set(exported["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # fc1.weight, full shape
    assert exported["state"][0]["exp_avg"].shape == (HID, IN) and float(exported["state"][0]["step"]) == K
    consts = f"{IN}, {HID}, {OUT}, {GLOBAL_BATCH}, {K}"
    script = _TORCH_ONLY.format(
        consts=consts, net=inspect.getsource(Net), groups=inspect.getsource(_groups), batch=inspect.getsource(_batch)
    )
    script = script.replace("from __future__", "#")
    plain = subprocess.run(
        [sys.executable, "-c", script, str(out), str(tmp_path / "after.pt")], capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0, plain.stderr
    ref = dist_pool.run(load_then_run, path, "zero", 2, "fused", torch.float32, None, K + 1, world_size=2, timeout=60)
    _same(torch.load(tmp_path / "after.pt", weights_only=True), ref[0], FP32)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    (bad / ".metadata").write_bytes(b"")
    cli = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "consolidate", str(bad), str(tmp_path / "x")], capture_output=True, text=True
    )
    assert cli.returncode == 1 and ".metadata" in cli.stderr, cli.stderr
