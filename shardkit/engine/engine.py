"""The training engine behind :func:`shardkit.initialize`: DeepSpeed's engine API on shardkit.

One micro-step of a DeepSpeed loop, and what runs here::

    loss = engine(input_ids=x, labels=x).loss   # the wrapped module's forward (ZeRO-3: gathers)
    engine.backward(loss)                       # (loss / gradient_accumulation_steps) × loss scale;
                                                # off the boundary under no_sync
    engine.step()                               # at the boundary: finalize (unscale, inf/nan agreed
                                                # over dp, global norm, clip) → optimizer step unless
                                                # overflow → loss-scale update → zero_grad →
                                                # scheduler step (applied steps only, as DeepSpeed)

The engine owns no data path and no step logic of its own: it is a DeepSpeed-named adapter over
the :class:`~shardkit.parallel.ParallelModel` that :func:`~shardkit.parallel.parallelize` built
(``engine.backward`` → ``parallel.backward``, ``engine.step`` → ``parallel.clip`` +
``parallel.step``; stage 0 is :class:`~shardkit.parallel.DataParallel`, stages 1-3
:class:`~shardkit.parallel.ShardedDataParallel` with a :class:`~shardkit.parallel.ZeroOptimizer`),
so ``shardkit.initialize`` and ``parallelize`` train the same layout bitwise alike; checkpoints are
:func:`shardkit.parallel.save_checkpoint` directories (reshardable). Counters follow DeepSpeed's
``DeepSpeedEngine``: ``micro_steps`` counts every :meth:`Engine.step` call, ``global_steps``
the boundaries (skipped fp16 steps included), ``skipped_steps`` the skipped ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from shardkit.comm import ParallelContext
from shardkit.parallel import DynamicLossScaler, ParallelModel, load_checkpoint, save_checkpoint
from shardkit.parallel.memory_report import replicated_memory_report
from shardkit.parallel.tensor import gather_state_dict

from .resolved import EngineConfig

__all__ = ["Engine"]

logger = logging.getLogger("shardkit.engine")

LATEST = "latest"  # DeepSpeed's file naming the newest tag of a checkpoint directory


#: the optimizer types DeepSpeed's config lower-cases (``optimizer_name()`` returns them so)
_DEEPSPEED_OPTIMIZER_NAMES = frozenset(
    ("adagrad", "adam", "adamw", "lamb", "onebitadam", "onebitlamb", "zerooneadam", "lion", "muon")
)


class Engine(nn.Module):
    """A model, its optimizer, LR scheduler and loss scaler, stepped with DeepSpeed's semantics.

    Built by :func:`shardkit.initialize` (not constructed directly). The public surface is
    ``deepspeed.DeepSpeedEngine``'s: a DeepSpeed training loop runs unchanged.

    Attributes:
        module: the user's model (unwrapped; stage 3 frees its tensors between steps: read them
            with :meth:`full_state_dict`).
        parallel: the :class:`~shardkit.parallel.ParallelModel` that runs every step.
        optimizer: a :class:`~shardkit.parallel.ZeroOptimizer` (stages 1-3) or the
            ``torch.optim.Optimizer`` itself (stage 0).
        lr_scheduler: the scheduler (stepped once per applied optimizer step), or None.
        loss_scaler: the fp16 :class:`~shardkit.parallel.DynamicLossScaler`, or None.
        config: the resolved :class:`~shardkit.engine.EngineConfig`.
        ctx: the :class:`~shardkit.comm.ParallelContext`.
        global_steps, micro_steps, skipped_steps, global_samples: DeepSpeed's counters.

    Example:
        >>> engine, optimizer, _, scheduler = shardkit.initialize(model=model, config="ds.json",
        ...                                                       model_parameters=model.parameters())
        >>> for x in batches:
        ...     loss = engine(input_ids=x, labels=x).loss
        ...     engine.backward(loss)
        ...     engine.step()
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        parallel: ParallelModel,
        optimizer: Any,
        lr_scheduler: Any,
        config: EngineConfig,
        ctx: ParallelContext,
        loss_scaler: DynamicLossScaler | None,
        tp_state: tuple[dict[str, Any], dict[str, int]] | None = None,
        client_optimizer: Any = None,
    ) -> None:
        super().__init__()
        self.module = module
        # Not registered as submodules: they hold ``module`` too, and the engine's state_dict
        # and parameters() are the user's module's, as DeepSpeed's. ``_wrapped`` is the dp
        # wrapper parallelize built (DataParallel / ShardedDataParallel), or the module itself.
        object.__setattr__(self, "parallel", parallel)
        object.__setattr__(self, "_wrapped", parallel.module)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        self.ctx = ctx
        self._client_optimizer = client_optimizer  # what optimizer= was, for optimizer_name()
        self.loss_scaler = loss_scaler
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0
        self._step_applied = False
        self._global_grad_norm: float | None = None
        # tensor_parallel: the plan the module was converted with and the real vocabulary size of
        # its vocabulary-split weights (to gather dense state dicts)
        self._tp_state = tp_state

    # ---- DeepSpeed's config accessors ----------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self.config.zero.stage

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward/backward on one rank."""
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.config.train_batch_size

    def gradient_clipping(self) -> float:
        """The max global gradient norm (0: no clipping)."""
        return self.config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self.config.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.dtype == "bf16"

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def global_rank(self) -> int:
        return self.ctx.global_rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (torchrun's ``LOCAL_RANK``; the CUDA device index)."""
        if self.ctx.device.type == "cuda" and self.ctx.device.index is not None:
            return self.ctx.device.index
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (the ``dp`` axis)."""
        return self.ctx.size("dp")

    @property
    def mp_world_size(self) -> int:
        """Model-parallel (tensor-parallel) ranks."""
        return self.ctx.size("tp")

    def optimizer_name(self) -> str:
        """The config's optimizer ``type`` (as written there), or the class name of the optimizer
        passed to ``initialize``, as DeepSpeed's ``optimizer_name()``."""
        if self._client_optimizer is not None:
            client = self._client_optimizer
            return client.__name__ if isinstance(client, type) else type(client).__name__
        if self.config.optimizer is None:
            return ""
        written = self.config.optimizer.type
        return written.lower() if written.lower() in _DEEPSPEED_OPTIMIZER_NAMES else written

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation without the dp reduction (``ParallelModel.no_sync``): backward
        calls inside add to the gradients; the first one outside reduces their sum. DeepSpeed
        refuses it at ZeRO 2-3; here stages 2-3 still reduce-scatter each micro-batch into their
        shard (nothing else is possible without a full gradient), 0-1 skip the communication.

        Example:
            >>> with engine.no_sync():
            ...     engine.backward(loss_a)
            >>> engine.backward(loss_b); engine.step()
        """
        return self.parallel.no_sync()

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the full model's ``state_dict`` in its own dtype (fp16/bf16 under mixed precision,
        fp32 otherwise) to ``save_dir/save_filename`` with ``torch.save``, on rank 0; ZeRO-3 shards
        and tensor-parallel slices are gathered first. Call on every rank.

        Returns:
            True (DeepSpeed's return value).

        Example:
            >>> engine.save_16bit_model("export")      # export/pytorch_model.bin
        """
        state = self.full_state_dict(rank0_only=True)
        if self.global_rank == 0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(save_dir) / save_filename)
        self._barrier()
        return True

    # ---- the step ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward (through the ZeRO/DataParallel wrapper)."""
        return self._wrapped(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends an accumulation window (its :meth:`step` steps)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (× the fp16 loss scale).

        Off the accumulation boundary the gradients only accumulate (``no_sync``: no
        communication for stage 0 and 1; stages 2-3 reduce-scatter every micro-batch into their
        gradient shard, as DeepSpeed's stage 2 does).

        Args:
            loss: this rank's 0-d loss of one micro-batch.
            retain_graph: passed to ``backward``.
            scale_wrt_gas: divide by ``gradient_accumulation_steps`` (DeepSpeed's default).

        Returns:
            The loss divided by ``gradient_accumulation_steps`` (what was differentiated, before
            the loss scale), as DeepSpeed returns it.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"loss must be a one-element tensor, got {type(loss).__name__} of shape {getattr(loss, 'shape', None)}"
            )
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        quiet = contextlib.nullcontext() if self.is_gradient_accumulation_boundary() else self.parallel.no_sync()
        with quiet:
            self.parallel.backward(loss, retain_graph=retain_graph)  # × the fp16 loss scale
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At the accumulation boundary: finalize, clip, step (unless an fp16 overflow on any rank),
        update the loss scale, zero the gradients and step the scheduler (with ``lr_kwargs`` as
        its ``step`` keyword arguments, as DeepSpeed passes them); elsewhere only count."""
        if self.is_gradient_accumulation_boundary():
            with record_function("shardkit::engine_step"):
                self._take_model_step(lr_kwargs or {})
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict[str, Any]) -> None:
        """The ParallelModel's clip (unscale, overflow and norm agreed where the layout needs it)
        and step (skipped on an overflow, loss scale updated), then DeepSpeed's bookkeeping."""
        norm = self.parallel.clip(self.config.gradient_clipping or None)
        applied = self.parallel.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self._global_grad_norm = None if norm is None else float(norm)
        self._step_applied = applied
        if applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**lr_kwargs)
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def zero_grad(self) -> None:
        """Forget the accumulated gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def was_step_applied(self) -> bool:
        """Whether the last boundary :meth:`step` ran the optimizer (False: fp16 overflow)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm before clipping of the last optimizer step (``inf`` on an
        overflow; None when neither clipping nor the loss scaler computed it)."""
        return self._global_grad_norm

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer param group."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_loss_scale(self) -> float | None:
        """The current fp16 loss scale (None without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else None

    def train(self, mode: bool = True) -> Engine:
        super().train(mode)
        self._wrapped.train(mode)
        return self

    # ---- state and memory ----------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The module's ``state_dict`` with full tensors (stage 3 gathers over dp, tensor_parallel
        over tp, in the dense model's layout: call on every rank)."""
        if self._tp_state is not None:
            plan, vocab = self._tp_state
            local = self._wrapped.full_state_dict() if hasattr(self._wrapped, "full_state_dict") else self.module.state_dict()
            full = gather_state_dict(local, plan, self.ctx, vocab_sizes=vocab)
            return {} if rank0_only and self.ctx.global_rank != 0 else {k: v.detach().clone() for k, v in full.items()}
        if hasattr(self._wrapped, "full_state_dict"):
            return self._wrapped.full_state_dict(rank0_only=rank0_only)
        if rank0_only and self.ctx.rank("dp") != 0:
            return {}
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def memory_report(self) -> dict[str, Any]:
        """This rank's model-state memory in bytes.

        Stages 1-3: :meth:`ShardedDataParallel.memory_report` (``params``, ``grads``,
        ``master_params``, ``optimizer_state``, ``model_state``, ``peak_transient``,
        ``offloaded``). Stage 0: the same keys for replicated training (fp32 masters of a fused
        optimizer's ``master_weights`` count as ``master_params``).
        """
        if hasattr(self._wrapped, "memory_report"):
            return self._wrapped.memory_report()
        buckets = [b.buffer for b in getattr(self._wrapped, "buckets", [])]
        return replicated_memory_report(self.module.parameters(), self.optimizer, buckets)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
    ) -> bool:
        """Save ``save_dir/tag`` (every rank): model, optimizer, fp32 masters, loss scaler, LR
        scheduler, the engine's counters and ``client_state``; reshardable (another dp size,
        ZeRO stage or tensor_parallel size loads it; with a pipeline, another dp size or stage).
        ``tag`` defaults to ``global_step<N>``; ``save_dir/latest`` names it.

        Example:
            >>> engine.save_checkpoint("ckpt", client_state={"epoch": 3})
        """
        tag = f"global_step{self.global_steps}" if tag is None else tag
        _check_tag(tag)
        extra = {
            "client_state": dict(client_state or {}),
            "engine": {k: getattr(self, k) for k in ("global_steps", "micro_steps", "skipped_steps", "global_samples")},
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
        }
        root = Path(save_dir)
        save_checkpoint(root / tag, self._checkpoint_model(), self.optimizer, scaler=self.loss_scaler, extra=extra)
        if save_latest:
            if self.ctx.global_rank == 0:
                tmp = root / f"{LATEST}.tmp"
                tmp.write_text(tag)
                os.replace(tmp, root / LATEST)  # atomic: a reader sees the old tag or the new one
            self._barrier()
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/tag`` (``tag`` None: the one ``load_dir/latest`` names) into this run.

        Returns:
            ``(path, client_state)``, or ``(None, None)`` when ``tag`` is None and there is no
            ``latest`` file (DeepSpeed's behaviour).

        Raises:
            ValueError: a bad checkpoint (see :func:`shardkit.parallel.load_checkpoint`).
            NotImplementedError: ``load_optimizer_states=False``.

        Example:
            >>> path, client_state = engine.load_checkpoint("ckpt")
        """
        if not load_optimizer_states:
            raise NotImplementedError("load_optimizer_states=False: shardkit checkpoints always restore the optimizer")
        root = Path(load_dir)
        if tag is None:
            latest = root / LATEST
            if not latest.is_file():
                logger.warning("load_checkpoint: %s has no '%s' file; nothing loaded (pass tag=...)", root, LATEST)
                return None, None
            tag = latest.read_text().strip()
        _check_tag(tag)
        path = root / tag
        extra = load_checkpoint(path, self._checkpoint_model(), self.optimizer, scaler=self.loss_scaler)
        if not isinstance(extra, dict) or "engine" not in extra:
            raise ValueError(f"checkpoint {path}: not written by Engine.save_checkpoint (no engine state in its extra)")
        for key, value in extra["engine"].items():
            setattr(self, key, value)
        if load_lr_scheduler_states and self.lr_scheduler is not None:
            if extra["lr_scheduler"] is None:
                raise ValueError(f"checkpoint {path}: holds no lr_scheduler state (load_lr_scheduler_states=False skips it)")
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        return str(path), extra["client_state"]

    def _checkpoint_model(self) -> Any:
        """What :func:`~shardkit.parallel.save_checkpoint` takes for this engine's layout: the dp
        wrapper (or the tp-converted module), whose tp slices it places in the dense tensors."""
        return self._wrapped

    def _barrier(self) -> None:
        # over the world: every rank reads ``latest`` after rank 0 (the writer) replaced it,
        # whatever tp/pp group it is in
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


def _check_tag(tag: Any) -> None:
    if not isinstance(tag, str) or not tag or "/" in tag or tag in (".", "..", LATEST):
        raise ValueError(f"tag must be a non-empty directory name (no '/', not {LATEST!r}), got {tag!r}")
