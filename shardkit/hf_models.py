"""Hugging Face ``transformers`` models built from a config (no download), for ``shardkit train --model hf:...``.

``transformers`` is an optional dependency (the ``test`` extra): it is imported when a model is
built, never when this module is imported.

Example:
    >>> model = build_hf_model("hf:gpt2", vocab_size=59, d_model=64, n_layers=2, n_heads=4, seq_len=32)
    >>> logits = model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits   # (1, 8, 59)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["HF_MODELS", "LogitsOnly", "build_hf_model", "hf_tp_plan", "require_transformers"]

#: ``--model`` values that name a ``transformers`` model
HF_MODELS = ("hf:gpt2", "hf:llama")


def require_transformers() -> Any:
    """Import ``transformers`` or raise an ``ImportError`` naming the extra that installs it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "--model hf:gpt2 / hf:llama need the optional dependency 'transformers': "
            "pip install 'shardkit[test]' (or pip install transformers)"
        ) from e
    return transformers


def build_hf_model(
    name: str,
    *,
    vocab_size: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    seq_len: int,
    dropout: float = 0.0,
    attention: str = "eager",
) -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` of the given size.

    GPT-2 ties its LM head to the token embedding (its default); Llama does not (its default),
    uses ``n_heads`` key/value heads (no grouping) and an MLP of ``4 * d_model`` (GPT-2's width).
    Attention is ``"eager"`` by default: the same math on every backend, so runs compare across
    ranks; context parallelism needs ``"sdpa"`` (its plan routes SDPA calls over the cp ranks).

    Args:
        name: ``"hf:gpt2"`` or ``"hf:llama"``.
        vocab_size: tokens (the corpus tokenizer's size).
        d_model: hidden size; divisible by ``n_heads``.
        n_layers: transformer blocks.
        n_heads: attention heads.
        seq_len: the longest sequence (position embeddings / rotary cache).
        dropout: GPT-2's residual, embedding and attention dropout; Llama's attention dropout.
        attention: HF's ``attn_implementation``: ``"eager"`` or ``"sdpa"``.

    Returns:
        The model (fp32, CPU) with ``.config``; ``model(input_ids=x, labels=x).loss`` is the
        shifted next-token loss (HF's ``labels=`` path).

    Raises:
        ValueError: an unknown ``name``.
        ImportError: ``transformers`` is not installed (names the extra).
    """
    if name not in HF_MODELS:
        raise ValueError(f"model must be one of {list(HF_MODELS)}, got {name!r}")
    if attention not in ("eager", "sdpa"):
        raise ValueError(f"attention must be 'eager' or 'sdpa', got {attention!r}")
    tf = require_transformers()
    if name == "hf:gpt2":
        config = tf.GPT2Config(
            vocab_size=vocab_size, n_positions=seq_len, n_embd=d_model, n_layer=n_layers, n_head=n_heads,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation=attention,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(config)
    config = tf.LlamaConfig(
        vocab_size=vocab_size, hidden_size=d_model, intermediate_size=4 * d_model, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_heads, max_position_embeddings=seq_len,
        attention_dropout=dropout, attn_implementation=attention,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config)


class LogitsOnly(nn.Module):
    """``hf(input_ids=x).logits``: a causal LM as ``tokens -> logits`` for :func:`~shardkit.parallel.parallelize`.

    Its one submodule is ``hf``, so the model's parameter names gain the prefix ``hf.``
    (:func:`hf_tp_plan` prefixes the TP plans to match).

    Args:
        hf: a ``transformers`` causal LM.

    Example:
        >>> LogitsOnly(model)(torch.zeros(2, 8, dtype=torch.long)).shape    # (2, 8, vocab)
    """

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` int64 tokens -> ``(B, T, V)`` logits (V: this rank's vocab shard under TP)."""
        return self.hf(input_ids=input_ids, use_cache=False).logits


def hf_tp_plan(name: str, wrapper: LogitsOnly) -> dict[str, Any]:
    """The TP plan of the wrapped model: ``hf_gpt2_plan`` / ``llama_plan`` with every module path
    (and the head's ``tied_to``) under ``hf.``.

    Example:
        >>> plan = hf_tp_plan("hf:gpt2", LogitsOnly(model)); plan["hf.lm_head"].tied_to
        'hf.transformer.wte'
    """
    from shardkit.parallel.tensor import hf_gpt2_plan, llama_plan

    plan: Mapping[str, Any] = (hf_gpt2_plan if name == "hf:gpt2" else llama_plan)(wrapper.hf)
    out = {}
    for key, style in plan.items():
        tied = getattr(style, "tied_to", None)
        out[f"hf.{key}"] = dataclasses.replace(style, tied_to=f"hf.{tied}") if tied else style
    return out
