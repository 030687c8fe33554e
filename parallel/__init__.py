"""Data / sharded / tensor / pipeline parallelism, composed from shardkit.kernels and shardkit.comm.

Example:
    >>> from shardkit.comm import ParallelContext
    >>> from shardkit.parallel import DataParallel, DynamicLossScaler
    >>> ctx = ParallelContext.from_env()
    >>> model = DataParallel(model, ctx)
"""

from .buckets import BucketedGradReducer, GradBucket, plan_buckets
from .data_parallel import DataParallel
from .grad_utils import OverflowReport, clip_grad_norm_, unscale_grads_
from .loss_scaler import DynamicLossScaler, LossScaleAtMinimumError
from .strategy import Strategy, make_strategy

__all__ = [
    "BucketedGradReducer",
    "DataParallel",
    "DynamicLossScaler",
    "GradBucket",
    "LossScaleAtMinimumError",
    "OverflowReport",
    "Strategy",
    "clip_grad_norm_",
    "make_strategy",
    "plan_buckets",
    "unscale_grads_",
]
