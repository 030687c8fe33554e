"""Tensor-parallel plans for Hugging Face ``transformers`` models built from their configs.

Plans are data (see :mod:`shardkit.parallel.tensor.plan`); these read only a model's config
(tied embeddings) and never import ``transformers``.
"""

from __future__ import annotations

from torch import nn

from .plan import Colwise, Heads, Rowwise, Style, VocabParallel, VocabParallelHead

__all__ = ["hf_gpt2_plan", "hf_llama_plan", "llama_plan"]


def _hf_tied(model: nn.Module | None, tie_embeddings: bool | None, default: bool) -> bool:
    if tie_embeddings is not None:
        return tie_embeddings
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", default)) if config is not None else default


def hf_gpt2_plan(model: nn.Module | None = None, *, tie_embeddings: bool | None = None) -> dict[str, Style]:
    """The TP plan of a Hugging Face GPT-2 (``GPT2LMHeadModel``).

    GPT-2's projections are ``Conv1D`` (weight ``[in, out]``), hence ``transposed=True``: the fused
    ``c_attn`` (``[q | k | v]`` along the output) is column-parallel with ``fused_chunks=3``,
    ``c_fc`` column-parallel, both ``c_proj`` row-parallel. Each attention module's
    ``num_heads``, ``split_size`` and ``embed_dim`` become the per-rank values, so HF's forward
    (``c_attn(x).split(split_size)``, heads of ``head_dim``) runs unmodified on this rank's heads.
    The vocabulary is split in ``wte`` and ``lm_head`` (tied, as GPT-2's config says).

    Args:
        model: the model, to read ``config.tie_word_embeddings`` (default: tied).
        tie_embeddings: overrides the config.

    Example:
        >>> cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=59)
        >>> model = tensor_parallelize(GPT2LMHeadModel(cfg), ctx, hf_gpt2_plan(model))
        >>> loss = vocab_parallel_cross_entropy(model(ids).logits, y, ctx=ctx, vocab_size=59)
    """
    block = "transformer.h.*."
    return {
        "transformer.wte": VocabParallel(),
        block + "attn": Heads("num_heads", if_present=("split_size", "embed_dim")),
        block + "attn.c_attn": Colwise(fused_chunks=3, transposed=True),
        block + "attn.c_proj": Rowwise(transposed=True),
        block + "mlp.c_fc": Colwise(transposed=True),
        block + "mlp.c_proj": Rowwise(transposed=True),
        "lm_head": VocabParallelHead(tied_to="transformer.wte" if _hf_tied(model, tie_embeddings, True) else None),
    }


def llama_plan(model: nn.Module | None = None, *, tie_embeddings: bool | None = None) -> dict[str, Style]:
    """The TP plan of a Hugging Face Llama (``LlamaForCausalLM``): q/k/v and gate/up projections
    column-parallel, o/down projections row-parallel, the vocabulary split in ``embed_tokens`` and
    ``lm_head``.

    Each rank keeps ``num_attention_heads / tp`` query heads and ``num_key_value_heads / tp``
    key/value heads (grouped-query attention keeps its ratio, so query head ``j`` still reads
    key/value head ``j // groups`` of the same rank). Both counts, read from the attention's
    config, must be divisible by tp (a ``ValueError`` names them otherwise). Recent HF Llama
    attention infers its local head count from the projection width (``view(..., -1,
    head_dim)``); older versions' ``num_heads``, ``num_key_value_heads`` and ``hidden_size``
    attributes, where present, are set to the per-rank values.

    Args:
        model: the model, to read ``config.tie_word_embeddings`` (default: untied).
        tie_embeddings: overrides the config.

    Example:
        >>> model = tensor_parallelize(LlamaForCausalLM(cfg), ctx, llama_plan(model))
        >>> loss = vocab_parallel_cross_entropy(model(ids).logits, y, ctx=ctx, vocab_size=cfg.vocab_size)
    """
    layer = "model.layers.*."
    tie = _hf_tied(model, tie_embeddings, False)
    return {
        "model.embed_tokens": VocabParallel(),
        layer + "self_attn": Heads(
            None,
            if_present=("num_heads", "num_key_value_heads", "hidden_size"),
            config_heads=("num_attention_heads", "num_key_value_heads"),
        ),
        **{layer + f"self_attn.{p}_proj": Colwise() for p in "qkv"},
        layer + "self_attn.o_proj": Rowwise(),
        layer + "mlp.gate_proj": Colwise(),
        layer + "mlp.up_proj": Colwise(),
        layer + "mlp.down_proj": Rowwise(),
        "lm_head": VocabParallelHead(tied_to="model.embed_tokens" if tie else None),
    }


#: The Llama plan under the name matching :func:`hf_gpt2_plan`.
hf_llama_plan = llama_plan
