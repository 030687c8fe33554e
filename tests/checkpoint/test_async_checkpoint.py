"""``AsyncCheckpointer``: a checkpoint written in the background while training goes on holds
exactly what a synchronous ``save_checkpoint`` at the same step holds, file for file.

Both are taken after step 2 of a ZeRO-2 run on 2 ranks; the asynchronous one is still being
written while steps 3-4 change the parameters and optimizer state it was taken from (the copy to
host memory is what makes that safe). The manifests (size and CRC-32 of every data file) must
be equal, and both load back into a fresh model to the same state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


def _model_and_optimizer():  # noqa: ANN202 - (par, opt)
    from shardkit.comm import ParallelContext
    from shardkit.kernels import FusedAdamW
    from shardkit.models import TinyGPT
    from shardkit.parallel import parallelize

    ctx = ParallelContext.from_world()
    torch.manual_seed(0)
    par = parallelize(TinyGPT(59, d_model=32, n_layers=2, n_heads=2, seq_len=16), ctx, dp="zero2")
    return par, par.make_optimizer(FusedAdamW, par.parameters(), lr=1e-2)


def _step(par, opt, seed: int) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x = torch.randint(59, (4, 16), generator=gen)
    opt.zero_grad(set_to_none=True)
    par.forward_backward(x, x)
    par.step(opt)


def _sync_and_async_at_the_same_step(tmp: str) -> dict:
    from shardkit.parallel import AsyncCheckpointer, load_checkpoint, save_checkpoint

    root = Path(tmp)
    par, opt = _model_and_optimizer()
    for seed in range(2):
        _step(par, opt, seed)
    extra = {"step": 2, "rng": torch.get_rng_state()}
    save_checkpoint(root / "sync", par, opt, extra=extra)
    saver = AsyncCheckpointer()
    saver.save(root / "async", par, opt, extra=extra)
    extra["step"] = 99  # the caller changes its own object: the save took a snapshot
    for seed in range(2, 4):  # training goes on while the files are written
        _step(par, opt, seed)
    saver.close()
    # both load into a fresh model: the same state, which is step 2's, not step 4's
    states = {}
    for name in ("sync", "async"):
        fresh, fresh_opt = _model_and_optimizer()
        got = load_checkpoint(root / name, fresh, fresh_opt)
        states[name] = (got["step"], [p.detach().clone() for p in fresh.parameters()])
    now = [p.detach().clone() for p in par.parameters()]
    return {
        "steps": (states["sync"][0], states["async"][0]),
        "equal": all(torch.equal(a, b) for a, b in zip(states["sync"][1], states["async"][1], strict=True)),
        "differs_from_step_4": any(not torch.equal(a, b) for a, b in zip(states["sync"][1], now, strict=True)),
    }


def test_background_save_holds_what_a_synchronous_save_holds(dist_pool, tmp_path: Path) -> None:
    out = dist_pool.run(_sync_and_async_at_the_same_step, str(tmp_path), world_size=2, timeout=120)
    for rank in out:
        assert rank["steps"] == (2, 2) and rank["equal"] and rank["differs_from_step_4"], rank
    sync = json.loads((tmp_path / "sync" / "manifest.json").read_text())
    background = json.loads((tmp_path / "async" / "manifest.json").read_text())
    # every data file's size and CRC-32 (DCP's .metadata also records the directory's own name)
    data = {name for name in sync["files"] if name != ".metadata"}
    assert data and data == {name for name in background["files"] if name != ".metadata"}
    assert {n: sync["files"][n] for n in data} == {n: background["files"][n] for n in data}
    assert not list(tmp_path.glob("*.tmp-*"))  # published, nothing half-written left


def _refused_before_anything_is_written(tmp: str) -> str:
    from shardkit.parallel import AsyncCheckpointer

    par, opt = _model_and_optimizer()
    path = Path(tmp) / "a-file"
    if dist.get_rank() == 0:
        path.write_text("not a checkpoint")
    dist.barrier()
    with AsyncCheckpointer() as saver, pytest.raises(ValueError, match="exists and is not a checkpoint") as info:
        saver.save(path, par, opt)
    return str(info.value)


def test_a_bad_directory_is_refused_on_the_calling_thread(dist_pool, tmp_path: Path) -> None:
    out = dist_pool.run(_refused_before_anything_is_written, str(tmp_path), world_size=2, timeout=60)
    assert len(set(out)) == 1
