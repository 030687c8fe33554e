"""The checkpoints of a ``shardkit train`` run: where they go, what they hold, which one a restart takes.

[Note: resuming a training run]
``--ckpt-dir DIR --save-every N`` saves ``DIR/step-00000N`` every N steps and after the last
step, through :func:`~shardkit.parallel.save_checkpoint` (sharded, atomic: a step directory
exists only once it is complete, so a kill during a save leaves the previous one the newest),
then deletes all but the newest ``--keep``. ``--resume auto`` loads the newest complete one, or
starts fresh when there is none; when the newest fails its checks (a truncated or corrupt file)
it warns and takes the one before. What comes back, beyond the model, optimizer and loss scaler:

* the step, and the data position: the batch generator's state (the same on every rank);
* every rank's random state (CPU, and CUDA when training there): dropout draws the same masks
  as the uninterrupted run would have. At the same world size each rank takes its own, so the
  final weights are bitwise those of a run that was never stopped (CPU; tests/cli). At another
  world size the ranks have no saved state of their own: each reseeds its dropout stream from
  (seed, step, its dp and pp rank), and the run continues on other masks;
* the loss, lr and eval history and the skipped-step count, so the summary, ``--log-json`` and
  ``--plot`` cover the whole run, not only the last attempt.

The batch a step draws depends on the global batch (``--batch-size`` × dp) only, not on how it is
split: resuming at another world size with the same global batch sees the same rows.
"""

from __future__ import annotations

import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkit.parallel import AsyncCheckpointer, ParallelModel, load_checkpoint, save_checkpoint
from shardkit.parallel.checkpoint.api import MANIFEST

__all__ = ["RunHistory", "checkpoint_dir", "complete_checkpoints", "resume_run", "save_run"]

_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint saved after ``step``.

    Example:
        >>> checkpoint_dir("ckpt", 120).name
        'step-00000120'
    """
    return Path(root) / f"step-{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every complete checkpoint under ``root``, newest first.

    Complete: named ``step-N`` and holding a manifest (written last by a save). A save in progress
    or killed lives in ``step-N.tmp-<id>`` and is never listed.

    Example:
        >>> complete_checkpoints("ckpt")          # doctest: +SKIP
        [(200, PosixPath('ckpt/step-00000200')), (150, PosixPath('ckpt/step-00000150'))]
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


@dataclass
class RunHistory:
    """What a run has done so far, saved with each checkpoint (this rank's view).

    Attributes:
        step: optimizer steps taken.
        train_loss: this rank's loss per step (floats).
        lrs: the learning rate per step.
        evals: ``(step, eval loss)`` pairs.
        skipped_steps: fp16 steps skipped on overflow.
        resumed_from: ``(step, dir)`` of the checkpoint this attempt started from, or None.
    """

    step: int = 0
    train_loss: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: int = 0
    resumed_from: tuple[int, str] | None = None


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _random_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_run(
    root: str | Path,
    par: ParallelModel,
    optimizer: Any,
    history: RunHistory,
    *,
    data_generator: torch.Generator,
    device: torch.device,
    keep: int = 2,
    saver: AsyncCheckpointer | None = None,
    global_batch: int | None = None,
) -> Path:
    """Save the run after ``history.step`` to ``checkpoint_dir(root, step)``; keep the newest ``keep``.

    Collective: call on every rank at the same step. Every rank's random state and history are
    gathered into the checkpoint's ``extra`` (rank 0 writes it).

    Args:
        root: ``--ckpt-dir``.
        par: the run's model; its loss scaler is saved with it.
        optimizer: the run's optimizer (``par.make_optimizer``'s).
        history: this rank's history, ``history.step`` steps done.
        data_generator: the batch generator (its state is the data position).
        device: this rank's device (for the CUDA random state).
        keep: complete checkpoints to keep, this one included (older ones are deleted after this
            one is published).
        saver: write in the background through this :class:`~shardkit.parallel.AsyncCheckpointer`
            (returns once the content is copied to host memory; older checkpoints are deleted
            when it is published); None: write before returning.
        global_batch: sequences per step over all replicas, recorded so that a resume with
            another batch is told (:func:`resume_run`).

    Returns:
        The checkpoint directory.

    Example:
        >>> save_run("ckpt", par, opt, history, data_generator=gen, device=torch.device("cpu"))  # doctest: +SKIP
        PosixPath('ckpt/step-00000100')
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    rank, world = _world()
    mine = {"random": _random_state(device), "history": asdict(history)}  # plain data in the file
    every: list[Any] = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    extra = {
        "step": history.step,
        "world_size": world,
        "global_batch": global_batch,
        "data_generator": data_generator.get_state(),
        "random": [r["random"] for r in every],
        "history": [r["history"] for r in every],
    }
    path = checkpoint_dir(root, history.step)  # the save creates root with its temporary directory

    def prune(_: Path) -> None:
        if rank == 0:
            for _, old in complete_checkpoints(root)[keep:]:
                shutil.rmtree(old, ignore_errors=True)

    if saver is not None:
        saver.save(path, par, optimizer, scaler=par.loss_scaler, extra=extra, on_done=prune)
    else:
        save_checkpoint(path, par, optimizer, scaler=par.loss_scaler, extra=extra)
        prune(path)
    return path


