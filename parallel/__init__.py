"""Data / sharded / tensor / pipeline parallelism, composed from shardkit.kernels and shardkit.comm.

Example:
    >>> from shardkit.comm import ParallelContext
    >>> from shardkit.parallel import DataParallel, DynamicLossScaler
    >>> ctx = ParallelContext.from_env()
    >>> model = DataParallel(model, ctx)
    >>> sdp = ShardedDataParallel(net, ctx, stage=2)     # or ZeRO-2 instead of DataParallel
    >>> opt = ZeroOptimizer(sdp, FusedAdamW, lr=3e-4)
    >>> tp_model = tensor_parallelize(gpt, ctx, gpt_plan())  # Megatron-style TP over ctx's tp axis
    >>> save_checkpoint("ckpt", sdp, opt); load_checkpoint("ckpt", sdp, opt)  # reshardable
    >>> pipe = PipelineParallel(blocks, ctx, schedule="1f1b", microbatches=8, loss_fn=loss_fn)
    >>> par = parallelize(gpt, ctx, tp_plan=gpt_plan(), pp={"microbatches": 4}, blocks=gpt_blocks)  # dp x tp x pp

The subpackages hold the rest of each family: :mod:`shardkit.parallel.zero` (and its planner),
:mod:`shardkit.parallel.tensor`, :mod:`shardkit.parallel.pipeline`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use (PEP 562): importing shardkit.parallel, or a torch-free module of it such as
# shardkit.parallel.strategy_names (the CLI's strategy choices), costs nothing until a name is used.
_LAZY = {
    "checkpoint_blocks": ".activation_checkpointing",
    "BucketedGradReducer": ".buckets",
    "GradBucket": ".buckets",
    "plan_buckets": ".buckets",
    "AsyncCheckpointer": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "save_checkpoint": ".checkpoint",
    "ParallelModel": ".compose",
    "PipelineOptions": ".compose",
    "parallelize": ".compose",
    "DataParallel": ".data_parallel",
    "OverflowReport": ".grad_utils",
    "clip_grad_norm_": ".grad_utils",
    "unscale_grads_": ".grad_utils",
    "DynamicLossScaler": ".loss_scaler",
    "LossScaleAtMinimumError": ".loss_scaler",
    "PipelineParallel": ".pipeline",
    "GradReducer": ".reducer",
    "TrainingState": ".reducer",
    "ColumnParallelLinear": ".tensor",
    "RowParallelLinear": ".tensor",
    "VocabParallelEmbedding": ".tensor",
    "gpt_plan": ".tensor",
    "tensor_parallelize": ".tensor",
    "vocab_parallel_cross_entropy": ".tensor",
    "fused_linear_cross_entropy": ".tensor",
    "ShardedDataParallel": ".zero",
    "ZeroOptimizer": ".zero",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # once: later lookups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ParallelModel",
    "PipelineOptions",
    "checkpoint_blocks",
    "parallelize",
    "vocab_parallel_cross_entropy",
    "fused_linear_cross_entropy",
    "tensor_parallelize",
    "gpt_plan",
    "VocabParallelEmbedding",
    "RowParallelLinear",
    "PipelineParallel",
    "ColumnParallelLinear",
    "BucketedGradReducer",
    "DataParallel",
    "DynamicLossScaler",
    "GradBucket",
    "GradReducer",
    "LossScaleAtMinimumError",
    "OverflowReport",
    "ShardedDataParallel",
    "TrainingState",
    "ZeroOptimizer",
    "clip_grad_norm_",
    "AsyncCheckpointer",
    "load_checkpoint",
    "save_checkpoint",
    "plan_buckets",
    "unscale_grads_",
]
