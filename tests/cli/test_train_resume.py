"""``shardkit train --ckpt-dir --resume auto`` continues a run as if it had never stopped.

For each layout the demo trainer runs three times inside the test's ranks:

* A, the reference: 6 steps, saved once, after the last step (nothing saved on the way);
* B: the same 6 steps, saved every 2 steps;
* C: B's step-4 checkpoint, copied into a fresh directory (what a run killed after step 4's save
  leaves behind), resumed with ``--resume auto`` to step 6.

A's, B's and C's final checkpoints must hold bitwise the same parameters, optimizer state and
loss-scaler state, and C's reported loss history must be A's: a save changes nothing, and a
resume brings back the weights, optimizer moments and step, the data position, every rank's
dropout stream, the loss scale and the history. Dropout is on where the layout has a random
stream worth restoring (ddp: one per replica; tp: the replicated and the derived per-rank
streams). The resume at another world size (2 ranks → 1, same global batch) and the fallback
from a corrupt newest checkpoint are checked against A too.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tolerances import FP32

pytestmark = pytest.mark.slow  # three trainings per layout

SIZE = dict(steps=6, eval_every=3, eval_iters=1, d_model=32, n_layers=2, n_heads=2, seq_len=16, batch_size=4, device="cpu")

#: name -> TrainConfig fields (2 ranks)
LAYOUTS = {
    "ddp-dropout": dict(strategy="ddp", dropout=0.1),
    "zero2-fp16": dict(strategy="zero2", precision="fp16"),
    "zero3-async-save": dict(strategy="zero3", async_save=True),  # B and C write in the background
    "tp-dropout": dict(tp=2, dropout=0.1),
    "pp-zero1": dict(pp=2, microbatches=2, strategy="zero1"),
}


def _config(ckpt_dir: Path, **fields):  # noqa: ANN202 - TrainConfig
    from shardkit.train.config import TrainConfig

    return TrainConfig(**{**SIZE, "nproc": dist.get_world_size(), "ckpt_dir": str(ckpt_dir), **fields})


def _copy_on_rank0(src: Path, dst: Path) -> None:
    if dist.get_rank() == 0:
        dst.mkdir(parents=True)
        shutil.copytree(src, dst / src.name)
    dist.barrier()


def _three_runs(layout: str, tmp: str) -> dict:
    from shardkit.train import train

    root, fields = Path(tmp), LAYOUTS[layout]
    a = train(_config(root / "a", **fields))
    b = train(_config(root / "b", save_every=2, **fields))
    _copy_on_rank0(root / "b" / "step-00000004", root / "c")
    c = train(_config(root / "c", save_every=2, resume="auto", **fields))
    return {"a": (a.train_losses, a.evals, a.lrs), "b": b.train_losses, "c": (c.train_losses, c.evals, c.lrs)}


def _consolidated(ckpt: Path, out: Path) -> tuple[dict, dict]:
    from shardkit.consolidate import consolidate

    model, optim = consolidate(ckpt, out)
    return torch.load(model), torch.load(optim)


def _assert_bitwise(got: object, want: object, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, sorted(got), sorted(want))
        for key in want:
            _assert_bitwise(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_bitwise(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resumed_run_ends_bitwise_like_an_uninterrupted_one(dist_pool, tmp_path: Path, layout: str) -> None:
    out = dist_pool.run(_three_runs, layout, str(tmp_path), world_size=2, timeout=300)
    for rank in out:
        assert rank["c"] == rank["a"], f"resumed history differs: {rank['c']} vs {rank['a']}"
        assert rank["b"] == rank["a"][0], "saving every 2 steps changed the losses"
    final = "step-00000006"
    want_model, want_optim = _consolidated(tmp_path / "a" / final, tmp_path / "export-a")
    for run in ("b", "c"):
        model, optim = _consolidated(tmp_path / run / final, tmp_path / f"export-{run}")
        _assert_bitwise(model, want_model, f"{run}: model")
        _assert_bitwise(optim, want_optim, f"{run}: optimizer")
    from shardkit.parallel.checkpoint.api import load_meta

    want_scaler = load_meta(tmp_path / "a" / final)["scaler"]
    if LAYOUTS[layout].get("precision") == "fp16":  # saved (par.loss_scaler), and 6 steps counted
        assert want_scaler is not None and want_scaler["cur_iter"] == 6, want_scaler
    _assert_bitwise(load_meta(tmp_path / "c" / final)["scaler"], want_scaler, "scaler")
    # --keep 2: B kept its two newest
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-00000004", "step-00000006"]


def _train_two_ranks_with_and_without_saves(tmp: str) -> None:
    from shardkit.train import train

    root = Path(tmp)
    train(_config(root / "a", strategy="ddp"))
    train(_config(root / "b", strategy="ddp", save_every=2))


def test_resume_at_another_world_size_continues_the_same_run(dist_pool, tmp_path: Path) -> None:
    """2 ranks (ddp, batch 4 each) save at step 4; one process resumes it with batch 8."""
    from shardkit.train import train
    from shardkit.train.config import TrainConfig

    dist_pool.run(_train_two_ranks_with_and_without_saves, str(tmp_path), world_size=2, timeout=300)
    c = tmp_path / "c"
    c.mkdir()
    shutil.copytree(tmp_path / "b" / "step-00000004", c / "step-00000004")
    fields = {**SIZE, "batch_size": 2 * SIZE["batch_size"], "ckpt_dir": str(c), "resume": "auto", "strategy": "ddp"}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*sequences per step")  # the same global batch: not told
        result = train(TrainConfig(**fields))  # this process: a world of one
    a_model, a_optim = _consolidated(tmp_path / "a" / "step-00000006", tmp_path / "export-a")
    c_model, c_optim = _consolidated(c / "step-00000006", tmp_path / "export-c")
    for key, want in a_model.items():  # another order of additions (one rank sums what two did)
        torch.testing.assert_close(c_model[key], want, **FP32, msg=lambda m, key=key: f"{key}: {m}")
    assert c_optim["state"][0]["step"] == a_optim["state"][0]["step"]
    # the history before the resume is rank 0's of the 2-rank run, then this rank's own
    assert len(result.train_losses) == 6 and [s for s, _ in result.evals] == [3, 6]


def _corrupt_newest_then_resume(tmp: str) -> list[float]:
    from shardkit.train import train

    root = Path(tmp)
    a = train(_config(root / "a", strategy="zero2"))
    train(_config(root / "b", strategy="zero2", save_every=2, keep=3))
    if dist.get_rank() == 0:  # the newest loses its last bytes; a killed save leaves a .tmp dir
        shutil.copytree(root / "b", root / "c")
        shutil.rmtree(root / "c" / "step-00000002")
        victim = max(
            (p for p in (root / "c" / "step-00000006").iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
        )
        victim.write_bytes(victim.read_bytes()[:-16])
        (root / "c" / "step-00000008.tmp-0123456789ab").mkdir()
    dist.barrier()
    with pytest.warns(UserWarning, match="failed its checks") if dist.get_rank() == 0 else contextlib.nullcontext():
        c = train(_config(root / "c", strategy="zero2", save_every=2, resume="auto"))
    assert c.train_losses == a.train_losses
    return c.train_losses


def test_corrupt_newest_checkpoint_falls_back_to_the_one_before(dist_pool, tmp_path: Path) -> None:
    dist_pool.run(_corrupt_newest_then_resume, str(tmp_path), world_size=2, timeout=300)
    want, _ = _consolidated(tmp_path / "a" / "step-00000006", tmp_path / "export-a")
    got, _ = _consolidated(tmp_path / "c" / "step-00000006", tmp_path / "export-c")
    _assert_bitwise(got, want, "model")


def test_resume_with_another_global_batch_warns_naming_the_saved_one(tmp_path: Path) -> None:
    """One process saves with 4 sequences per step; a resume with 6 goes on (other batches) and says so."""
    from shardkit.train import train
    from shardkit.train.config import TrainConfig

    fields = {**SIZE, "steps": 2, "eval_every": 2, "ckpt_dir": str(tmp_path / "ckpt"), "strategy": "none"}
    train(TrainConfig(**fields))
    with pytest.warns(UserWarning, match=r"saved by a run of 4 sequences per step and this run takes 6.*--global-batch 4"):
        train(TrainConfig(**{**fields, "steps": 3, "batch_size": 6, "resume": "auto"}))
