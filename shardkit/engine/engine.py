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
import dataclasses
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
from shardkit.parallel.tensor import gather_state_dict, heads_compute_loss

from .resolved import EngineConfig
from .sequence_split import SequenceSplitForward
from .throughput import Monitor, ThroughputTimer

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
        tput_timer: a :class:`~shardkit.engine.throughput.ThroughputTimer`
            (``tput_timer.avg_samples_per_sec()``).
        monitor: a :class:`~shardkit.engine.throughput.Monitor` (``enabled`` False).

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
        sequence_split: SequenceSplitForward | None = None,
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
        # DeepSpeed's progress objects: samples/s from forward to step, a (disabled) monitor
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        self.monitor = Monitor()
        # tensor_parallel: the plan the module was converted with and the real vocabulary size of
        # its vocabulary-split weights (to gather dense state dicts)
        self._tp_state = tp_state
        # sequence_parallel_size > 1: the forward over this rank's tokens ([Note: the engine's
        # forward over cp] in shardkit/engine/sequence_split.py)
        self._sequence_split = sequence_split

    # ---- DeepSpeed's config accessors ----------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self.config.zero.stage

    def zero_hpz_partition_size(self) -> int:
        """``zero_hpz_partition_size``: the ranks stage 3's backward gathers within (1: off)."""
        return self.config.zero.hpz_partition_size

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

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing ``gradient_accumulation_steps`` (the
        micro-batch size per rank stays), as DeepSpeed's. Call it between optimizer steps.
        Boundaries stay where DeepSpeed puts them: at every ``micro_steps`` that is a multiple of
        the new accumulation. So after 3 steps at accumulation 1, a change to 2 makes the next
        window one micro-batch long, as in DeepSpeed.

        Raises:
            ValueError: ``train_batch_size`` is not a positive multiple of
                ``train_micro_batch_size_per_gpu × dp_world_size``, or a micro-batch of the
                current accumulation window was already run.

        Example:
            >>> engine.set_train_batch_size(2 * engine.train_batch_size())   # twice the accumulation
        """
        per_window = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size <= 0:
            raise ValueError(f"train_batch_size must be a positive int, got {train_batch_size!r}")
        if train_batch_size % per_window:
            raise ValueError(
                f"train_batch_size={train_batch_size}: not a multiple of train_micro_batch_size_per_gpu × dp "
                f"({self.train_micro_batch_size_per_gpu()} × {self.dp_world_size} = {per_window})"
            )
        if self.parallel.pipeline is not None:
            raise ValueError(
                "set_train_batch_size: not offered with a pipeline (its micro-batch count is fixed when the "
                "schedule is built); set train_batch_size in the config"
            )
        if self.micro_steps % self.gradient_accumulation_steps():
            raise ValueError(
                "set_train_batch_size: called inside an accumulation window; call it after engine.step() "
                "at a boundary (is_gradient_accumulation_boundary())"
            )
        self._set_accumulation(train_batch_size // per_window)

    def _set_accumulation(self, steps: int) -> None:
        self.config = dataclasses.replace(
            self.config,
            gradient_accumulation_steps=steps,
            train_batch_size=steps * self.train_micro_batch_size_per_gpu() * self.dp_world_size,
        )
        self.tput_timer.batch_size = self.config.train_batch_size

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
        """The module's forward (through the ZeRO/DataParallel wrapper), under ``torch_autocast``'s
        autocast when the config enables it (:meth:`PrecisionConfig.forward_context`). With
        ``sequence_parallel_size`` > 1 it takes each replica's whole sequences and runs this
        rank's tokens ([Note: the engine's forward over cp] in
        :mod:`shardkit.engine.sequence_split`)."""
        self.tput_timer.start()  # stopped by step(): DeepSpeed's timed span
        self.parallel.set_phase("forward")
        with self.config.precision.forward_context(self.ctx.device.type):
            if self._sequence_split is not None:  # with fused heads too: it arms them over the shards
                return self._sequence_split(self._wrapped, args, kwargs)
            if self.parallel.fused_heads:
                return self._forward_fused_loss(args, kwargs)
            return self._wrapped(*args, **kwargs)

    def _forward_fused_loss(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``fused_cross_entropy`` enabled: a Hugging Face ``labels=`` call gets its loss from the
        fused head (the next-token shift HF's loss applies: hidden state ``i`` predicts label
        ``i + 1``; the mean over labels that are not -100, or their sum over
        ``num_items_in_batch`` when given, as HF's); the output's logits are None, none were
        formed. Any other call runs the model as is (logits), once with a warning."""
        labels = kwargs.pop("labels", None)
        if labels is None:
            if not getattr(self, "_warned_fused_without_labels", False):
                object.__setattr__(self, "_warned_fused_without_labels", True)
                logger.warning(
                    "fused_cross_entropy is enabled but this forward has no labels=: the LM head returned logits and "
                    "the fused loss did not run (it runs on Hugging Face-style engine(input_ids=..., labels=...) calls)"
                )
            return self._wrapped(*args, **kwargs)
        items = kwargs.pop("num_items_in_batch", None)
        targets = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)
        heads = self.parallel.fused_heads
        with heads_compute_loss(heads, targets, reduction="mean" if items is None else "sum"):
            out = self._wrapped(*args, **kwargs)
        tuple_out = isinstance(out, tuple)  # return_dict=False: (logits, ...)
        loss = out[0] if tuple_out else getattr(out, "logits", None)
        heads[0].check_returned(loss)  # a model that rescales its logits after the head is refused
        if items is not None:
            loss = loss / items
        if tuple_out:
            return (loss, None, *out[1:])  # HF's order with labels: (loss, logits, ...)
        out["loss"], out["logits"] = loss, None
        return out

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
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            with record_function("shardkit::engine_step"):
                self._take_model_step(lr_kwargs or {})
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict[str, Any]) -> None:
        """The ParallelModel's clip (unscale, overflow and norm agreed where the layout needs it)
        and step (skipped on an overflow, loss scale updated), then DeepSpeed's bookkeeping."""
        max_norm = self.config.gradient_clipping or None
        if max_norm is None and self.parallel.pipeline is None and hasattr(self._wrapped, "finalize_gradients"):
            # DeepSpeed's ZeRO measures the global norm without clipping too (get_global_grad_norm);
            # the ParallelModel's clip below returns this once-per-step result
            self._wrapped.finalize_gradients(None, measure_norm=True)
        norm = self.parallel.clip(max_norm)
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
        overflow). ZeRO 1-3 always measure it, as DeepSpeed's; stage 0 and a pipeline without
        clipping or a loss scaler return None."""
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

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """DeepSpeed's ``engine.module_state_dict()``: the module's ``state_dict``; at ZeRO-3 the
        full tensors, gathered (collective: call on every rank). DeepSpeed returns its partitioned
        placeholders there; ``engine.module.state_dict()`` raises at ZeRO-3 instead of doing the same.

        Example:
            >>> torch.save(engine.module_state_dict(), "model.pt")   # every rank calls it
        """
        if self._sharded_params() and not keep_vars:
            state = {prefix + k: v for k, v in self.full_state_dict().items()}
            if destination is not None:
                destination.update(state)
                return destination
            return state
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """``nn.Module.state_dict`` of the engine (keys ``module.<name>``); at ZeRO-3 the full
        tensors, gathered as :meth:`module_state_dict` (collective)."""
        if args or not self._sharded_params():
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        return self.module_state_dict(destination=destination, prefix=prefix + "module.", keep_vars=keep_vars)

    def _zero3_consolidated_16bit_state_dict(self) -> dict[str, torch.Tensor]:
        """What Hugging Face Accelerate and DeepSpeed-Chat call to export ZeRO-3 weights: the full
        ``state_dict`` in the module's dtype on global rank 0, ``{}`` elsewhere (collective)."""
        return self.full_state_dict(rank0_only=True)

    def _sharded_params(self) -> bool:
        return getattr(self._wrapped, "stage", 0) == 3

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
        ``tag`` defaults to ``global_step<N>``; ``save_dir/latest`` names it. As DeepSpeed,
        ``save_dir/zero_to_fp32.py`` is written too: ``python save_dir/zero_to_fp32.py save_dir
        OUT`` writes the fp32 weights to ``OUT/pytorch_model.bin``
        (:mod:`shardkit.deepspeed.utils.zero_to_fp32`).

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
        if self.ctx.global_rank == 0:
            _write_atomically(root / "zero_to_fp32.py", ZERO_TO_FP32_SCRIPT)
        if save_latest:
            if self.ctx.global_rank == 0:
                _write_atomically(root / LATEST, tag)  # a reader sees the old tag or the new one
            self._barrier()
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/tag`` (``tag`` None: the one ``load_dir/latest`` names) into this run.

        What is restored, as DeepSpeed's flags choose it:

        =====================================  =================================================
        default                                weights, fp32 masters, optimizer state, loss
                                               scaler, counters, LR scheduler
        ``load_optimizer_states=False``        weights, fp32 masters, counters, LR scheduler
                                               (the optimizer and loss scaler keep their state)
        ``load_lr_scheduler_states=False``     the scheduler keeps its state
        ``load_module_only=True``              weights and fp32 masters only (a warm start)
        =====================================  =================================================

        The fp32 masters come from the checkpoint's own masters (DeepSpeed re-derives them from
        the 16-bit weights at stages 1-2 when it skips the optimizer: here they are exact).
        Without the optimizer state, the optimizer's param groups need not match the checkpoint's.

        Returns:
            ``(path, client_state)``, or ``(None, None)`` when ``tag`` is None and there is no
            ``latest`` file (DeepSpeed's behaviour).

        Raises:
            ValueError: a bad checkpoint (see :func:`shardkit.parallel.load_checkpoint`);
                ``load_module_strict=False`` or ``custom_load_fn`` (not offered: every key and
                shape is checked).

        Example:
            >>> path, client_state = engine.load_checkpoint("ckpt")
            >>> engine.load_checkpoint("pretrained", load_module_only=True)  # fine-tune from it
        """
        if not load_module_strict:
            raise ValueError(
                "load_module_strict=False: not offered; a checkpoint loads every key and shape checked "
                "(load a partial state dict into the model before initialize instead)"
            )
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn: not offered; shardkit.parallel.load_checkpoint reads the checkpoint itself")
        root = Path(load_dir)
        if tag is None:
            latest = root / LATEST
            if not latest.is_file():
                logger.warning("load_checkpoint: %s has no '%s' file; nothing loaded (pass tag=...)", root, LATEST)
                return None, None
            tag = latest.read_text().strip()
        _check_tag(tag)
        path = root / tag
        with_optimizer = load_optimizer_states and not load_module_only
        extra = load_checkpoint(
            path,
            self._checkpoint_model(),
            self.optimizer,
            scaler=self.loss_scaler if with_optimizer else None,
            optimizer_state=with_optimizer,
        )
        if not isinstance(extra, dict) or "engine" not in extra:
            raise ValueError(f"checkpoint {path}: not written by Engine.save_checkpoint (no engine state in its extra)")
        if load_module_only:
            return str(path), extra["client_state"]
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


#: what ``Engine.save_checkpoint`` writes next to its checkpoints, as DeepSpeed does
ZERO_TO_FP32_SCRIPT = """#!/usr/bin/env python
# Written by shardkit's Engine.save_checkpoint, as DeepSpeed writes its own zero_to_fp32.py:
#   python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
# writes OUTPUT_DIR/pytorch_model.bin, the model's state_dict with fp32 trained parameters.
from shardkit.deepspeed.utils.zero_to_fp32 import main

if __name__ == "__main__":
    main()
"""


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _check_tag(tag: Any) -> None:
    if not isinstance(tag, str) or not tag or "/" in tag or tag in (".", "..", LATEST):
        raise ValueError(f"tag must be a non-empty directory name (no '/', not {LATEST!r}), got {tag!r}")
