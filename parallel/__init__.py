"""Data / sharded / tensor / pipeline parallelism, composed from shardkit.kernels and shardkit.comm.

Example:
    >>> from shardkit.comm import ParallelContext
    >>> from shardkit.parallel import DataParallel, DynamicLossScaler
    >>> ctx = ParallelContext.from_env()
    >>> model = DataParallel(model, ctx)
    >>> sdp = ShardedDataParallel(net, ctx, stage=2)     # or ZeRO-2 instead of DataParallel
    >>> opt = ZeroOptimizer(sdp, FusedAdamW, lr=3e-4)
"""

from .buckets import BucketedGradReducer, GradBucket, plan_buckets
from .data_parallel import DataParallel
from .grad_utils import OverflowReport, clip_grad_norm_, unscale_grads_
from .loss_scaler import DynamicLossScaler, LossScaleAtMinimumError
from .reducer import GradReducer, TrainingState
from .strategy import Strategy, make_strategy
from .zero import ShardedDataParallel, ZeroOptimizer

__all__ = [
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
    "make_strategy",
    "plan_buckets",
    "unscale_grads_",
]
