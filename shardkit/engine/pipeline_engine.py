"""The engine of a config with ``pipeline.stages > 1``: DeepSpeed's ``PipelineEngine`` shape.

A pipeline runs a whole batch at once (the schedule interleaves its micro-batches' forwards and
backwards over the stages), so the engine's step is one call, as DeepSpeed's::

    engine, *_ = shardkit.initialize(model=nn.Sequential(...), config=cfg)
    for step in range(steps):
        loss = engine.train_batch(data_iter)    # gradient_accumulation_steps micro-batches,
                                                # pipelined, dp-reduced, clipped, stepped

``engine(...)``, :meth:`PipelineEngine.backward` and :meth:`PipelineEngine.step` raise, naming
``train_batch``. Built on :func:`shardkit.parallel.parallelize` (TP → pipeline split → dp).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import record_function

from shardkit.comm import ParallelContext
from shardkit.parallel import ParallelModel

from .engine import Engine

__all__ = ["PipelineEngine", "PipelineGrid"]


class PipelineEngine(Engine):
    """:class:`~shardkit.engine.Engine` for pipelined configs: :meth:`train_batch` and
    :meth:`eval_batch` replace forward/backward/step, as in DeepSpeed's ``PipelineEngine``.

    Attributes:
        parallel: the :class:`~shardkit.parallel.ParallelModel` (``parallel.pipeline`` is the
            :class:`~shardkit.parallel.PipelineParallel`); :meth:`train_batch` is its
            ``forward_backward`` then the base engine's clip + step.
        module: this rank's stages (an ``nn.ModuleList``).

    Example:
        >>> engine, *_ = shardkit.initialize(model=nn.Sequential(*layers), config={
        ...     "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
        ...     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pipeline": {"stages": 2}})
        >>> loss = engine.train_batch(iter(loader))    # 4 micro-batches of (inputs, labels)
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.training_dataloader: Any = None
        self._data_iter: Iterator[Any] | None = None
        self._batch_fn: Callable[[Any], Any] | None = None

    # ---- DeepSpeed's pipeline accessors --------------------------------------------------------
    def is_first_stage(self) -> bool:
        """Whether this rank runs the first stage (the one that reads the inputs)."""
        return self.parallel.pipeline.is_first

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (the one that reads the labels and the loss)."""
        return self.parallel.pipeline.is_last

    def set_dataiter(self, iterator: Iterator[Any]) -> None:
        """The iterator :meth:`train_batch` reads when called without one."""
        self._data_iter = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn`` to each micro-batch read from the data iterator, before it is checked to
        be an ``(inputs, labels)`` pair (DeepSpeed's ``set_batch_fn``).

        Example:
            >>> engine.set_batch_fn(lambda batch: (batch["input_ids"], batch["labels"]))
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._batch_fn = fn

    @property
    def grid(self) -> PipelineGrid:
        """DeepSpeed's ``engine.grid``: this rank's stage and data-parallel coordinates."""
        return PipelineGrid(self.ctx)

    # ---- refused: the pipeline runs whole batches ----------------------------------------------
    def _refuse(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"engine.{what} is not available with pipeline.stages={self.config.pipeline.stages}: a pipeline runs whole "
            "batches; call engine.train_batch(data_iter) (forward, backward and step of one global batch) or "
            "engine.eval_batch(data_iter), as DeepSpeed's PipelineEngine"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("forward (engine(...))")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        raise self._refuse("backward")

    def step(self) -> None:
        raise self._refuse("step")

    def _checkpoint_model(self) -> ParallelModel:
        # the ParallelModel: checkpoints key this rank's blocks by block index (disjoint over pp)
        return self.parallel

    # ---- the step ------------------------------------------------------------------------------
    def _global_batch(self, data_iter: Iterator[Any] | None) -> tuple[Any, Any]:
        """``gradient_accumulation_steps`` micro-batches ``(inputs, labels)`` concatenated on dim 0,
        on the ranks that read them (first stage: inputs, last: labels); None elsewhere."""
        pipe = self.parallel.pipeline
        if not (pipe.is_first or pipe.is_last):
            return None, None
        it = data_iter if data_iter is not None else self._data_iter
        if it is None:
            return None, None  # the pipeline's agreement raises on every rank, naming this one
        xs, ys = [], []
        for i in range(self.gradient_accumulation_steps()):
            item = next(it)
            if self._batch_fn is not None:
                item = self._batch_fn(item)
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(
                    f"data_iter: micro-batch {i} must be a pair (inputs, labels) of tensors, got {type(item).__name__}"
                )
            xs.append(item[0])
            ys.append(item[1])
        return (torch.cat(xs) if pipe.is_first else None), (torch.cat(ys) if pipe.is_last else None)

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step of one global batch through the pipeline.

        Reads ``gradient_accumulation_steps`` micro-batches ``(inputs, labels)`` from
        ``data_iter`` (default: the iterator of :meth:`set_dataiter`, or the ``training_data``
        given to ``initialize``, read in order and repeated as DeepSpeed's pipeline engine reads
        it) on the first and last stage (other ranks may pass None), runs
        them through the schedule in ``pipeline.microbatches`` pieces, averages the gradients
        over dp, clips to ``gradient_clipping`` (the global norm over tp shards and stages),
        steps the optimizer (skipped on an fp16 overflow) and then the LR scheduler.

        Args:
            data_iter: an iterator of ``(inputs [micro, ...], labels [micro, ...])`` pairs.

        Returns:
            The mean loss of the global batch (0-d fp32, the same on every pipeline rank).

        Example:
            >>> for step in range(steps):
            ...     loss = engine.train_batch(iter_of_micro_batches)
        """
        if data_iter is not None:  # kept for later calls without one, as DeepSpeed's set_dataiterator
            self._data_iter = data_iter
        self.train()  # DeepSpeed's train_batch sets training mode itself (after an eval_batch or eval())
        self.tput_timer.start()
        x, y = self._global_batch(data_iter)
        with record_function("shardkit::engine_train_batch"):
            loss = self.parallel.forward_backward(x, y)
            self._take_model_step({})
        self.tput_timer.stop(global_step=True)
        self.micro_steps += self.gradient_accumulation_steps()
        return loss

    @torch.no_grad()
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> torch.Tensor:
        """The mean loss of ``gradient_accumulation_steps`` micro-batches, without gradients
        (eval mode during the call); the same on every pipeline rank. DeepSpeed's other arguments
        are accepted at their defaults; ``return_logits=True``, ``compute_loss=False``, another
        ``reduce_output``, ``bcast_loss=False`` and ``num_micro_batches`` are refused by name.

        Example:
            >>> val_loss = engine.eval_batch(iter(val_loader))
        """
        given = {
            "return_logits": (return_logits, False),
            "compute_loss": (compute_loss, True),
            "reduce_output": (reduce_output, "avg"),
            "bcast_loss": (bcast_loss, True),
            "num_micro_batches": (num_micro_batches, None),
        }
        for name, (value, default) in given.items():
            if value != default:
                raise ValueError(
                    f"eval_batch({name}={value!r}): not offered; eval_batch returns the mean loss of "
                    "gradient_accumulation_steps micro-batches on every rank"
                )
        x, y = self._global_batch(data_iter)
        return torch.tensor(self.parallel.evaluate(x, y))

    def close(self) -> None:
        """Release the process groups the pipeline made (tied-parameter groups, ZeRO's stage
        context); the engine must not train afterwards. Idempotent; local.

        Example:
            >>> engine.close(); ctx.destroy()
        """
        self.parallel.close()

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's state keyed as ``nn.Sequential(*blocks).state_dict()``, gathered over
        pp (call on every rank); CPU tensors."""
        sd = self.parallel.pipeline.full_state_dict()
        return {} if rank0_only and self.ctx.global_rank != 0 else sd

    def memory_report(self) -> dict[str, Any]:
        """This rank's model-state bytes (its stages): ``params``, ``grads``, ``optimizer_state``."""
        mem = dict(self.parallel.report(self.optimizer).memory)
        mem.setdefault("master_params", 0)
        mem["model_state"] = sum(mem[k] for k in ("params", "grads", "optimizer_state", "master_params"))
        # ZeRO on the pipeline's dp axis: its wrapper knows what went to the host (offload)
        off = self.parallel.module.memory_report()["offloaded"] if self.parallel.strategy is not None else {}
        return {"unit": "bytes", **mem, "peak_transient": mem.get("peak_transient", 0), "offloaded": off}


class PipelineGrid:
    """DeepSpeed's ``PipelineParallelGrid`` read from a :class:`~shardkit.comm.ParallelContext`:
    the pipe (``pp``), data (``dp``) and model/slice (``tp``) coordinates of this rank.

    Example:
        >>> engine.grid.get_stage_id(), engine.grid.get_data_parallel_rank()
        (1, 0)
    """

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.stage_id = ctx.rank("pp")
        self.data_parallel_id = ctx.rank("dp")
        self.pipe_parallel_size = ctx.size("pp")
        self.data_parallel_size = ctx.size("dp")
        self.model_parallel_size = ctx.size("tp")
        self.slice_parallel_size = ctx.size("tp")
        self.global_rank = ctx.global_rank
        self.world_size = ctx.world_size

    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        """This rank's data-parallel index."""
        return self.data_parallel_id

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.ctx.group("pp")

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.ctx.group("dp")

    def get_model_parallel_rank(self) -> int:
        """The tensor-parallel (DeepSpeed: slice-parallel) rank."""
        return self.ctx.rank("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self) -> Any:
        return self.ctx.group("tp")

    def get_slice_parallel_rank(self) -> int:
        return self.ctx.rank("tp")

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.ctx.group("tp")
