"""ZeRO-Offload: the fp32 master shards, the optimizer state and the optimizer step on the CPU.

:class:`CpuOffload` is what :class:`~shardkit.parallel.zero.ZeroOptimizer` delegates to with
``ShardedDataParallel(..., offload="cpu")`` (and, through its subclass
:class:`~shardkit.parallel.zero.nvme.NvmeOffload`, with ``offload="nvme"``). The device keeps
only the params (``flat_param``) and the gradient shards; ``FlatShards(offload=True)`` builds no
device masters and no device shard params. Per bucket this rank holds on the CPU:

=====================  ==========  ==========================================================
tensor                 bytes       what
=====================  ==========  ==========================================================
``masters[b]``         4·shard     fp32 master ``[shard]`` (padding included), pinned on CUDA
``grads[b]``           4·shard     fp32 gradient ``[shard]`` the step reads, pinned on CUDA
staging (bf16 grads)   2·shard     the reduced shard as copied, in the grad dtype, pinned
shard params           views       one 1-D ``nn.Parameter`` per segment (a view of the master,
                                   ``.grad`` a view of ``grads[b]``): the wrapped optimizer's
                                   params, so its state is allocated for the shard only
optimizer state        e.g. 8·Ψ/N  Adam's m and v, on the CPU
=====================  ==========  ==========================================================

One step, in the order the data moves ([Note: gradient copies overlapped with backward]):

1. during backward, as each bucket's reduce-scatter completes, its reduced shard (the raw sum,
   grad dtype) is copied into a host buffer (:class:`HostGradients`): ``non_blocking`` into
   pinned memory on a side stream on CUDA, a plain copy on the CPU;
2. ``finalize_gradients`` runs the step epilogue over the HOST copies (average/unscale by
   1/(N·S), inf/nan, Σg², into ``grads[b]`` in fp32), agrees overflow and the global norm with
   the same 8-byte all-reduce as without offload, and clips the host copies;
3. the wrapped optimizer steps once over every shard param, on the CPU (shardkit's fused
   optimizers take their fast CPU path with ``backend="auto"``; torch's run their CPU loop);
4. each master is written (cast to the param dtype) into ``sb.local_param_shard()``, and the
   caller all-gathers the params.

[Note: gradient copies overlapped with backward]
The device-to-host gradient copies are issued by ``FlatShards._complete_oldest`` (called by the
reducer during and at the end of backward) right after a bucket's reduce-scatter is waited and
accumulated into this rank's shard; only the last bucket's copy is left for the end of
backward. With offload, ``FlatShards.launch`` packs bucket k, then completes the bucket still in
flight (k-1), then starts k's reduce-scatter: bucket k-1's copy runs while k's reduce-scatter and
the rest of backward do. The transient peak is the one without offload (two buckets alive at
once: k packed, k-1 reducing); on CUDA the compute stream waits there for k-1's reduce-scatter,
which ran during k's backward.

Ordering on CUDA (:class:`HostGradients`): the side stream first waits for the compute stream
(where the reduce-scatter's wait and the accumulation are queued), copies ``non_blocking`` into
pinned memory and records one event per bucket. The host waits for those events before reading
(the epilogue); the compute stream waits for a bucket's event before writing its reduced shard
again (the next micro-batch's accumulation, ``zero_grad``), since the copy reads it. On the CPU
the copy is synchronous and the same calls run, so the tests exercise the order.

What is copied is the reduced SUM: the 1/(N·S) average, the inf/nan flag, Σg² and the clip
need every bucket (and every rank's Σg²), so they run once per step on the host copies with the
functions the device epilogue uses (:func:`~shardkit.kernels.grad_epilogue.unscale_and_norm_`,
:func:`~shardkit.kernels.grad_epilogue.clip_grads_`): on the CPU the result is bitwise the
device epilogue's (on CUDA the host sums Σg² in another order than the device kernel, within
fp32 rounding). Gradient accumulation over micro-batches at stages 2-3 (every backward
reduce-scatters into the shard) copies the accumulated shard after each backward; the last
backward's copies are what the step reads (gΨ/N over the bus per micro-batch). Low-precision
gradients (``grad_dtype=torch.bfloat16``) cross the bus in their dtype (half the bytes) into a
host staging buffer, and the host epilogue widens them into the fp32 buffer: the device no
longer holds an fp32 copy of every shard at the step (4Ψ/N bytes); the host holds 2Ψ/N more.
The host-to-device write-back of the params is ``non_blocking`` from pinned memory on the
compute stream; the next backward's copies into the same host buffers (NVMe stages the new
params there) are queued after it, since the side stream waits for the compute stream first,
and the host waits for those copies (so for the write-back, and for ``offload_params``'
staging copies out of the host shards) before the optimizer writes the masters again.

Results are bitwise those of ``offload=None``: the wrapped optimizer sees the same shard params
(views of one fp32 ``[shard]`` tensor per bucket, same groups, same order) and the same fp32
gradients, and the write-back rounds each master to the param dtype once, as the all-gather of
the device master does.

With ``offload_params=True`` (stage 3) the parameter shards live in host memory too
([Note: offloaded parameter shards] in ``stage3_shards.py``): an fp32 shard is adopted as the
master itself (no second copy, no write-back), a low-precision one gets the master's cast on the
host.

A param the user writes (``sdp.load_full_state_dict``, ``module.load_state_dict``, ``p.copy_``
under ``no_grad``) moves its version counter; the next step copies the written values into the
CPU master first, so the step continues from them, as it does without offload.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from shardkit.kernels.flatten import Segment

__all__ = ["CpuOffload", "HostGradients", "build_shard_params"]


def build_shard_params(sdp: Any) -> tuple[list[list[nn.Parameter]], dict[nn.Parameter, nn.Parameter]]:
    """One 1-D placeholder ``nn.Parameter`` per segment of every bucket, and original -> shard param.

    The placeholders have the segment's length and no storage of their own (a broadcast
    scalar); :class:`CpuOffload` points them at its masters.
    """
    per_bucket: list[list[nn.Parameter]] = []
    shard_of: dict[nn.Parameter, nn.Parameter] = {}
    for sb in sdp.sharded_buckets:
        sps = []
        for seg in sb.segments:
            sp = nn.Parameter(placeholder(seg.numel))
            shard_of[sb.grad_bucket.params[seg.index]] = sp
            sps.append(sp)
        per_bucket.append(sps)
    return per_bucket, shard_of


def placeholder(numel: int) -> torch.Tensor:
    """``[numel]`` fp32 with the right shape and one element of storage (stride 0)."""
    return torch.zeros(1).expand(numel)


def _piece(t: torch.Tensor, sb: Any, seg: Segment) -> torch.Tensor:
    """The segment's elements of a ``[shard]`` tensor of bucket ``sb``."""
    return t.narrow(0, seg.flat_offset - sb.start, seg.numel)


