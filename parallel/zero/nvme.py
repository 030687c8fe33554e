"""ZeRO-Infinity-style NVMe offload: fp32 masters and optimizer state in files, streamed per bucket.

``ShardedDataParallel(..., offload="nvme", nvme_dir=D)`` keeps, per rank, one file per bucket
(the *sub-group* of the stream) holding that bucket's fp32 master ``[shard]`` and the wrapped
optimizer's state for the bucket's shard params, as raw bytes in a fixed order (the shapes,
dtypes and non-tensor values are kept in memory: the files are swap space, not a checkpoint —
``opt.state_dict()`` is the checkpoint). Host memory holds the gradient buffers (4 bytes per
shard element, +2 for bf16 gradients' staging; filled during backward) and about three
sub-groups at a time; the device holds nothing of the optimizer.

[Note: NVMe step and commit]
One step streams the buckets: a reader thread loads sub-group k+1 while sub-group k is
materialized (shard params pointed at its master, ``.grad`` at its gradient buffer, its state
put into the one wrapped optimizer), stepped, and handed to a writer thread, which writes it
into a temp file, fsyncs and renames it — into the *inactive* one of two slot directories,
``D/rank{r}/model{k}/slot0`` and ``slot1``. Only when every sub-group's write succeeded on EVERY
rank (one 4-byte all-reduce agrees on it) is the step committed: ``.../model{k}/CURRENT`` (written and
fsynced before the agreement, so committing needs no disk space) is renamed over the old
pointer, the slots swap roles, and the new params (staged in the dead gradient buffers) are
written into ``sb.local_param_shard()``. A failed write (a full disk) raises ``OSError`` naming
the file and ``nvme_dir`` on that rank and ``RuntimeError`` on the others; the active slot, the
params and the in-memory layout are untouched, so the next step starts from the previous state.
The disk therefore holds up to two generations of the state (2 × (4 + state bytes) per shard
element); :meth:`NvmeOffload.offloaded_bytes` reports the live one.

[Note: one optimizer, state swapped per sub-group]
The wrapped optimizer is built once over every shard param, so LR schedulers and users see one
``param_groups`` list (``opt.param_groups``, ``opt.optimizer``). Each sub-group's state is put
into a NEW ``optimizer.state`` mapping before its step and only that sub-group's params have a
``.grad`` (torch optimizers and ours skip params without one): shardkit's fused optimizers cache
their launch plans by the state mapping's identity, so a new mapping per sub-group is what makes
them re-gather the state tensors (see [Note: cached step plans] in the fused optimizers). The
mapping of the last step is kept alive until the next one replaces it, so no new mapping can
reuse its ``id``. Each element is updated by the same arithmetic as one step over everything,
so the results are bitwise those of ``offload=None``.

[Note: one directory per model]
``r`` is the global rank (a tp or pp peer with the same dp rank may share the node and the
``nvme_dir``), and ``k`` is the first index whose lock file ``D/rank{r}/model{k}.lock`` this
instance could lock (``flock``, exclusive, held until the optimizer is garbage-collected). Two
offloaded models in one job (actor and critic, a model and its EMA) given the same ``nvme_dir``
therefore write ``model0/`` and ``model1/`` instead of each other's files. A lock dies with its
process, so a crashed run's directory is simply reused by the next run's first model.

Files are raw bytes (``file.write`` of the tensor's buffer, ``readinto`` a preallocated tensor):
measured against ``torch.save``/``torch.load`` in docs/offload.md.
"""

from __future__ import annotations

import fcntl
import math
import os
import tempfile
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from shardkit.comm import all_reduce

from ..durable_files import fsync_dir
from .offload import CpuOffload, _piece, host_param_shards, placeholder

__all__ = ["NvmeOffload", "claim_model_dir", "read_tensors", "validate_nvme_dir", "write_tensors"]

#: sub-groups whose write may be in flight while the next one steps (bounds host memory)
MAX_PENDING_WRITES = 2


