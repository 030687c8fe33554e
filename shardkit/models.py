"""A small GPT-style decoder for demos and end-to-end tests of the parallel strategies.

Pre-LayerNorm blocks (GPT-2 layout), causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)``, learned positions, optional tied
input/output embeddings. The defaults (~0.8M parameters) train a few hundred steps on two CPU
cores in about a minute.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "TinyGPT", "gpt_blocks", "lm_loss"]


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`TinyGPT` (validated on construction).

    Attributes:
        vocab_size: number of token ids.
        d_model: residual width; must be divisible by ``n_heads``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        seq_len: maximum sequence length (size of the position table).
        dropout: dropout on attention probabilities and residual branches (0 disables).
        tie_embeddings: share the token embedding with the output projection.

    Example:
        >>> cfg = GPTConfig(vocab_size=59, d_model=64, n_layers=2, n_heads=4, seq_len=32)
        >>> model = TinyGPT.from_config(cfg)
    """

    vocab_size: int = 59
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(B, T, d_model) -> (B, T, d_model)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        # (B, T, 3, H, Dh) -> three (B, H, T, Dh). Shapes come from qkv's output, not from x: under
        # tensor parallelism this rank holds n_heads / tp heads and a qkv/proj slice of that width,
        # and under sequence parallelism x holds T / tp tokens while qkv gathers all T.
        b, t = qkv.shape[:2]
        q, k, v = qkv.view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    """Position-wise feed-forward ``d -> 4d -> d`` with GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer language model.

    Args:
        vocab_size: number of token ids.
        d_model: residual width (divisible by ``n_heads``).
        n_layers: number of pre-LN blocks.
        n_heads: attention heads.
        seq_len: maximum sequence length.
        dropout: dropout probability (0 disables; training mode only).
        tie_embeddings: share token embedding and output projection weights.

    Shapes:
        ``forward(idx)``: ``idx`` ``(B, T)`` integer ids with ``T <= seq_len`` ->
        logits ``(B, T, vocab_size)`` in the parameter dtype (or the autocast dtype).

    Initialisation follows GPT-2: N(0, 0.02) weights, zero biases, and residual output
    projections scaled by ``1/sqrt(2 * n_layers)`` so the residual stream's variance does not
    grow with depth.

    Example:
        >>> model = TinyGPT(vocab_size=59, d_model=64, n_layers=2, n_heads=4, seq_len=32)
        >>> idx = torch.randint(59, (8, 32))
        >>> loss = lm_loss(model(idx), torch.randint(59, (8, 32)))
        >>> loss.backward()
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 128,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
    ) -> None:
        super().__init__()
        cfg = GPTConfig(vocab_size, d_model, n_layers, n_heads, seq_len, dropout, tie_embeddings)
        self.config = cfg
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # residual-branch outputs (attn.proj, mlp.proj)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))

    @classmethod
    def from_config(cls, cfg: GPTConfig) -> TinyGPT:
        """Build a model from a :class:`GPTConfig`.

        Example:
            >>> model = TinyGPT.from_config(GPTConfig(d_model=64, n_layers=2))
        """
        return cls(**asdict(cfg))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied embedding counts once).

        Example:
            >>> TinyGPT(59).num_parameters()
            817280
        """
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for every position.

        Args:
            idx: ``(B, T)`` integer token ids, ``T <= config.seq_len``.

        Returns:
            ``(B, T, vocab_size)`` logits; position ``t`` depends only on ``idx[:, : t + 1]``.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time), got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations autoregressively (no KV cache: demo use only).

        Args:
            idx: ``(B, T0)`` prompt ids.
            max_new_tokens: tokens to append.
            temperature: softmax temperature; ``0`` means greedy.
            generator: RNG for sampling (on ``idx``'s device).

        Returns:
            ``(B, T0 + max_new_tokens)`` ids.

        Example:
            >>> out = model.generate(torch.zeros(1, 1, dtype=torch.long), 100)
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.seq_len :])[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits dtype.

    Args:
        logits: ``(B, T, V)``.
        targets: ``(B, T)`` integer ids.

    Returns:
        0-d fp32 tensor (nats per token).

    Example:
        >>> lm_loss(torch.zeros(2, 3, 59), torch.zeros(2, 3, dtype=torch.long))  # = ln(59)
        tensor(4.0775)
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class _Embed(nn.Module):
    """TinyGPT's input side as a pipeline block: token + position embeddings, dropout."""

    def __init__(self, model: TinyGPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


class _Head(nn.Module):
    """TinyGPT's output side as a pipeline block: final LayerNorm and the LM head."""

    def __init__(self, model: TinyGPT) -> None:
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def gpt_blocks(model: TinyGPT) -> list[nn.Module]:
    """``model`` as a sequence of blocks whose composition is ``model.forward``: embedding, the
    transformer blocks, head — the cut points for pipeline parallelism and activation checkpointing.

    The blocks share ``model``'s modules (no copies), so a tied head still shares the embedding's
    Parameter (the pipeline keeps one copy per stage and synchronizes them).

    Example:
        >>> model = TinyGPT(59, n_layers=4)
        >>> x = torch.randint(59, (2, 8))
        >>> out = x
        >>> for block in gpt_blocks(model):
        ...     out = block(out)
        >>> torch.equal(out, model(x))
        True
    """
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a TinyGPT, got {type(model).__name__}")
    return [_Embed(model), *model.blocks, _Head(model)]