class HostGradients:
    """Host gradient buffers of every bucket and the device-to-host copies into them.

    See [Note: gradient copies overlapped with backward]. Built by ``FlatShards(offload=True)``;
    the reduced shards are copied as their reduce-scatters complete, the step epilogue runs on
    :attr:`raw` → :attr:`fp32`, and the CPU optimizer reads :attr:`fp32`.

    Args:
        numels: each bucket's shard length.
        grad_dtype: the dtype of the reduced shards (what crosses the bus).
        device: the device the shards live on (CUDA: pinned buffers, a side stream, events).
        backend: the kernel backend of the device epilogue; used on the host when the device is
            the CPU (the same arithmetic as without offload), else ``"torch"``.

    Attributes:
        fp32: per bucket ``[shard]`` fp32: the gradient the optimizer steps with.
        raw: per bucket ``[shard]`` in ``grad_dtype``: the copy target (:attr:`fp32` itself
            when the grads are fp32; the epilogue then works in place, as on the device).
        valid: per bucket, whether :attr:`raw` holds the bucket's reduced shard as of its last
            reduce-scatter since :meth:`reset`.

    Example:
        >>> host = HostGradients([1024], grad_dtype=torch.bfloat16, device=torch.device("cpu"), backend="auto")
        >>> host.issue(0, reduced_shard); host.wait(0); host.raw[0].dtype
        torch.bfloat16
    """

    def __init__(self, numels: list[int], *, grad_dtype: torch.dtype, device: torch.device, backend: str) -> None:
        self.pin = device.type == "cuda"
        self.fp32 = [torch.empty(n, dtype=torch.float32, pin_memory=self.pin) for n in numels]
        same = grad_dtype == torch.float32
        self.raw = self.fp32 if same else [torch.empty(n, dtype=grad_dtype, pin_memory=self.pin) for n in numels]
        self.backend = backend if device.type == "cpu" else "torch"
        self._stream = torch.cuda.Stream(device=device) if self.pin else None
        self._done: list[Any] = [None] * len(numels)  # CUDA: the event of each bucket's last copy
        self.valid = [False] * len(numels)

    @torch.no_grad()
    def issue(self, i: int, src: torch.Tensor) -> None:
        """Start copying bucket ``i``'s reduced shard ``src`` (``[shard]``, grad dtype) into
        :attr:`raw` ``[i]``: ordered after everything queued on the current stream."""
        dst = self.raw[i]
        if self._stream is None:
            dst.copy_(src)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            src.record_stream(self._stream)  # a replaced shard (abandon) is not reused under the copy
            self._done[i] = done
        self.valid[i] = True

    def wait(self, i: int) -> None:
        """Block the host until bucket ``i``'s copy has landed (before reading :attr:`raw`)."""
        if self._done[i] is not None:
            self._done[i].synchronize()
            self._done[i] = None

    def device_writable(self, i: int) -> None:
        """Make the current stream wait for bucket ``i``'s copy (before writing its reduced shard)."""
        if self._done[i] is not None:
            torch.cuda.current_stream().wait_event(self._done[i])

    def invalidate(self, i: int) -> None:
        """:attr:`raw` ``[i]``/:attr:`fp32` ``[i]`` were reused (NVMe stages the new params there)."""
        self.valid[i] = False

    def reset(self) -> None:
        """A new step (``zero_grad``): no bucket is copied yet."""
        self.valid = [False] * len(self.valid)

    def nbytes(self) -> int:
        """Host bytes of the buffers (fp32, plus the grad-dtype staging when it differs)."""
        extra = 0 if self.raw is self.fp32 else sum(t.numel() * t.element_size() for t in self.raw)
        return sum(t.numel() * 4 for t in self.fp32) + extra


