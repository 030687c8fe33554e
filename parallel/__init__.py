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

from .activation_checkpointing import checkpoint_blocks
from .buckets import BucketedGradReducer, GradBucket, plan_buckets
from .checkpoint import load_checkpoint, save_checkpoint
from .compose import ParallelModel, PipelineOptions, parallelize
from .data_parallel import DataParallel
from .grad_utils import OverflowReport, clip_grad_norm_, unscale_grads_
from .loss_scaler import DynamicLossScaler, LossScaleAtMinimumError
from .pipeline import PipelineParallel
from .reducer import GradReducer, TrainingState
from .strategy import Strategy, make_strategy
from .tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gpt_plan,
    tensor_parallelize,
    vocab_parallel_cross_entropy,
)
from .zero import ShardedDataParallel, ZeroOptimizer

__all__ = [
    "ParallelModel",
    "PipelineOptions",
    "checkpoint_blocks",
    "parallelize",
    "vocab_parallel_cross_entropy",
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
    "Strategy",
    "TrainingState",
    "ZeroOptimizer",
    "clip_grad_norm_",
    "load_checkpoint",
    "save_checkpoint",
    "make_strategy",
    "plan_buckets",
    "unscale_grads_",
]
