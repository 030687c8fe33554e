"""``save_checkpoint`` / ``load_checkpoint``: sharded, atomic, reshardable checkpoints on DCP.

[Note: atomic publication]
Every rank writes into ``<dir>.tmp-<id>`` (global rank 0 creates it and broadcasts ``id``; every
role here is the global rank's, whatever the dp × tp × pp layout). After
DCP's own metadata is written and every rank's files are on disk (``sync_files``), each rank
checksums a share of the files, rank 0 writes ``meta.pt`` and, last, ``manifest.json`` (format
version, dp size, stage, DCP keys, size and CRC-32 of every file) and publishes with two
renames: the previous ``<dir>`` to ``<dir>.old-<id>``, then the new one into place; the old one
is deleted only after that. A crash before the manifest leaves ``<dir>`` untouched; a crash
between the renames leaves two complete checkpoints with manifests, and :func:`load_checkpoint`
falls back to the newest of them when ``<dir>`` itself is missing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from ..compose import ParallelModel
from ..durable_files import file_crc32, fsync_dir
from ..loss_scaler import DynamicLossScaler
from .content import Layout, dcp_state, layout_of, merge_meta, merge_model_meta, model_meta, save_content, transposed_keys
from .loading import apply_load, plan_load

__all__ = ["AsyncCheckpointer", "save_checkpoint", "load_checkpoint", "FORMAT_VERSION", "read_manifest", "verify_files"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
META = "meta.pt"
log = logging.getLogger("shardkit.checkpoint")


# ---- helpers over the (optional) world ---------------------------------------------------------
# ``group`` None: the default group. An asynchronous save runs its collectives on a group of its
# own from a background thread (:class:`AsyncCheckpointer`).
def _all_gather(layout: Layout, obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    if not layout.distributed:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(layout: Layout, obj: Any) -> Any:
    if not layout.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier(layout: Layout, group: dist.ProcessGroup | None = None) -> None:
    if layout.distributed:
        dist.barrier(group=group)


def _agree(layout: Layout, errors: list[str], what: str) -> None:
    """Raise the same ValueError on every rank if any rank found a problem."""
    every = [e for errs in _all_gather(layout, errors) for e in errs]
    if every:
        uniq = list(dict.fromkeys(every))
        raise ValueError(f"{what}: " + "; ".join(uniq[:8]) + (f" (+{len(uniq) - 8} more)" if len(uniq) > 8 else ""))


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialized: here that
    is the intent (a single-process run, or ``shardkit consolidate``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _is_checkpoint_or_empty(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and ((path / MANIFEST).exists() or not any(path.iterdir())))


# ---- save --------------------------------------------------------------------------------------
def save_checkpoint(
    dir: str | os.PathLike,
    model: nn.Module | ParallelModel,
    optimizer: Any,
    scaler: DynamicLossScaler | None = None,
    extra: Any = None,
) -> None:
    """Save model, optimizer (and loss scaler, ``extra``) as a sharded, atomic DCP checkpoint.

    Call on every rank. Each ZeRO rank writes only the pieces it owns (params, fp32 masters and
    optimizer state of its shard); DataParallel and single-process runs write full tensors once;
    a tp rank writes its slices as chunks of the dense tensors, a pipeline rank its blocks keyed
    by block index (docs/checkpoint.md, "With tensor and pipeline parallelism"). The content
    does not depend on the layout: it loads into another dp or tp size, another ZeRO stage,
    DataParallel or one process, another pp split of the same blocks (:func:`load_checkpoint`),
    and ``shardkit consolidate``
    turns it into plain ``torch.save`` files. Publication is atomic (see [Note: atomic
    publication]): a crash mid-save leaves the previous checkpoint at ``dir`` loadable.

    Args:
        dir: the checkpoint directory (replaced if it holds a previous checkpoint).
        model: the :class:`~shardkit.parallel.ParallelModel` of :func:`~shardkit.parallel.parallelize`
            (any dp × tp × pp layout), a :class:`~shardkit.parallel.ShardedDataParallel` (also
            ZeRO under a pipeline), a :class:`~shardkit.parallel.DataParallel` or a plain
            ``nn.Module`` (one process, replicated on every rank, or tp-converted).
        optimizer: the model's :class:`~shardkit.parallel.ZeroOptimizer`, or a
            ``torch.optim.Optimizer`` (shardkit's fused ones included) over the module's params.
        scaler: a :class:`~shardkit.parallel.DynamicLossScaler` whose state to save.
        extra: anything picklable (RNG states, data position), rank 0's value is saved.

    Raises:
        TypeError: mismatched ``model``/``optimizer`` kinds.
        ValueError: ``dir`` exists and is neither empty nor a checkpoint.

    Example:
        >>> extra = {"step": step, "rng": torch.get_rng_state(), "data_pos": loader_pos}
        >>> save_checkpoint("ckpt/latest", sdp, opt, scaler=None, extra=extra)
    """
    job = _prepare_save(Path(dir), model, optimizer, scaler, extra, stage=False)
    job.write()


@dataclass
class _SaveJob:
    """A save whose content is taken (collective on the default group, on the calling thread);
    :meth:`write` writes, verifies and publishes it (collective on ``group``)."""

    layout: Layout
    final: Path
    tmp: Path
    state: dict[str, Any]
    metas: list[Any]
    meta_extra: dict[str, Any]
    t0: float
    t1: float

    def write(self, group: dist.ProcessGroup | None = None) -> None:
        layout, final, tmp = self.layout, self.final, self.tmp
        try:
            try:
                with _quiet_single_process():
                    md = dcp.save(self.state, checkpoint_id=tmp, process_group=group, no_dist=not layout.distributed)
            except CheckpointException as e:  # a BaseException, raised on every rank: make it an error
                raise RuntimeError(f"checkpoint {final}: writing failed on ranks {sorted(e.failures)}: {_first(e)}") from e
            t2 = time.perf_counter()
            if layout.rank == 0:
                shapes, aliases, order = merge_model_meta(self.metas)
                meta = {
                    "format": FORMAT_VERSION,
                    "kind": layout.kind,
                    "dp_size": layout.axes["dp"],
                    "axes": layout.axes,
                    "world_size": layout.size,
                    "stage": layout.stage,
                    "shapes": shapes,
                    "aliases": aliases,
                    # [Note: Conv1D weights in checkpoints] in content.py
                    "transposed": sorted({k for loc in self.metas for k in loc.transposed}),
                    "param_order": order,
                    "masters": sorted(k.removeprefix("master.") for k in md.state_dict_metadata if k.startswith("master.")),
                    "optim": {"class": self.meta_extra["optimizer_class"], **merge_meta(self.metas, order)},
                    "scaler": self.meta_extra["scaler"],
                    "extra": self.meta_extra["extra"],
                }
                torch.save(meta, tmp / META)
            _barrier(layout, group)
            files = sorted(p.name for p in tmp.iterdir())
            sums = {f: (os.path.getsize(tmp / f), file_crc32(tmp / f)) for f in files[layout.rank :: layout.size]}
            sums = {k: v for part in _all_gather(layout, sums, group) for k, v in part.items()}
            t3 = time.perf_counter()
            if layout.rank == 0:
                _publish(tmp, final, layout, sorted(md.state_dict_metadata), sums)
                nbytes = sum(n for n, _ in sums.values())
                log.info(
                    "checkpoint %s: gather %.2fs, DCP write %.1f MiB in %.2fs (%.0f MiB/s), checksums %.2fs, publish %.2fs",
                    final,
                    self.t1 - self.t0,
                    nbytes / 2**20,
                    t2 - self.t1,
                    nbytes / 2**20 / max(t2 - self.t1, 1e-9),
                    t3 - t2,
                    time.perf_counter() - t3,
                )
        except BaseException:
            if layout.rank == 0:  # best effort: the previous checkpoint at `final` was never touched
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        _barrier(layout, group)


def _staged(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _prepare_save(
    final: Path, model: nn.Module | ParallelModel, optimizer: Any, scaler: DynamicLossScaler | None, extra: Any, *, stage: bool
) -> _SaveJob:
    """Check ``final``, create its temporary directory and take this rank's content (collective on
    the default group). ``stage``: copy every tensor to host memory, so training may go on
    changing the originals while the job writes."""
    t0 = time.perf_counter()
    layout = layout_of(model, optimizer)
    problem = [] if layout.rank != 0 or _is_checkpoint_or_empty(final) else [f"{final} exists and is not a checkpoint"]
    _agree(layout, problem, "dir")
    tmp = final.parent / f"{final.name}.tmp-{_broadcast(layout, uuid.uuid4().hex[:12])}"
    if layout.rank == 0:
        tmp.mkdir(parents=True)
    _barrier(layout)
    try:
        local = save_content(layout, optimizer)
        if stage:
            local.entries = {k: _staged(v) for k, v in local.entries.items()}
            local.pieces = {k: (n, [(o, _staged(c)) for o, c in chunks]) for k, (n, chunks) in local.pieces.items()}
        metas = _all_gather(layout, local.meta())
    except BaseException:
        if layout.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta_extra = {
        "optimizer_class": _qualname(optimizer),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": copy.deepcopy(extra) if stage else extra,  # a snapshot: the caller may change it
    }
    return _SaveJob(layout, final, tmp, dcp_state(local), metas, meta_extra, t0, time.perf_counter())


class AsyncCheckpointer:
    """:func:`save_checkpoint` in the background: the step loop goes on while the files are written.

    :meth:`save` takes the content on the calling thread (a collective: every rank at the same
    step) and copies every tensor to host memory, then a background thread writes, checksums and
    publishes it with the same atomic rule as :func:`save_checkpoint`, its collectives on a gloo
    group of its own (created at the first save, on every rank). One save is in flight at a time:
    the next :meth:`save` (or :meth:`wait`) waits for the previous one and raises its error, if it
    had one. The data files are those :func:`save_checkpoint` writes for the same content.

    Costs: host memory for one copy of this rank's checkpoint content while a save is in flight;
    the copy itself on the calling thread.

    Example:
        >>> saver = AsyncCheckpointer()
        >>> for step in range(steps):
        ...     train_step()
        ...     if step % 100 == 0:
        ...         saver.save(f"ckpt/step{step}", par, opt, scaler=par.loss_scaler, extra={"step": step})
        >>> saver.close()                                   # waits for the last one
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: Path | None = None

    def save(
        self,
        dir: str | os.PathLike,
        model: nn.Module | ParallelModel,
        optimizer: Any,
        scaler: DynamicLossScaler | None = None,
        extra: Any = None,
        *,
        on_done: Callable[[Path], None] | None = None,
    ) -> None:
        """Start saving ``dir`` (see the class docstring); ``on_done(dir)`` runs on the background
        thread after the checkpoint is published (e.g. deleting older ones).

        Raises:
            ValueError, TypeError: as :func:`save_checkpoint`, before anything is written.
            RuntimeError: the previous save failed (its error is chained).
        """
        self.wait()
        job = _prepare_save(Path(dir), model, optimizer, scaler, extra, stage=True)
        if job.layout.distributed and self._group is None:
            self._group = dist.new_group(backend="gloo")  # every rank, at its first save
        self._pending = job.final
        self._thread = threading.Thread(target=self._write, args=(job, on_done), name="shardkit-checkpoint", daemon=True)
        self._thread.start()

    def _write(self, job: _SaveJob, on_done: Callable[[Path], None] | None) -> None:
        try:
            job.write(self._group)
            if on_done is not None:
                on_done(job.final)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = e

    @property
    def pending(self) -> Path | None:
        """The directory being written, or None."""
        return self._pending if self._thread is not None and self._thread.is_alive() else None

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint {self._pending}: the background save failed: {error}") from error

    def close(self) -> None:
        """Wait for the last save and free the background group."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _first(e: CheckpointException) -> str:
    exc = next(iter(e.failures.values()))[0]
    return f"{type(exc).__name__}: {exc}"


def _qualname(obj: Any) -> str:
    inner = getattr(obj, "optimizer", obj)
    return f"{type(inner).__module__}.{type(inner).__qualname__}"


def _publish(tmp: Path, final: Path, layout: Layout, keys: list[str], sums: dict[str, tuple[int, int]]) -> None:
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": layout.kind,
        "dp_size": layout.axes["dp"],
        "tp_size": layout.axes["tp"],
        "pp_size": layout.axes["pp"],
        "stage": layout.stage,
        "created": time.time(),
        "keys": keys,
        "files": {f: {"bytes": n, "crc32": c} for f, (n, c) in sorted(sums.items())},
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    old = final.parent / f"{final.name}.old-{tmp.name.rsplit('-', 1)[1]}"
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    # leftovers of earlier saves that were killed (before their manifest, or between the two
    # renames): a complete checkpoint now exists at ``final``, so they are never read again
    for stale in final.parent.glob(f"{final.name}.*-*"):
        if stale.name.rsplit("-", 1)[0] in (f"{final.name}.tmp", f"{final.name}.old") and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


# ---- load --------------------------------------------------------------------------------------
def _resolve(final: Path) -> Path:
    """``final``, or when it is missing (a crash between the two renames) the newest complete
    sibling ``.tmp-*``/``.old-*`` checkpoint."""
    if (final / MANIFEST).exists() or final.exists():
        return final
    candidates = []
    for p in final.parent.glob(f"{final.name}.*-*"):
        if p.name.rsplit("-", 1)[0] in (f"{final.name}.tmp", f"{final.name}.old") and (p / MANIFEST).exists():
            try:
                candidates.append((json.loads((p / MANIFEST).read_text())["created"], p))
            except (ValueError, KeyError):
                continue
    if not candidates:
        return final
    best = max(candidates)[1]
    warnings.warn(f"{final} is missing (a save was interrupted while publishing); loading {best}", stacklevel=3)
    return best


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's ``manifest.json`` (ValueError naming the file if missing or unreadable).

    Example:
        >>> read_manifest("ckpt/latest")["dp_size"]
        2
    """
    f = Path(path) / MANIFEST
    try:
        manifest = json.loads(f.read_text())
    except FileNotFoundError:
        raise ValueError(f"{f}: no manifest (not a shardkit checkpoint, or its save never finished)") from None
    except ValueError as e:
        raise ValueError(f"{f}: unreadable manifest ({e})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{f}: format_version {manifest.get('format_version')!r}, this shardkit reads {FORMAT_VERSION}")
    return manifest