def validate_nvme_dir(nvme_dir: Any) -> str:
    """Check that ``nvme_dir`` is an existing, writable directory; return it as a str.

    Raises:
        ValueError: naming ``nvme_dir`` (missing, not a directory, not writable).

    Example:
        >>> validate_nvme_dir("/local_nvme/shardkit")
        '/local_nvme/shardkit'
    """
    if not isinstance(nvme_dir, (str, os.PathLike)) or not str(nvme_dir):
        raise ValueError(f"nvme_dir must be a directory path, got {nvme_dir!r}")
    path = os.fspath(nvme_dir)
    if not os.path.exists(path):
        raise ValueError(f"nvme_dir {path!r} does not exist (create it on the NVMe drive first)")
    if not os.path.isdir(path):
        raise ValueError(f"nvme_dir {path!r} is not a directory")
    try:  # a real probe: os.access says yes to root on a read-only mount
        fd, probe = tempfile.mkstemp(prefix=".shardkit-probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"nvme_dir {path!r} is not writable by this process ({e.strerror or e})") from e
    return path


def _write_chunk(f: Any, data: memoryview) -> None:
    """One raw write (the function a test replaces to simulate a full disk)."""
    f.write(data)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def claim_model_dir(rank_root: str) -> tuple[str, int]:
    """The first ``rank_root/model{k}`` no live model holds; lock it for the caller.

    See [Note: one directory per model].

    Args:
        rank_root: this rank's directory under ``nvme_dir`` (created if missing).

    Returns:
        ``(directory, fd)``: the model's directory (not yet created) and the open lock file,
        whose ``os.close`` releases the claim.

    Example:
        >>> d0, fd0 = claim_model_dir("/nvme/rank0")   # "/nvme/rank0/model0"
        >>> d1, fd1 = claim_model_dir("/nvme/rank0")   # "/nvme/rank0/model1" while fd0 is open
    """
    os.makedirs(rank_root, exist_ok=True)
    k = 0
    while True:
        fd = os.open(os.path.join(rank_root, f"model{k}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            k += 1
            continue
        return os.path.join(rank_root, f"model{k}"), fd


def write_tensors(path: str, tensors: list[torch.Tensor], *, nvme_dir: str) -> None:
    """Write ``tensors``' raw bytes, in order, to ``path`` crash-safely: ``path + ".tmp"``, fsync,
    rename. On failure the temp file is removed and ``path`` is untouched.

    Raises:
        OSError: the original errno, with a message naming ``path`` and ``nvme_dir``.

    Example:
        >>> write_tensors("/nvme/rank0/slot1/bucket0.bin", [master, exp_avg], nvme_dir="/nvme")
    """
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            for t in tensors:
                if t.numel():
                    _write_chunk(f, _bytes_of(t))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise OSError(
            e.errno,
            f"offload='nvme': writing optimizer state to {path} failed ({e.strerror or e}); "
            f"nvme_dir={nvme_dir!r}. Nothing was committed: the previous optimizer state and the params are unchanged",
            path,
        ) from e


def read_tensors(path: str, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Read tensors of the given ``(dtype, shape)`` back, in order, from a :func:`write_tensors` file.

    Example:
        >>> master, m = read_tensors(path, [(torch.float32, (4096,)), (torch.float32, (4096,))])
    """
    out = []
    with open(path, "rb", buffering=0) as f:
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                view = _bytes_of(t)
                if f.readinto(view) != len(view):
                    raise RuntimeError(f"offload='nvme': {path} is shorter than its layout (truncated file?)")
            out.append(t)
    return out


#: a sub-group's layout on disk: the master's numel, then per shard param a list of
#: (state key, dtype, shape) of its tensors and a dict of its non-tensor state values
Layout = tuple[int, list[tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], dict[str, Any]]]]


class NvmeOffload(CpuOffload):
    """Masters and optimizer state in files under ``nvme_dir/rank{r}/``, streamed per bucket.

    See [Note: NVMe step and commit] and [Note: one optimizer, state swapped per sub-group].
    Same constructor and surface as :class:`CpuOffload`.
    """

    def __init__(
        self, sdp: Any, optimizer_class: type, groups: list[dict[str, Any]], optimizer_kwargs: Mapping[str, Any]
    ) -> None:
        self.nvme_dir = validate_nvme_dir(sdp.nvme_dir)
        self.root, lock_fd = claim_model_dir(os.path.join(self.nvme_dir, f"rank{sdp.ctx.global_rank}"))
        weakref.finalize(self, os.close, lock_fd)  # closing the file releases the lock
        for slot in (0, 1):
            os.makedirs(os.path.join(self.root, f"slot{slot}"), exist_ok=True)
        self.active = 0  # the slot holding the committed state
        self.generation = 0
        self.layouts: list[Layout | None] = [None] * len(sdp.sharded_buckets)  # None: never written
        self._dirty: dict[int, set[int]] = {}  # bucket -> segments whose params the user wrote
        super().__init__(sdp, optimizer_class, groups, optimizer_kwargs)
        self._last_stepped = self.optimizer.state
        self._release_params()  # a shard param has a grad only while its bucket steps

    def _init_masters(self) -> None:
        """No persistent masters: the first step reads them from the params (exact widening)."""
        return None

    # ---- files ---------------------------------------------------------------------------------
    def _path(self, slot: int, b: int) -> str:
        return os.path.join(self.root, f"slot{slot}", f"bucket{b}.bin")

    def _read(self, b: int, slot: int) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """Bucket ``b``'s fp32 master and per-shard-param state (fresh: from the params, no state)."""
        sb, layout = self.buckets[b], self.layouts[b]
        if layout is None:
            master = torch.empty(sb.shard, dtype=torch.float32)
            master.copy_(sb.local_param_shard())
            return master, [{} for _ in sb.segments]
        numel, per_param = layout
        specs = [(torch.float32, (numel,))] + [(dt, shape) for entries, _ in per_param for _, dt, shape in entries]
        tensors = iter(read_tensors(self._path(slot, b), specs))
        master = next(tensors)
        states = [{**values, **{key: next(tensors) for key, _, _ in entries}} for entries, values in per_param]
        if self._dirty.get(b):
            self.refresh_from_params(master, b, self._dirty[b])
        return master, states

    @staticmethod
    def _flatten(master: torch.Tensor, states: list[dict[str, Any]]) -> tuple[list[torch.Tensor], Layout]:
        tensors, per_param = [master], []
        for st in states:
            keys = sorted(k for k, v in st.items() if isinstance(v, torch.Tensor))
            tensors += [st[k] for k in keys]
            entries = [(k, st[k].dtype, tuple(st[k].shape)) for k in keys]
            per_param.append((entries, {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}))
        return tensors, (master.numel(), per_param)

    # ---- the generation writer ---------------------------------------------------------------
    def _write_generation(self, produce: Callable[[int], tuple[torch.Tensor, list[dict[str, Any]]]]) -> None:
        """Write ``produce(b)`` for every bucket into the inactive slot and commit it on every
        rank, or on none (see [Note: NVMe step and commit])."""
        target = 1 - self.active
        layouts: list[Layout | None] = [None] * len(self.buckets)
        pointer = os.path.join(self.root, "CURRENT")
        error: BaseException | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="shardkit-nvme-write") as writer:
            pending: list[Future] = []
            try:
                for b in range(len(self.buckets)):
                    master, states = produce(b)
                    tensors, layouts[b] = self._flatten(master, states)
                    while len(pending) >= MAX_PENDING_WRITES:
                        pending.pop(0).result()
                    pending.append(writer.submit(write_tensors, self._path(target, b), tensors, nvme_dir=self.nvme_dir))
                for fut in pending:
                    fut.result()
                fsync_dir(os.path.join(self.root, f"slot{target}"))
                write_tensors(pointer + ".next", [torch.tensor([target, self.generation + 1])], nvme_dir=self.nvme_dir)
            except Exception as e:  # agreed below, so that no rank commits while another cannot
                error = e
            finally:
                for fut in pending:  # never leave a writer running into the next attempt
                    fut.cancel()
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        all_reduce(failed, group=self.sdp.ctx.group("dp_cp"), op="sum", stats=self.sdp.comm_stats)
        if error is not None:
            raise error
        if int(failed) > 0:
            raise RuntimeError(
                f"offload='nvme': {int(failed)} other rank(s) failed to write their optimizer state under "
                f"their nvme_dir; nothing was committed on any rank (previous state and params unchanged)"
            )
        os.replace(pointer + ".next", pointer)  # the commit: a rename needs no free space
        fsync_dir(self.root)
        self.active, self.generation, self.layouts = target, self.generation + 1, layouts
        self._dirty = {}

    # ---- the step ------------------------------------------------------------------------------
    def _swap_state(self, state: defaultdict) -> None:
        # created while the previous mapping is alive, so it cannot take the id the fused
        # optimizers' cached plans remember (see [Note: one optimizer, state swapped per sub-group])
        self.optimizer.state = state

    def params_loaded(self) -> None:
        """Every param was just written: the next step re-reads every master from the params
        (see :meth:`CpuOffload.params_loaded`)."""
        self._dirty = {b: set(range(len(sb.segments))) for b, sb in enumerate(self.buckets)}
        self.record_versions()

    def _resync_written(self) -> None:
        for b, j in self.written_segments():
            self._dirty.setdefault(b, set()).add(j)
        self.record_versions()

    def step(self) -> None:
        """Stream every bucket through the CPU step with read-ahead; commit; write the params."""
        self.check_grads()
        self._resync_written()
        n = len(self.buckets)
        with ThreadPoolExecutor(1, thread_name_prefix="shardkit-nvme-read") as reader:
            ahead = [reader.submit(self._read, 0, self.active)] if n else []

            def produce(b: int) -> tuple[torch.Tensor, list[dict[str, Any]]]:
                master, states = ahead[0].result()
                if b + 1 < n:
                    ahead[0] = reader.submit(self._read, b + 1, self.active)  # read-ahead
                return master, self._step_bucket(b, master, states)

            try:
                self._write_generation(produce)
            finally:
                self._release_params()
        self.write_back([self._staged(b) for b in range(n)])

    @torch.no_grad()
    def _step_bucket(self, b: int, master: torch.Tensor, states: list[dict[str, Any]]) -> list[dict[str, Any]]:
        sb, sps, grad = self.buckets[b], self.shard_params[b], self.grads[b]
        for seg, sp in zip(sb.segments, sps):
            sp.data = _piece(master, sb, seg)
            # no rank had a gradient for it: not stepped (see ZeroOptimizer._hide_unstepped_grads)
            sp.grad = _piece(grad, sb, seg) if sb.stepped is None or sb.stepped[seg.index] else None
        state: defaultdict = defaultdict(dict)
        for sp, st in zip(sps, states):
            if st:
                state[sp] = st
        self._swap_state(state)
        self.optimizer.step()  # only this bucket's params have a grad
        self._last_stepped = state
        out = [dict(state[sp]) if sp in state else {} for sp in sps]
        for sp in sps:
            sp.grad = None
        # the gradient buffer is dead now: stage the new params there until the commit (the
        # next backward's copies into it are queued after the write-back: see [Note: gradient
        # copies overlapped with backward] in offload.py)
        self.host.invalidate(b)
        staged = self._staged(b)
        staged.copy_(master)
        return out

    def _staged(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s new params (``[shard]``, param dtype), staged in its host gradient buffer."""
        sb, grad = self.buckets[b], self.grads[b]
        dtype = sb.flat_param.dtype
        return grad.view(torch.uint8)[: sb.shard * dtype.itemsize].view(dtype)

    def _release_params(self) -> None:
        for sps in self.shard_params:
            for sp in sps:
                sp.data, sp.grad = placeholder(sp.numel()), None
        self._last_stepped.clear()  # the object stays alive; its tensors go

    # ---- state ---------------------------------------------------------------------------------
    def _materialized(self) -> tuple[list[torch.Tensor], defaultdict]:
        self._resync_written()
        masters, state = [], defaultdict(dict)
        for b in range(len(self.buckets)):
            master, states = self._read(b, self.active)
            masters.append(master)
            for sp, st in zip(self.shard_params[b], states):
                if st:
                    state[sp] = st
        return masters, state

    def masters_for_state_dict(self) -> list[torch.Tensor]:
        return self._materialized()[0]

    def inner_state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``, its state read from the files."""
        _, state = self._materialized()
        previous = self.optimizer.state
        self.optimizer.state = state
        try:
            return self.optimizer.state_dict()
        finally:
            self.optimizer.state = previous

    def load(self, optimizer_state: Mapping[str, Any], masters: list[torch.Tensor | None]) -> None:
        """Load the wrapped optimizer's state and the masters, and write them as a new generation."""
        self.optimizer.load_state_dict(optimizer_state)  # into memory (cast/cloned by the optimizer)
        loaded = self.optimizer.state

        def produce(b: int) -> tuple[torch.Tensor, list[dict[str, Any]]]:
            sb = self.buckets[b]
            master = torch.empty(sb.shard, dtype=torch.float32)
            master.copy_(sb.local_param_shard() if masters[b] is None else masters[b])
            return master, [dict(loaded[sp]) if sp in loaded else {} for sp in self.shard_params[b]]

        self._write_generation(produce)
        self._dirty = {}
        self.record_versions()
        self._swap_state(defaultdict(dict))  # the files hold it now
        self._last_stepped = self.optimizer.state

    def offloaded_bytes(self) -> dict[str, int]:
        """``{"cpu": host param shards (``offload_params``, else 0), "nvme": committed masters +
        state bytes, "cpu_buffers": gradient buffers}``."""
        nvme = 0
        for layout in self.layouts:
            if layout is not None:
                numel, per_param = layout
                nvme += 4 * numel
                for entries, _ in per_param:
                    nvme += sum(dt.itemsize * math.prod(shape) for _, dt, shape in entries)
        host = sum(t.numel() * t.element_size() for t in host_param_shards(self.sdp))  # offload_params
        return {"cpu": host, "nvme": nvme, "cpu_buffers": self.host.nbytes()}