class CpuOffload:
    """fp32 master shards, optimizer state and step on the CPU (see the module docstring).

    Args:
        sdp: the ``ShardedDataParallel`` (built with ``offload=`` set).
        optimizer_class: the wrapped optimizer class.
        groups: resolved parameter groups over the ORIGINAL parameters.
        optimizer_kwargs: passed to ``optimizer_class``.

    Attributes:
        optimizer: the wrapped optimizer, over the CPU shard params (one ``param_groups`` list).
        shard_params: per bucket, the shard params in segment order.
        origin: shard param -> the original parameter it is a piece of.

    Example:
        >>> off = CpuOffload(sdp, FusedAdamW, [{"params": list(model.parameters())}], {"lr": 1e-3})
        >>> sdp.finalize_gradients(); off.step(); sdp._shards.all_gather_params()
    """

    def __init__(
        self,
        sdp: Any,
        optimizer_class: type[torch.optim.Optimizer],
        groups: list[dict[str, Any]],
        optimizer_kwargs: Mapping[str, Any],
    ) -> None:
        self.sdp = sdp
        self.buckets = sdp.sharded_buckets
        # pinned host memory makes the copies asynchronous; it needs CUDA (and only helps there)
        self.pin = any(sb.flat_param.is_cuda for sb in self.buckets)
        # the host gradient buffers belong to the shards: they copy into them during backward
        self.host: HostGradients = sdp._shards.host
        self.grads = self.host.fp32
        self.shard_params, shard_of = build_shard_params(sdp)
        self.origin = {sp: p for p, sp in shard_of.items()}
        self.masters = self._init_masters()
        for sb, sps, grad in zip(self.buckets, self.shard_params, self.grads):
            for seg, sp in zip(sb.segments, sps):
                sp.grad = _piece(grad, sb, seg)
        inner = [{**g, "params": [shard_of[p] for p in g["params"] if p in shard_of]} for g in groups]
        self.optimizer = optimizer_class(inner, **optimizer_kwargs)
        self._versions = self._param_versions()

    # ---- construction ------------------------------------------------------------------------
    def _host(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32, pin_memory=self.pin)

    @torch.no_grad()
    def _init_masters(self) -> list[torch.Tensor] | None:
        masters = []
        for sb, sps in zip(self.buckets, self.shard_params):
            local = sb.local_param_shard()
            if _host_fp32(self.sdp, local):  # offload_params: the host shard is the master
                m = local
            else:
                m = self._host(sb.shard)
                m.copy_(local)  # exact: every param dtype widens to fp32 exactly
            for seg, sp in zip(sb.segments, sps):
                sp.data = _piece(m, sb, seg)  # the optimizer's in-place updates write the master
            masters.append(m)
        return masters

    # ---- user writes to params ---------------------------------------------------------------
    def _trainable(self) -> list[nn.Parameter]:
        return [p for sb in self.buckets for p in sb.grad_bucket.params]

    def _param_versions(self) -> list[int]:
        return [p._version for p in self._trainable()]

    def written_segments(self) -> set[tuple[int, int]]:
        """``(bucket, segment)`` pieces of this shard whose param was written since the last record."""
        now = self._param_versions()
        if now == self._versions:
            return set()
        changed = {p for p, a, b in zip(self._trainable(), now, self._versions) if a != b}
        return {
            (i, j)
            for i, sb in enumerate(self.buckets)
            for j, seg in enumerate(sb.segments)
            if sb.grad_bucket.params[seg.index] in changed
        }

    def record_versions(self) -> None:
        """Take the params as they are now as the masters' source (after a step or a load)."""
        self._versions = self._param_versions()

    @torch.no_grad()
    def refresh_from_params(self, master: torch.Tensor, b: int, segments: Iterable[int]) -> None:
        """Copy the listed segments of bucket ``b``'s params into ``master`` (``[shard]`` fp32)."""
        sb = self.buckets[b]
        local = sb.local_param_shard()
        for j in segments:
            seg = sb.segments[j]
            _piece(master, sb, seg).copy_(_piece(local, sb, seg))

    def params_loaded(self) -> None:
        """Every param was just written (``load_full_state_dict``): take all masters from the
        params. Needed at stage 3, where loading writes the param shards directly, so no
        parameter's ``_version`` moves and :meth:`written_segments` would see nothing.

        Example:
            >>> sdp.load_full_state_dict(sd)    # calls opt._offload.params_loaded()
        """
        for b, sb in enumerate(self.buckets):
            self.refresh_from_params(self.masters[b], b, range(len(sb.segments)))
        self.record_versions()

    def _resync_written(self) -> None:
        by_bucket: dict[int, list[int]] = {}
        for b, j in self.written_segments():
            by_bucket.setdefault(b, []).append(j)
        for b, segs in by_bucket.items():
            self.refresh_from_params(self.masters[b], b, segs)
        self.record_versions()

    # ---- the step ------------------------------------------------------------------------------
    def check_grads(self) -> None:
        """Raise unless every host gradient buffer holds this step's gradient (it does after the
        epilogue; a failed NVMe step may have staged params there)."""
        if not all(self.host.valid):
            raise RuntimeError(
                "offload: the host gradient buffers no longer hold this step's gradients (a failed "
                "offload='nvme' step staged params in them); call opt.zero_grad() and run backward again"
            )

    @torch.no_grad()
    def write_back(self, sources: list[torch.Tensor]) -> None:
        """``sources[b]`` (``[shard]``, host) into each bucket's ``local_param_shard()``, cast."""
        for sb, src in zip(self.buckets, sources):
            dst = sb.local_param_shard()
            if dst.data_ptr() != src.data_ptr():  # offload_params, fp32: the master is the shard
                dst.copy_(src, non_blocking=self.pin and dst.is_cuda)

    def step(self) -> None:
        """Step on the CPU over the host gradients (copied during backward, finalized by the
        epilogue), write the params' shards (no all-gather)."""
        self.check_grads()
        self._resync_written()
        self.optimizer.step()
        self.write_back(self.masters)

    # ---- state ---------------------------------------------------------------------------------
    def masters_for_state_dict(self) -> list[torch.Tensor]:
        """Copies of the fp32 CPU masters, one ``[shard]`` per bucket."""
        self._resync_written()
        return [m.clone() for m in self.masters]

    def inner_state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` (CPU tensors)."""
        return self.optimizer.state_dict()

    @torch.no_grad()
    def load(self, optimizer_state: Mapping[str, Any], masters: list[torch.Tensor | None]) -> None:
        """Load the wrapped optimizer's state and the masters (None: take the params as they are)."""
        if getattr(self.sdp, "offload_params", False):  # a master may be the host param shard
            self.sdp._shards.host_writable()
        self.optimizer.load_state_dict(optimizer_state)
        for b, (m, saved) in enumerate(zip(self.masters, masters)):
            if saved is None:
                self.refresh_from_params(m, b, range(len(self.buckets[b].segments)))
            else:
                m.copy_(saved)
        self.record_versions()  # the loaded masters win over params loaded before them

    def offloaded_bytes(self) -> dict[str, int]:
        """``{"cpu": masters + optimizer state (+ host param shards), "nvme": 0, "cpu_buffers":
        gradient buffers (+ the grad-dtype staging)}``; each storage counted once (an fp32 host
        param shard is the master)."""
        seen: dict[int, int] = {}
        for t in [*self.masters, *host_param_shards(self.sdp)]:
            seen[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        for s in self.optimizer.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        return {"cpu": sum(seen.values()), "nvme": 0, "cpu_buffers": self.host.nbytes()}


def host_param_shards(sdp: Any) -> list[torch.Tensor]:
    """The host parameter shards of every stage-3 bucket (``offload_params``), else ``[]``."""
    if not getattr(sdp, "offload_params", False):
        return []
    return [sb.param_shard for sb in sdp.param_buckets]


def _host_fp32(sdp: Any, local: torch.Tensor) -> bool:
    """Whether ``local`` (a bucket's param shard) can be the CPU master itself: an fp32 shard in
    host memory (``offload_params``), pinned whenever the params are on CUDA."""
    return getattr(sdp, "offload_params", False) and local.dtype == torch.float32 and local.device.type == "cpu"
