"""A small GPT as pipeline blocks ([embed, *blocks, head], optionally tied) shared by the pipeline tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


V, D, T, H = 13, 8, 5, 2


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP, as in GPT-2 (tiny)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        # no qkv bias: the key bias has a zero gradient in exact math, and AdamW turns its
        # rounding noise into full-size steps that no two summation orders agree on
        self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.out = nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt_blocks(n_layers: int, *, tie: bool = True, seed: int = 0) -> list[nn.Module]:
    """``[Embed, Block * n_layers, Head]``; ``tie``: the head's weight *is* the embedding's."""
    torch.manual_seed(seed)
    blocks = [Embed(), *[Block() for _ in range(n_layers)], Head()]
    if tie:
        blocks[-1].out.weight = blocks[0].tok.weight
    return blocks
