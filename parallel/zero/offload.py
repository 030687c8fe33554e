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
shard params           views       one 1-D ``nn.Parameter`` per segment (a view of the master,
                                   ``.grad`` a view of ``grads[b]``): the wrapped optimizer's
                                   params, so its state is allocated for the shard only
optimizer state        e.g. 8·Ψ/N  Adam's m and v, on the CPU
=====================  ==========  ==========================================================

One step (:meth:`CpuOffload.step`, after ``finalize_gradients``):

1. every bucket's ``sb.opt_grad`` (final: averaged, unscaled, clipped by the GLOBAL norm) is
   copied into ``grads[b]`` — asynchronously from CUDA into pinned memory, then one wait;
2. the wrapped optimizer steps once over every shard param, on the CPU (shardkit's fused
   optimizers take their fast CPU path with ``backend="auto"``; torch's run their CPU loop);
3. each master is written (cast to the param dtype) into ``sb.local_param_shard()``, and the
   caller all-gathers the params.

[Note: where the offload copies happen]
The device-to-host gradient copies run after ``finalize_gradients``, not during backward: the
gradient the optimizer needs is only final once every bucket is reduced, averaged, unscaled and
clipped by the global norm, which needs every rank's sum of squares. Copying the raw reduced
shards during backward and re-applying the epilogue on the CPU would copy stage-2 shards once
per micro-batch and duplicate the epilogue; the copies are instead issued back to back on the
current stream (non_blocking into pinned buffers, so they run at PCIe speed while the host
queues the next one) and waited for once. The host-to-device write-back is non_blocking from
pinned memory as well: the next step's gradient copies are queued behind it on the same
stream, and the CPU writes the masters again only after waiting for those.

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

__all__ = ["CpuOffload", "build_shard_params"]


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
        self.grads = [self._host(sb.shard) for sb in self.buckets]
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
    @torch.no_grad()
    def copy_grads_in(self) -> None:
        """Every bucket's final fp32 gradient shard into the host buffers (see [Note: where the
        offload copies happen]); returns once they have landed."""
        for sb, grad in zip(self.buckets, self.grads):
            grad.copy_(sb.opt_grad, non_blocking=self.pin)
        if self.pin:
            done = torch.cuda.Event()
            done.record()  # one wait for all copies, not one per bucket
            done.synchronize()

    @torch.no_grad()
    def write_back(self, sources: list[torch.Tensor]) -> None:
        """``sources[b]`` (``[shard]``, host) into each bucket's ``local_param_shard()``, cast."""
        for sb, src in zip(self.buckets, sources):
            dst = sb.local_param_shard()
            if dst.data_ptr() != src.data_ptr():  # offload_params, fp32: the master is the shard
                dst.copy_(src, non_blocking=self.pin and dst.is_cuda)

    def step(self) -> None:
        """Copy the gradients in, step on the CPU, write the params' shards (no all-gather)."""
        self._resync_written()
        self.copy_grads_in()
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
        gradient buffers}``; each storage counted once (an fp32 host param shard is the master)."""
        seen: dict[int, int] = {}
        for t in [*self.masters, *host_param_shards(self.sdp)]:
            seen[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        for s in self.optimizer.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        return {"cpu": sum(seen.values()), "nvme": 0, "cpu_buffers": sum(g.numel() * 4 for g in self.grads)}


def host_param_shards(sdp: Any) -> list[torch.Tensor]:
    """The host parameter shards of every stage-3 bucket (``offload_params``), else ``[]``."""
    if not getattr(sdp, "offload_params", False):
        return []
    return [sb.param_shard for sb in sdp.param_buckets]


def _host_fp32(sdp: Any, local: torch.Tensor) -> bool:
    """Whether ``local`` (a bucket's param shard) can be the CPU master itself: an fp32 shard in
    host memory (``offload_params``), pinned whenever the params are on CUDA."""
    return getattr(sdp, "offload_params", False) and local.dtype == torch.float32 and local.device.type == "cpu"
