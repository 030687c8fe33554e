"""Where a tensor-parallel rank's slice of a parameter lies in the full (dense) parameter.

[Note: TP slices in the checkpoint]
A checkpoint stores every parameter as its full, dense, flattened 1-D tensor (see
:mod:`~shardkit.parallel.checkpoint.content`), whatever tp size wrote it. A tp rank holds a
slice along one dimension ``d``: rows of a column-parallel weight (for a fused ``[q; k; v]``
projection one block of rows per chunk), columns of a row-parallel weight, rows of a vocab-
parallel embedding/head (zero padding past the vocabulary, which is not part of the dense
tensor). Viewing the local tensor as ``[A, S_local, B]`` and the full one as ``[A, S_full, B]``
(``A`` the product of the dims before ``d``, ``B`` of those after), each contiguous run of the
slice along ``d`` is, for every ``a``, one contiguous run of the full flattened tensor. So any
contiguous piece of the *local* flattened tensor — the whole slice (DataParallel, one process),
or a ZeRO rank's flat shard of it — is a handful of contiguous pieces of the *full* flattened
tensor: exactly the 1-D chunks :class:`~shardkit.parallel.checkpoint.pieces.FlatPiece` hands to
DCP. DCP then reshards on load by intersecting chunks, so a checkpoint written at tp 2 loads at
tp 1 or 4 (or another dp size or ZeRO stage) with no TP-specific read path.

Cost: a slice along ``d > 0`` (row-parallel weights) is ``A`` chunks (the weight's output rows);
fine for checkpoints of the sizes here, one ``WriteItem`` per chunk.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, is_tp_sharded
from ..tensor.fused_head import FusedCrossEntropyHead
from ..tensor.plan import VocabParallelLMHead

__all__ = ["TPSlice", "tp_size", "tp_slices"]

_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead, FusedCrossEntropyHead)


@dataclass(frozen=True)
class TPSlice:
    """One tp rank's slice of a full tensor (see [Note: TP slices in the checkpoint]).

    Attributes:
        full_shape: the dense tensor's shape.
        local_shape: this rank's parameter's shape (padding rows included).
        dim: the sharded dimension.
        rows: ``(local start, full start, length)`` runs along ``dim``; local indices not
            covered (vocabulary padding) are not part of the full tensor.

    Example:
        >>> s = TPSlice((8, 4), (8, 2), 1, ((0, 2, 2),))    # columns 2..3 of a [8, 4] weight
        >>> s.pieces(0, torch.arange(16.))[:2]               # local rows -> full offsets 2, 6, ...
        [(2, tensor([0., 1.])), (6, tensor([2., 3.]))]
    """

    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dim: int
    rows: tuple[tuple[int, int, int], ...]

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)

    def runs(self) -> tuple[list[int], list[tuple[int, int, int]]]:
        """``(starts, runs)``: ``runs`` = ``(local flat offset, full flat offset, numel)`` in local
        order (adjacent runs merged), ``starts`` their local offsets (for bisect)."""
        cached = self.__dict__.get("_runs")
        if cached is not None:
            return cached
        a_n = math.prod(self.local_shape[: self.dim])
        b = math.prod(self.local_shape[self.dim + 1 :])
        s_l, s_f = self.local_shape[self.dim], self.full_shape[self.dim]
        runs: list[tuple[int, int, int]] = []
        for a in range(a_n):
            for ls, fs, n in self.rows:
                lo, fo = (a * s_l + ls) * b, (a * s_f + fs) * b
                if runs and runs[-1][0] + runs[-1][2] == lo and runs[-1][1] + runs[-1][2] == fo:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n * b)
                else:
                    runs.append((lo, fo, n * b))
        out = ([r[0] for r in runs], runs)
        object.__setattr__(self, "_runs", out)  # frozen dataclass: a private cache
        return out

    def pieces(self, offset: int, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """The full-tensor chunks of ``t``, which holds local flat elements ``[offset, offset + t.numel())``.

        Args:
            offset: the local flat offset of ``t[0]``.
            t: 1-D, contiguous (a view into a param, a shard or a temporary).

        Returns:
            ``(full flat offset, view of t)`` pairs; padding elements are left out.
        """
        starts, runs = self.runs()
        end = offset + t.numel()
        out = []
        i = max(bisect.bisect_right(starts, offset) - 1, 0)
        while i < len(runs) and runs[i][0] < end:
            lo, fo, n = runs[i]
            s, e = max(lo, offset), min(lo + n, end)
            if s < e:
                out.append((fo + s - lo, t.narrow(0, s - offset, e - s)))
            i += 1
        return out


def _slice(p: nn.Parameter, dim: int, full: int, rows: list[tuple[int, int, int]]) -> TPSlice:
    shape = tuple(p.shape)
    full_shape = shape[:dim] + (full,) + shape[dim + 1 :]
    return TPSlice(full_shape, shape, dim, tuple((ls, fs, n) for ls, fs, n in rows if n > 0))


def tp_slices(module: nn.Module) -> dict[nn.Parameter, TPSlice]:
    """Every tp-sharded parameter of ``module`` and where its slice lies in the dense tensor.

    Layers with tp size 1 hold the dense tensor (no entry).

    Raises:
        TypeError: a tp-sharded parameter (``is_tp_sharded``) of a layer this function does not
            know, naming it (its slice could not be placed in the dense tensor).

    Example:
        >>> slices = tp_slices(model)          # after tensor_parallelize(model, ctx, gpt_plan())
        >>> slices[model.blocks[0].mlp.down.weight].full_shape
        (32, 128)
    """
    out: dict[nn.Parameter, TPSlice] = {}
    known: set[nn.Parameter] = set()
    for _, m in module.named_modules():
        if not isinstance(m, _LAYERS):
            continue
        known.update(m.parameters(recurse=False))
        known.add(m.weight)  # a tied head's weight may be registered on the embedding only
        if m.group is None:  # a fused head over the whole vocabulary
            continue
        tp, r = m.group.size(), m.group.rank()
        if tp == 1:
            continue
        if isinstance(m, ColumnParallelLinear):
            per = m.out_per_rank // m.fused_chunks
            rows = [(j * per, j * per * tp + r * per, per) for j in range(m.fused_chunks)]
            for p in (m.weight, m.bias):
                if p is not None:
                    out[p] = _slice(p, 0, m.out_features, rows)
        elif isinstance(m, RowParallelLinear):
            out[m.weight] = _slice(m.weight, 1, m.in_features, [(0, r * m.in_per_rank, m.in_per_rank)])
        else:
            vocab = m.num_embeddings if isinstance(m, VocabParallelEmbedding) else m.vocab_size
            per = m.weight.shape[0]
            start = r * per
            out[m.weight] = _slice(m.weight, 0, vocab, [(0, start, max(0, min(per, vocab - start)))])
    for name, p in module.named_parameters():
        if is_tp_sharded(p) and p not in known:
            raise TypeError(
                f"model: parameter {name!r} is tp-sharded by a layer checkpoints cannot place in the dense tensor "
                "(known: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead, "
                "FusedCrossEntropyHead)"
            )
    return out


def tp_size(module: nn.Module) -> int:
    """The tp size of ``module``'s tensor-parallel layers (1 without any).

    Example:
        >>> tp_size(model)            # after tensor_parallelize over a tp axis of 2
        2
    """
    return next((m.group.size() for m in module.modules() if isinstance(m, _LAYERS) and m.group is not None), 1)