def resume_run(
    root: str | Path,
    par: ParallelModel,
    optimizer: Any,
    *,
    data_generator: torch.Generator,
    device: torch.device,
    reseed: int,
    global_batch: int | None = None,
) -> RunHistory | None:
    """Load the newest complete checkpoint under ``root`` into this run; None when there is none.

    Collective. A checkpoint that fails its checks (``load_checkpoint`` raises ``ValueError`` on
    every rank alike, before changing anything) is skipped with a warning for the one before it.
    Restores ``data_generator`` and this rank's random state (see [Note: resuming a training run]
    for another world size, where ``torch.manual_seed(reseed + step)`` is used instead).

    Args:
        root: ``--ckpt-dir``.
        par, optimizer: this run's, built as the saved run built them (any layout).
        data_generator: the batch generator, set to the saved data position.
        device: this rank's device.
        reseed: this rank's dropout seed base, for a resume at another world size.
        global_batch: this run's sequences per step over all replicas: a checkpoint saved with
            another batch is loaded with a warning (the run goes on with other batches).

    Returns:
        This rank's :class:`RunHistory` as saved (rank 0's at another world size), with
        ``resumed_from`` set; or None.

    Raises:
        ValueError: every complete checkpoint under ``root`` failed its checks.
    """
    rank, world = _world()
    candidates = complete_checkpoints(root)
    if world > 1:  # rank 0's listing: a shared directory read at slightly different times must agree
        box = [candidates]
        dist.broadcast_object_list(box, src=0)
        candidates = box[0]
    failures = []
    for step, path in candidates:
        t0 = time.perf_counter()
        try:
            extra = load_checkpoint(path, par, optimizer, scaler=par.loss_scaler)
        except ValueError as e:
            failures.append(f"{path}: {e}")
            if rank == 0:
                warnings.warn(f"checkpoint {path} failed its checks, trying the one before it: {e}", stacklevel=2)
            continue
        data_generator.set_state(extra["data_generator"])
        same_world = extra["world_size"] == world
        saved = dict(extra["history"][rank if same_world else 0])
        saved["evals"] = [tuple(e) for e in saved["evals"]]
        history = RunHistory(**saved)
        if same_world:
            random = extra["random"][rank]
            torch.set_rng_state(random["cpu"])
            if "cuda" in random and device.type == "cuda":
                torch.cuda.set_rng_state(random["cuda"], device)
        else:
            torch.manual_seed(reseed + step)
        history.resumed_from = (step, str(path))
        par.skipped_steps = history.skipped_steps
        saved_batch = extra.get("global_batch")
        if rank == 0 and None not in (saved_batch, global_batch) and saved_batch != global_batch:
            warnings.warn(
                f"checkpoint {path} was saved by a run of {saved_batch} sequences per step and this run takes "
                f"{global_batch}: it goes on with other batches than the saved run would have (to continue that "
                f"run, pass --global-batch {saved_batch}, or a --batch-size that makes {saved_batch})",
                stacklevel=2,
            )
        if rank == 0:
            print(
                f"resumed from {path} (step {step}, saved by {extra['world_size']} rank(s)) in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        return history
    if failures:
        raise ValueError("no loadable checkpoint under " + str(root) + ": " + "; ".join(failures))
    return None
