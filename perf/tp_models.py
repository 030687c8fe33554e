"""Model builders for `perf/tp.py` (``shardkit bench tp``, ``perf/tp.py``): the same dense weights made tensor-parallel by shardkit's
layers and by DTensor ``parallelize_module``, for TinyGPT and for a stack of pre-LN blocks (with
and without sequence parallelism). Not a script."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT
from shardkit.parallel.tensor import ColumnParallelLinear, RowParallelLinear, SequenceParallelNorm, share_sequence_parallel_grads

__all__ = ["Block", "dtensor_blocks", "dtensor_tinygpt", "ours_blocks"]


@torch.no_grad()
def _whole_heads_per_rank(attns: list[nn.Module], tp: int) -> None:
    """Permute each fused qkv's rows ``[chunk, rank, per] -> [rank, chunk, per]`` so that
    DTensor's contiguous ``Shard(0)`` gives rank r its q, k and v heads; each rank runs
    ``n_heads / tp`` heads."""
    for attn in attns:
        qkv, d = attn.qkv, attn.qkv.out_features // 3
        order = torch.arange(3 * d).view(3, tp, d // tp).transpose(0, 1).reshape(-1)
        qkv.weight.copy_(qkv.weight[order])
        qkv.bias.copy_(qkv.bias[order])
        attn.n_heads //= tp


def dtensor_tinygpt(dense: TinyGPT, mesh: Any) -> TinyGPT:
    """``dense`` (a copy) parallelized with DTensor's ColwiseParallel / RowwiseParallel."""
    model = copy.deepcopy(dense)
    _whole_heads_per_rank([b.attn for b in model.blocks], mesh.size())
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "blocks.*.attn.qkv": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    # src_data_rank=None: every rank already holds the same dense weights; slice locally.
    return parallelize_module(model, mesh, plan, src_data_rank=None)


class _Attention(nn.Module):
    """Causal self-attention taking its sequence length from the qkv output, so the same module
    runs on a sequence chunk under sequence parallelism (the column layer gathers the sequence)."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.qkv, self.proj = n_heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]
        q, k, v = qkv.view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), _Attention(d, n_heads), nn.LayerNorm(d), _MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def ours_blocks(dense: nn.Sequential, ctx: ParallelContext, sp: bool) -> nn.Sequential:
    """Our layers on a copy of ``dense`` (``gpt_plan``'s split; ``sp``: sequence parallel,
    LayerNorms wrapped in SequenceParallelNorm, their and the row biases' gradients summed in one
    coalesced all-reduce). Built by hand: plans have no SP option."""
    model = copy.deepcopy(dense)
    tp = ctx.size("tp")
    for blk in model:
        a, m = blk.attn, blk.mlp
        a.n_heads //= tp
        a.qkv = ColumnParallelLinear.from_dense(a.qkv, ctx=ctx, fused_chunks=3, sequence_parallel=sp)
        a.proj = RowParallelLinear.from_dense(a.proj, ctx=ctx, sequence_parallel=sp)
        m.fc = ColumnParallelLinear.from_dense(m.fc, ctx=ctx, sequence_parallel=sp)
        m.proj = RowParallelLinear.from_dense(m.proj, ctx=ctx, sequence_parallel=sp)
        if sp:
            blk.ln1, blk.ln2 = SequenceParallelNorm(blk.ln1, ctx=ctx), SequenceParallelNorm(blk.ln2, ctx=ctx)
    share_sequence_parallel_grads(model)  # one all-reduce per backward for every norm and row bias
    return model


def dtensor_blocks(dense: nn.Sequential, mesh: Any, sp: bool) -> nn.Sequential:
    """DTensor on a copy of ``dense``: Colwise/Rowwise, and with ``sp`` torchtitan's sequence
    parallel layout (SequenceParallel norms, Colwise input Shard(1), Rowwise output Shard(1))."""
    model = copy.deepcopy(dense)
    _whole_heads_per_rank([b.attn for b in model], mesh.size())
    col = ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel()
    row = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    plan: dict[str, Any] = {"*.attn.qkv": col, "*.attn.proj": row, "*.mlp.fc": col, "*.mlp.proj": row}
    if sp:
        plan.update({"*.ln1": SequenceParallel(), "*.ln2": SequenceParallel()})
    return parallelize_module(model, mesh, plan, src_data_rank=None)
