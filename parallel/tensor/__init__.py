"""Tensor (Megatron-style) and sequence parallelism over the ``tp`` axis of a ParallelContext.

Example:
    >>> from shardkit.parallel.tensor import ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy
    >>> up, down = ColumnParallelLinear(512, 2048, ctx=ctx), RowParallelLinear(2048, 512, ctx=ctx)
    >>> y = down(torch.nn.functional.gelu(up(x)))        # 1 all-reduce forward, 1 backward
"""

from .vocab_parallel_loss import vocab_parallel_cross_entropy, vocab_shard_range
from .fused_linear_loss import fused_linear_cross_entropy
from .fused_head import FusedCrossEntropyHead, deferred_heads, fuse_lm_head_loss, heads_compute_loss
from .grad_norm import clip_grad_norm_tp_, unscale_and_clip_model_parallel_
from .functions import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from .plan import (
    Colwise,
    Heads,
    Rowwise,
    ScatterSequence,
    SequenceParallel,
    VocabParallel,
    VocabParallelHead,
    VocabParallelLMHead,
    gather_state_dict,
    gpt_plan,
    plan_modules,
    shard_state_dict,
    tensor_parallelize,
)
from .hf_plans import hf_gpt2_plan, hf_llama_plan, llama_plan
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, is_tp_sharded
from .rng import add_tp_rng_region_, set_tp_rng_stream, tp_rng_region
from .sequence_parallel import SequenceParallelGrads, SequenceParallelNorm, make_sequence_parallel_, share_sequence_parallel_grads

__all__ = [
    "add_tp_rng_region_",
    "clip_grad_norm_tp_",
    "fused_linear_cross_entropy",
    "FusedCrossEntropyHead",
    "deferred_heads",
    "fuse_lm_head_loss",
    "heads_compute_loss",
    "unscale_and_clip_model_parallel_",
    "is_tp_sharded",
    "Colwise",
    "Heads",
    "Rowwise",
    "VocabParallel",
    "VocabParallelHead",
    "VocabParallelLMHead",
    "gather_state_dict",
    "gpt_plan",
    "hf_gpt2_plan",
    "hf_llama_plan",
    "llama_plan",
    "plan_modules",
    "shard_state_dict",
    "tensor_parallelize",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelGrads",
    "ScatterSequence",
    "SequenceParallel",
    "SequenceParallelNorm",
    "make_sequence_parallel_",
    "share_sequence_parallel_grads",
    "VocabParallelEmbedding",
    "copy_to_tp_region",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "set_tp_rng_stream",
    "tp_rng_region",
    "vocab_parallel_cross_entropy",
    "vocab_shard_range",
]
