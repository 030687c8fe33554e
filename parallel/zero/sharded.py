"""``ShardedDataParallel``: ZeRO stages 1, 2 and 3 on the gradient reducer and flat shards.

ZeRO (Rajbhandari et al., docs/reference.md "ZeRO memory and communication") removes the
replication of model state across N data-parallel ranks. Bytes per rank for Ψ parameters, fp32
params, grads and Adam (m, v):

* DataParallel: 4Ψ + 4Ψ + 8Ψ = 16Ψ
* stage 1 (optimizer state sharded): 4Ψ + 4Ψ + 8Ψ/N
* stage 2 (+ gradients sharded): 4Ψ + (4 + 8)Ψ/N

and with bf16 params (fp32 master, m, v: K = 12 bytes), ``grad_dtype=torch.bfloat16``:
2Ψ + 2Ψ + 12Ψ/N (stage 1), 2Ψ + 14Ψ/N (stage 2). The default fp32 gradient reduction makes the
gradient term 4Ψ (stage 1) or 4Ψ/N (stage 2). Communication per step is 2Ψ, as DDP (see
:func:`~shardkit.parallel.zero.flat_shards.paper_comm_bytes` for the units).

One step, top-down: ``forward`` (the reducer's pre_forward/post_forward) → backward: as each
bucket's grads are ready, post_backward packs them (one flatten launch) and launches a
reduce-scatter of the bucket into this rank's shard, overlapped with the rest of backward →
finalize_backward waits in launch order and accumulates the shard → (optional)
:meth:`ShardedDataParallel.clip_grad_norm_`: one pass averages by 1/(N·S), flags inf/nan and
sums g² of the shard, then one 8-byte all-reduce agrees the overflow flag and the GLOBAL Σg² →
:class:`~shardkit.parallel.zero.ZeroOptimizer` steps the wrapped optimizer on this rank's 1-D
shard views (one launch per group for the fused optimizers) → one all-gather per bucket puts the
updated shards back into every rank's full params. With ``offload`` each bucket's reduced shard
is copied to the host as its reduce-scatter completes, and the epilogue, clip and step run
there (docs/offload.md).

Stage 3 (parameters sharded too, (b + g + K)Ψ/N, 3Ψ communication) gathers each ``wrap`` unit
around its forward and backward: :mod:`~shardkit.parallel.zero.stage3` has its data path and
ordering Notes, :mod:`~shardkit.parallel.zero.units` how units are chosen.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shardkit.comm import CommStats, ParallelContext, all_reduce

from ..data_parallel import broadcast_module_state, check_same_model
from ..grad_utils import agree_and_clip_
from ..loss_scaler import DynamicLossScaler
from ..tensor.layers import is_tp_sharded
from ..reducer import GradReducer
from .flat_shards import FlatShards, grad_buckets
from .sharded_bucket import ShardedBucket
from .nvme import validate_nvme_dir
from .stage3 import ShardUnits
from .units import check_wrap

__all__ = ["ShardedDataParallel"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class ShardedDataParallel(nn.Module):
    """Wrap a module for ZeRO-1/2 training over ``ctx``'s dp axis (dp must be the whole world).

    Each rank keeps full parameters (views of flat padded buckets) and runs forward/backward
    on its slice of the batch; gradients are reduce-scattered bucket by bucket during backward;
    the optimizer (:class:`~shardkit.parallel.zero.ZeroOptimizer`) keeps fp32 master weights and
    its state for this rank's shard only, and the updated shards are all-gathered after the step.

    Contract (differences from DataParallel):

    * ``p.grad`` is not the averaged gradient: stage 2 frees it as each bucket launches; stage 1
      keeps it as a view of the full gradient buffer, reduced only in this rank's shard (outside
      it: the local gradient on NCCL, the unaveraged sum over ranks on gloo, which reduces the
      buffer in place). Read gradients through :meth:`clip_grad_norm_` (global norm) or the
      optimizer, never ``torch.nn.utils.clip_grad_norm_(model.parameters())``.
    * Call ``opt.zero_grad()`` after every ``opt.step()``; a backward between them raises.
    * ``no_sync()``: stage 1 accumulates locally in the full gradient (no communication) and
      reduces once, in the first backward outside the block — stage 1 reduces once per step, a
      second reducing backward raises. Stage 2 has no full gradient to accumulate into, so
      ``no_sync`` does NOT skip communication: every backward reduce-scatters and accumulates
      into the shard (same result, the communication of each micro-batch).
    * Parameters become views of the flat buffers (``p.data`` is replaced; the Parameter
      objects, names and ``state_dict`` keys are unchanged). Tied parameters (one Parameter
      used twice) are held once and get the sum of both uses' gradients, as in one process.
    * Frozen parameters (``requires_grad=False``) are broadcast from rank 0 and get no
      gradient or optimizer memory. Buffers are broadcast at wrap time only.
    * Stage 1 with ``grad_dtype`` other than the params' dtype sets ``p.grad_dtype`` on the
      params, so that autograd accumulates straight into the full-precision gradient buffer.
    * A parameter that got no gradient on ANY rank since the last ``zero_grad`` is not stepped
      (no weight decay, no momentum; as ``torch.optim`` with ``zero_grad(set_to_none=True)``);
      one that got a gradient on some ranks is stepped with the average, the others
      contributing zeros. Agreeing on it costs one float per parameter in the step's
      norm/overflow all-reduce (an all-reduce of its own without clipping or loss scaling).

    Args:
        module: the model, on its device, the same on every rank.
        ctx: the parallel context; its ``dp`` axis must span the world.
        stage: 1, 2 or 3 (stage 3: between steps a rank holds only its shard of each parameter;
            the module's own tensors are freed — read them through :meth:`full_state_dict`;
            ``state_dict()`` of the model or of any submodule holding sharded params raises
            outside forward. Calling ``sdp.module`` (or ``sdp.module.generate``) directly
            gathers like ``sdp(...)``; calling a submodule that is not a unit, outside the
            model's forward, reads the freed placeholders).
        bucket_mb: bucket capacity in MiB (first bucket capped at 1 MiB, as DataParallel).
        wrap: stage-3 units: None (each child of a ``ModuleList``/``Sequential``, plus the root
            unit for the rest), a set of module classes, or ``callable(name, module) -> bool``.
        reshard_after_forward: stage 3: free each unit after its forward (True, 3Ψ comm) or
            keep it gathered until its backward (False, 2Ψ, more memory); or an int ``B``, a
            divisor of the dp_cp size, to keep a ``1/B`` piece of it after forward and gather the
            backward's copy inside blocks of ``B`` consecutive ranks (FSDP2's int; ZeRO++'s hpZ:
            with ``B`` = the dp_cp ranks per machine, 2Ψ of the 3Ψ cross machines, at ``bΨ/B``
            more memory per rank between a unit's forward and its backward; [Note: hierarchical
            gathers] in ``stage3_shards.py``). ``B`` = the dp_cp size is True. Stages 1-2: True.
        offload: None, ``"cpu"`` (fp32 master shards, optimizer state and the step on the
            CPU) or ``"nvme"`` (the same in per-rank files under ``nvme_dir``, streamed one
            bucket at a time); results are bitwise those without offload (docs/offload.md).
        nvme_dir: an existing, writable directory for ``offload="nvme"``.
        offload_params: stage 3 with ``offload``: keep every bucket's parameter shard in host
            memory too (pinned on CUDA; DeepSpeed's ``zero_optimization.offload_param``), so
            the device holds parameter bytes only for the units gathered at the moment; each
            gather first copies the shard into a device staging buffer. Bitwise the same
            results ([Note: offloaded parameter shards] in ``stage3_shards.py``;
            docs/offload.md).
        grad_dtype: dtype of gradient reduction and storage; None: fp32 (also for bf16/fp16
            params: peers that reduce in bf16 lose convergence), ``torch.bfloat16`` halves the
            gradient bytes and traffic.
        loss_scaler: fp16 DynamicLossScaler; its 1/S is fused into the gradient epilogue, the
            overflow is agreed over dp, and ``ZeroOptimizer.step`` updates the scale.
        stats: CommStats to record into (default a new one, ``.comm_stats``).
        backend: kernel backend (``"triton"`` runs the interpreter on CPU).
        check_sync: debug switch, any stage: before each ZeRO collective (bucket
            reduce-scatter, step epilogue, parameter all-gather, stage-3 unit all-gather) agree
            over dp which one it is (one 32-byte all-gather); ranks that diverged (one more
            forward/backward, a missed ``no_sync``, another unit order) then raise the same
            ``RuntimeError`` naming each rank's position instead of mis-pairing collectives or
            hanging until the timeout ([Note: diverged ranks] in ``zero/sync_check.py``).
        forward_prefetch: stage 3: True gathers the next unit (in the previous forward's
            order) while the current one runs: one more gathered unit in forward, for speed
            where the host waits for each gather (gloo: ~4% of a step on the benchmark's
            TinyGPT). False (default, as FSDP2): each unit is gathered as its forward starts;
            on CUDA the gather is still issued ahead of the GPU (the host does not wait for it),
            so it overlaps the previous unit's kernels anyway. Backward always prefetches.

    Raises:
        ValueError / TypeError: a bad argument (named), before any collective.

    Example:
        >>> sdp = ShardedDataParallel(model, ctx, stage=2)
        >>> opt = ZeroOptimizer(sdp, FusedAdamW, lr=3e-4, weight_decay=0.1)
        >>> loss = lm_loss(sdp(x), y); loss.backward()
        >>> sdp.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        ctx: ParallelContext,
        stage: int = 1,
        *,
        bucket_mb: float = 25.0,
        wrap: Any = None,
        reshard_after_forward: bool | int = True,
        offload: str | None = None,
        nvme_dir: str | None = None,
        grad_dtype: torch.dtype | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        stats: CommStats | None = None,
        backend: str = "auto",
        check_sync: bool = False,
        forward_prefetch: bool = False,
        offload_params: bool = False,
    ) -> None:
        super().__init__()
        params = _validate(module, ctx, stage, bucket_mb, wrap, reshard_after_forward, offload, nvme_dir, grad_dtype, loss_scaler)
        if not isinstance(offload_params, bool) or (offload_params and (stage != 3 or offload is None)):
            raise ValueError(
                "offload_params keeps the stage-3 parameter shards on the host and needs stage=3 with "
                f"offload='cpu' or 'nvme'; got offload_params={offload_params!r}, stage={stage}, offload={offload!r}"
            )
        if not isinstance(forward_prefetch, bool) or (forward_prefetch and stage != 3):
            raise ValueError(
                f"forward_prefetch must be a bool and applies to stage 3; got {forward_prefetch!r} with stage={stage}"
            )
        if not isinstance(check_sync, bool):
            raise ValueError(f"check_sync must be a bool, got {check_sync!r}")
        self.module = module
        self.ctx = ctx
        self.stage = stage
        self.loss_scaler = loss_scaler
        self.backend = backend
        self.comm_stats = stats if stats is not None else CommStats()
        self.grad_dtype = grad_dtype or torch.float32
        self.offload = offload
        self.offload_params = offload_params
        self.nvme_dir = nvme_dir
        # ZeRO shards over every replica of a parameter: dp x cp ([Note: the dp_cp group])
        self._group = ctx.group("dp_cp")
        self._dp = ctx.size("dp_cp")
        # tensor parallelism inside each dp replica: ZeRO shards this rank's TP slices over dp;
        # the global norm adds over tp with the tp-replicated params counted once
        self._tp = ctx.size("tp")
        self._replicated = {p for p in params if not is_tp_sharded(p)} if self._tp > 1 else set()
        self._optimizer: Any = None  # weakref to the ZeroOptimizer, set by it
        self._step_state: tuple[bool, torch.Tensor | None] | None = None
        # the one check that depends on this rank's machine, agreed in the first collective
        local_error = None
        if offload == "nvme":
            try:
                validate_nvme_dir(nvme_dir)
            except ValueError as e:
                local_error = e
        check_same_model(
            module,
            group=self._group,
            device=ctx.device,
            stats=self.comm_stats,
            who="ShardedDataParallel",
            local_error=local_error,
        )
        broadcast_module_state(module, group=self._group, stats=self.comm_stats)
        shard_kwargs = dict(
            group=self._group,
            rank=ctx.rank("dp_cp"),
            size=self._dp,
            stage=stage,
            grad_dtype=self.grad_dtype,
            stats=self.comm_stats,
            backend=backend,
            offload=offload is not None,
        )
        self._units: ShardUnits | None = None
        if stage != 3:
            shard_kwargs["check_sync"] = check_sync
        if stage == 3:
            secondary = None  # [Note: hierarchical gathers] in stage3_shards.py
            if not isinstance(reshard_after_forward, bool) and reshard_after_forward < self._dp:
                secondary = (*ctx.dp_cp_blocks(reshard_after_forward), reshard_after_forward)
            self._units = ShardUnits(
                module,
                wrap=wrap,
                reshard_after_forward=bool(reshard_after_forward),
                secondary=secondary,
                bucket_mb=bucket_mb,
                check_sync=check_sync,
                forward_prefetch=forward_prefetch,
                offload_params=offload_params,
                on_abandon=self._forget_step,
                **shard_kwargs,
            )
            self._shards: FlatShards = self._units.shards
            self._reducer = self._units.reducer
            for p in module.parameters():  # GatheredParameters(params) finds its wrapper from a param
                p._shardkit_zero3 = weakref.ref(self)
            return
        buckets = grad_buckets(params, grad_bytes=self.grad_dtype.itemsize, bucket_mb=bucket_mb)
        self._shards = FlatShards(buckets, **shard_kwargs)
        self._reducer = GradReducer(
            [sb.grad_bucket for sb in self._shards.buckets], launch=self._shards.launch, finish=self._shards.finish
        )

    # ---- the step ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (after discarding the reduction of a backward that raised).

        Stage 3 does both in hooks on the module itself, so ``sdp.module(x)`` and methods that
        call it (``sdp.module.generate(...)``) gather the parameters too."""
        if self._units is not None:
            return self.module(*args, **kwargs)
        if self._reducer.pre_forward():
            self._shards.abandon()
            self._step_state = None
        try:
            return self.module(*args, **kwargs)
        finally:
            self._reducer.post_forward()

    def _forget_step(self) -> None:
        """A backward that raised was discarded: nothing of this step is finalized."""
        self._step_state = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: stage 1 skips communication inside the block; stage 2 still
        reduce-scatters every backward into the shard (it never holds a full gradient)."""
        if self.stage == 1:  # stages 2 and 3 hold no full gradient
            with self._reducer.disabled():
                yield
        else:
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients (the optimizer's ``zero_grad`` calls this)."""
        self._shards.zero_grad(set_to_none=set_to_none)
        for p in self.module.parameters():
            if not p.requires_grad:
                p.grad = None
        self._step_state = None

    def finalize_gradients(
        self, max_norm: float | None = None, *, measure_norm: bool = False
    ) -> tuple[bool, torch.Tensor | None]:
        """Average/unscale this rank's gradient shards, agree the overflow and global norm, clip.

        Runs once per step (the second call returns the first's result). The all-reduce of
        Σg² summed over dp (with a loss scaler also the inf/nan flag: 8 bytes instead of 4;
        :func:`~shardkit.parallel.grad_utils.agree_and_clip_` decides and clips) is issued only
        when it is needed: with a loss scaler, a ``max_norm`` or ``measure_norm`` (the norm is then
        returned unclipped; Σg² rides on the all-reduce of the gradient flags that runs anyway, 4
        bytes more). With ``offload`` the average, flag, Σg² and clip
        run on the host copies of the shards made during backward (the all-reduce stays on the
        device): [Note: gradient copies overlapped with backward] in ``offload.py``.

        Returns:
            ``(overflow, norm)``: whether any rank's gradients held inf/nan, and the GLOBAL L2
            norm before clipping (0-d fp32; ``inf`` on overflow; None when not agreed).
        """
        if self._step_state is not None:
            return self._step_state
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 or None, got {max_norm}")
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        found_inf, sumsq = self._shards.epilogue(
            1.0 / (self._dp * scale), replicated=self._replicated, replicated_weight=1.0 / self._tp
        )
        overflow, norm = False, None
        # [Note: params without a gradient are not stepped] (flat_shards.py): one float per
        # param, summed over dp in the norm/overflow all-reduce when there is one
        local = self._shards.got_grad_flags()
        flags = torch.tensor(local, dtype=torch.float32).to(sumsq.device)
        if self.loss_scaler is not None or max_norm is not None or measure_norm:
            # Read the flag on the host only with a loss scaler (the step must be skipped): a
            # clip-only step stays free of host syncs, and, as torch's clip_grad_norm_ and our
            # DataParallel path, a non-finite norm then simply propagates.
            grads, backend = self._shards.clip_targets()
            overflow, norm = agree_and_clip_(
                self._counted_sumsq(sumsq),
                found_inf if self.loss_scaler is not None else None,
                sum_over=self._norm_groups(),
                riders=flags,
                max_norm=max_norm,
                grads=[grads],
                backend=backend,
                stats=self.comm_stats,
            )
        elif flags.numel():
            all_reduce(flags, group=self._group, op="sum", stats=self.comm_stats)
        # only a rank that missed a gradient itself needs the others' flags (a host read)
        self._shards.set_stepped(None if all(local) else (flags > 0).tolist())
        self._step_state = (overflow, norm)
        return self._step_state

    def _norm_groups(self) -> list[Any]:
        """The groups across which this rank's gradient shards are partitioned, in the order of
        their all-reduces: dp (its flags ride along), then tp (the other tp ranks' slices). A
        pipeline adds its pp axis (PipelineShardedDataParallel)."""
        return [self._group] + ([self.ctx.group("tp")] if self._tp > 1 else [])

    def _counted_sumsq(self, sumsq: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global Σg² (all of it here; a pipeline's tie copies out)."""
        return sumsq

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the GLOBAL gradient norm (sum of squares over every rank's shard).

        Returns:
            The pre-clip global norm (0-d fp32; ``inf`` if a gradient overflowed).
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        _, norm = self.finalize_gradients(max_norm)
        if norm is None:
            raise RuntimeError("clip_grad_norm_: the gradients were already finalized without a norm this step")
        return norm

    # ---- state ---------------------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The unwrapped module's ``state_dict`` with full tensors (copies), on every rank or rank 0.

        Stages 1-2 hold full parameters, so no communication is needed.

        Example:
            >>> torch.save(sdp.full_state_dict(rank0_only=True), "model.pt")  # on rank 0
        """
        want = not rank0_only or self.ctx.rank("dp_cp") == 0
        if self._units is not None:  # every rank takes part in the gathers
            return self._units.full_state_dict(self.module, want)
        if not want:
            return {}
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def gathered_params(
        self, params: Iterable[nn.Parameter], modifier_rank: int | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Stage 3: the full ``params`` inside the block (their units gathered; collective, every
        rank names the same params); with ``modifier_rank`` (a dp rank), that rank's values
        afterwards become every rank's (shards and fp32 masters, exactly). Stages 1-2 hold
        full params already: nothing to do (a write between steps reaches the masters by itself,
        [Note: params written between steps]).

        Raises:
            ValueError: ``modifier_rank`` out of range, or with optimizer offload (its host
                masters are not rewritten piecewise).

        Example:
            >>> with sdp.gathered_params([sdp.module.head.weight], modifier_rank=0):
            ...     if dp_rank == 0:
            ...         sdp.module.head.weight.normal_(std=0.02)
        """
        if modifier_rank is not None and not 0 <= modifier_rank < self._shards.size:
            raise ValueError(f"modifier_rank: a dp rank in [0, {self._shards.size}), got {modifier_rank}")
        if self._units is None:
            return contextlib.nullcontext()
        if modifier_rank is not None and self.offload is not None:
            raise ValueError("modifier_rank: not offered with optimizer offload (the host masters are not rewritten)")
        return self._units.gathered(params, modifier_rank)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors into the module (params are written in place in their buckets) and
        re-read the fp32 master shards from them (stage 3: into this rank's param shards)."""
        if self._units is not None:
            self._shards.host_writable()  # offload_params: no staging copy still reads the host shards
            self._units.load_full_state_dict(self.module, state)
        else:
            self.module.load_state_dict(state)
            self._shards.refresh_master()
        opt = self._optimizer() if self._optimizer is not None else None
        offload = getattr(opt, "_offload", None)
        if offload is not None:  # masters off the device: re-read them from the loaded params
            offload.params_loaded()

    def memory_report(self) -> dict[str, Any]:
        """This rank's memory, in bytes (``"unit": "bytes"``).

        Persistent model state: ``params`` (flat buffers, padding included, plus frozen params),
        ``grads`` (stage 1 the full gradient, stage 2 the shard), ``master_params`` (fp32 master
        shards of low-precision params), ``optimizer_state`` (the optimizer's state tensors on the
        shard), and their sum ``model_state``. Transient: ``peak_transient`` (the largest total
        of buckets, reduce-scatter outputs, fp32 gradient copies and all-gather inputs alive at
        once so far).
        """
        mem = self._shards.persistent_bytes()
        held = {p for sb in self._shards.buckets + getattr(self._shards, "frozen", []) for p in sb.grad_bucket.params}
        mem["params"] += sum(p.numel() * p.element_size() for p in self.module.parameters() if p not in held)
        opt = self._optimizer() if self._optimizer is not None else None
        mem["optimizer_state"] = opt.state_bytes() if opt is not None else 0
        mem["model_state"] = sum(mem.values())
        mem["peak_transient"] = self._shards.peak_transient_bytes
        # bytes held off the device by offload (``{"cpu": n, "nvme": n}``; {} without offload)
        offloaded = opt.offloaded_bytes() if opt is not None else {}
        if self.offload_params:
            host = self._shards.host_param_bytes()
            buffers = self._shards.host.nbytes()  # no optimizer yet: the gradient buffers exist already
            offloaded = offloaded or {"cpu": host, "nvme": 0, "cpu_buffers": buffers}
            offloaded["params"] = host
        return {"unit": "bytes", **mem, "offloaded": offloaded}

    @property
    def sharded_buckets(self) -> list[ShardedBucket]:
        """The flat buckets of trainable params, bucket 0 first (layout, this rank's shard and its segments)."""
        return self._shards.buckets

    @property
    def param_buckets(self) -> list[ShardedBucket]:
        """Every bucket holding params: :attr:`sharded_buckets` plus, in stage 3, the buckets of
        frozen params (sharded too, with no gradient or optimizer state)."""
        return self._shards.buckets + list(getattr(self._shards, "frozen", []))

    def _attach(self, optimizer: Any) -> None:
        if self._optimizer is not None and self._optimizer() is not None:
            raise ValueError("this ShardedDataParallel already has a ZeroOptimizer")
        self._optimizer = weakref.ref(optimizer)


def _validate(
    module: Any,
    ctx: Any,
    stage: Any,
    bucket_mb: Any,
    wrap: Any,
    reshard_after_forward: Any,
    offload: Any,
    nvme_dir: Any,
    grad_dtype: Any,
    loss_scaler: Any,
    *,
    pipeline: bool = False,
) -> list[nn.Parameter]:
    """Every argument check, before any collective (ValueError/TypeError naming the argument).
    ``pipeline``: the caller is ``PipelineShardedDataParallel`` (a pp axis is expected)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, ShardedDataParallel) or type(module).__name__ == "DataParallel":
        raise TypeError(f"module is already wrapped ({type(module).__name__}); pass the unwrapped model")
    if not isinstance(ctx, ParallelContext):
        raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    if offload == "nvme" and not nvme_dir:
        raise ValueError("nvme_dir is required with offload='nvme' (the directory for the optimizer state files)")
    if offload != "nvme" and nvme_dir is not None:
        raise ValueError(f"nvme_dir is only used with offload='nvme', got offload={offload!r}")
    if offload == "nvme" and pipeline:  # exists, is a directory, is writable
        # (ShardedDataParallel itself checks it in its first collective, agreed over dp)
        validate_nvme_dir(nvme_dir)
    if stage != 3 and wrap is not None:
        raise ValueError(f"wrap chooses stage-3 units; it has no meaning for stage={stage}")
    if stage != 3 and reshard_after_forward is not True:
        raise ValueError(f"reshard_after_forward applies to stage 3; stage {stage} never reshards parameters")
    if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
    if grad_dtype is not None and grad_dtype not in _FLOATS:
        raise ValueError(f"grad_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got {grad_dtype!r}")
    if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
        raise TypeError(f"loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler).__name__}")
    if ctx.size("pp") != 1 and not pipeline:
        raise ValueError(
            f"ctx: has a pp axis of size {ctx.size('pp')}; ZeRO on a pipeline's dp axis is "
            "shardkit.parallel.parallelize(model, ctx, pp=..., dp='zero1'|'zero2')"
        )
    params = list(module.parameters())
    for name, p in module.named_parameters():
        if p.dtype not in _FLOATS:
            raise TypeError(f"module: parameter {name!r} is {p.dtype}; ZeRO shards fp32/bf16/fp16 parameters")
        if p.requires_grad and not p.is_contiguous():
            raise ValueError(f"module: parameter {name!r} is not contiguous (channels_last is not supported by ZeRO)")
    if len({p.device for p in params}) > 1:
        raise ValueError(f"module: parameters on several devices {sorted({str(p.device) for p in params})}")
    if stage == 3:
        check_wrap(wrap)
        if not isinstance(reshard_after_forward, (bool, int)):
            raise TypeError(f"reshard_after_forward must be a bool or an int, got {reshard_after_forward!r}")
        n = ctx.size("dp_cp")
        if not isinstance(reshard_after_forward, bool) and (reshard_after_forward < 2 or n % reshard_after_forward):
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward}: an int is the block of ranks the backward gathers "
                f"within and must be a divisor of the dp_cp size {n} greater than 1 (e.g. the dp ranks per machine); "
                "True frees the unit entirely, False keeps it gathered"
            )
    return params
