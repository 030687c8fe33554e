"""Context parallelism: attention over a sequence split across the ranks of ``ctx.group("cp")``.

* :func:`shard_sequence` / :func:`gather_sequence` — this cp rank's tokens of a full tensor and
  back ([Note: sequence layouts]: ``"zigzag"`` balances causal work, ``"contiguous"``);
  :func:`shard_positions` — their positions (for rotary embeddings and masks).
* :func:`context_parallel_attention` — attention of this rank's queries over the whole
  sequence: ``mode="ring"`` (key/value blocks around the ring, blockwise attention merged by
  log-sum-exp), ``mode="ulysses"`` (all-to-all to head shards and back) or ``mode="hybrid"``
  (all-to-all within groups of ``ulysses_size`` cp ranks, the ring across the groups).
* :func:`context_parallelize` with a plan (:func:`gpt_cp_plan`, :func:`hf_gpt2_cp_plan`,
  :func:`llama_cp_plan`) — a whole model on this rank's tokens;
  ``parallelize(..., cp={"plan": ...})`` does it for training, with the loss of
  :class:`SequenceShardedLoss`.

Everything outside attention (embeddings, MLPs, norms, the loss) is per token, so it runs on the
shards unchanged; parameters are replicated over cp and their gradients reduced over the
``dp_cp`` group ([Note: the dp_cp group] in :mod:`shardkit.comm.context`).

Example:
    >>> from shardkit.parallel.context import context_parallel_attention, shard_sequence, gather_sequence
    >>> ctx = ParallelContext.from_env(cp=4)                       # torchrun --nproc-per-node 4
    >>> q, k, v = (shard_sequence(t, ctx, dim=2) for t in (q_full, k_full, v_full))
    >>> out = context_parallel_attention(q, k, v, ctx=ctx, mode="ring", causal=True)
"""

from .attention import MODES, ContextParallelMode, check_ulysses_size, context_parallel_attention
from .hybrid_attention import hybrid_attention
from .plan import ContextParallelOptions, context_parallelize, gpt_cp_plan, hf_gpt2_cp_plan, llama_cp_plan
from .ring_attention import ring_attention
from .sequence_layout import LAYOUTS, SequenceLayout, check_sequence_length, gather_sequence, shard_positions, shard_sequence
from .sequence_loss import SequenceShardedLoss
from .sequence_rng import add_cp_dropout_hooks, cp_rng_region
from .ulysses_attention import check_ulysses_heads, ulysses_attention

__all__ = [
    "ContextParallelMode",
    "ContextParallelOptions",
    "SequenceShardedLoss",
    "add_cp_dropout_hooks",
    "cp_rng_region",
    "context_parallelize",
    "gpt_cp_plan",
    "hf_gpt2_cp_plan",
    "llama_cp_plan",
    "LAYOUTS",
    "MODES",
    "SequenceLayout",
    "check_sequence_length",
    "check_ulysses_heads",
    "check_ulysses_size",
    "context_parallel_attention",
    "gather_sequence",
    "hybrid_attention",
    "ring_attention",
    "shard_positions",
    "shard_sequence",
    "ulysses_attention",
]