def verify_files(path: str | os.PathLike, manifest: dict[str, Any], rank: int = 0, size: int = 1) -> list[str]:
    """Problems with the checkpoint's files: missing, wrong size (truncated), wrong CRC-32.

    Sizes are checked for every file; CRCs for this rank's share (``files[rank::size]``).
    """
    root, errors = Path(path), []
    files = sorted(manifest["files"])
    for i, name in enumerate(files):
        want, f = manifest["files"][name], root / name
        if not f.exists():
            errors.append(f"file {f}: missing")
        elif f.stat().st_size != want["bytes"]:
            errors.append(f"file {f}: {f.stat().st_size} bytes, the manifest says {want['bytes']} (truncated?)")
        elif i % size == rank and file_crc32(f) != want["crc32"]:
            errors.append(f"file {f}: CRC-32 mismatch (corrupt)")
    return errors


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's ``meta.pt`` (shapes, optimizer groups and scalars, scaler, ``extra``)."""
    # weights_only=False: ``extra`` is any picklable object the user saved (its own checkpoint)
    return torch.load(Path(path) / META, map_location="cpu", weights_only=False)


def load_checkpoint(
    dir: str | os.PathLike,
    model: nn.Module | ParallelModel,
    optimizer: Any,
    scaler: DynamicLossScaler | None = None,
    *,
    optimizer_state: bool = True,
) -> Any:
    """Load a :func:`save_checkpoint` directory into this run's layout; returns ``extra``.

    Works across layouts: another dp or tp size, another ZeRO stage, DataParallel or one process,
    another pp split of the same blocks, and FusedAdamW ↔ torch.optim.AdamW. Every rank reads only the pieces its layout needs, into
    temporaries; the files are verified (sizes, CRC-32 split over the ranks) and every key and
    shape is checked BEFORE anything is copied into ``model``/``optimizer``/``scaler``, so a bad
    checkpoint raises on every rank and changes nothing. Params are loaded first, then the
    fp32 masters (ZeRO, or a fused optimizer's ``master_param``), then the optimizer state and
    its groups' hyperparameters (matched by group index and parameter names).

    Args:
        dir: a checkpoint directory written by :func:`save_checkpoint`.
        model, optimizer, scaler: as for :func:`save_checkpoint`, in this run's layout.
        optimizer_state: False loads the weights and their fp32 masters only (a warm start):
            the optimizer keeps its state and hyperparameters, its param groups need not match
            the checkpoint's, and ``scaler`` must be None.

    Returns:
        The ``extra`` object given to :func:`save_checkpoint` (rank 0's).

    Raises:
        ValueError: a missing/truncated/corrupt file, a missing key, a shape mismatch, a model
            or optimizer groups that differ from the checkpoint's (the message names the
            file or key) — on every rank, before anything is overwritten.
        RuntimeError: DCP failed to read a file the manifest vouched for.

    Example:
        >>> extra = load_checkpoint("ckpt/latest", sdp, opt)
        >>> torch.set_rng_state(extra["rng"]); step = extra["step"]
    """
    if not optimizer_state and scaler is not None:
        raise ValueError("scaler: must be None with optimizer_state=False (the loss scale is optimizer state)")
    t0 = time.perf_counter()
    layout = layout_of(model, optimizer)
    path = _resolve(Path(dir))
    errors: list[str] = []
    try:
        manifest = read_manifest(path)
        errors = verify_files(path, manifest, layout.rank, layout.size)
    except ValueError as e:
        errors = [str(e)]
    _agree(layout, errors, f"checkpoint {path}")
    meta = load_meta(path)
    saved = {
        k: tuple(m.size) for k, m in FileSystemReader(path).read_metadata().state_dict_metadata.items() if hasattr(m, "size")
    }
    shapes, aliases = model_meta(layout)
    world_keys = {k for part in _all_gather(layout, [*shapes, *aliases]) for k in part}
    plan = plan_load(layout, optimizer, meta, saved, world_keys, optimizer_state)
    # [Note: Conv1D weights in checkpoints] in content.py: a key held the other way round
    mine, theirs = set(transposed_keys(layout.module)), set(meta.get("transposed", ()))
    flipped = sorted(k for k in shapes if (k in mine) != (k in theirs))
    if flipped:
        plan.errors.append(
            f"{flipped[:3]}{' ...' if len(flipped) > 3 else ''}: stored as a TP plan's linear layout [out, in] and held "
            "here as a Hugging Face Conv1D [in, out] (or the other way round); load into the same TP plan "
            "(tensor_parallel size > 1), or export with `shardkit consolidate` / fp32_state_dict, which give "
            "the Conv1D layout"
        )
    if scaler is not None and meta["scaler"] is None:
        plan.errors.append("scaler: the checkpoint holds no loss-scaler state (meta.pt)")
    _agree(layout, plan.errors, f"checkpoint {path}")
    t1 = time.perf_counter()
    try:
        with _quiet_single_process():
            dcp.load(plan.request, checkpoint_id=path, no_dist=not layout.distributed)
    except CheckpointException as e:  # the same on every rank
        raise RuntimeError(f"checkpoint {path}: reading failed on ranks {sorted(e.failures)}: {_first(e)}") from e
    t2 = time.perf_counter()
    apply_load(layout, optimizer, meta, plan, optimizer_state)
    if scaler is not None:
        scaler.load_state_dict(meta["scaler"])
    if layout.rank == 0:
        log.info("checkpoint %s: verify %.2fs, DCP read %.2fs, apply %.2fs", path, t1 - t0, t2 - t1, time.perf_counter() - t2)
    return meta["extra"]
