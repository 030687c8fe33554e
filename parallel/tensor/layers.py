"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Rank ``r`` of the tp axis holds the ``r``-th contiguous slice (Megatron's and DTensor
``Shard(dim)``'s convention): a column-parallel linear keeps rows ``[r o/tp, (r+1) o/tp)`` of the
dense ``weight [out, in]`` (and of ``bias``), a row-parallel linear keeps columns
``[r i/tp, (r+1) i/tp)`` (its bias is replicated and added after the reduction), a
vocab-parallel embedding keeps rows ``[r Vs, (r+1) Vs)`` of ``weight [V, D]``, padded with zero
rows to ``tp * Vs`` when ``V`` is not divisible by tp.

[Note: TP initialization equals the dense layer]
Each layer initializes the *full* dense weight on CPU exactly as ``nn.Linear`` / ``nn.Embedding``
do (same calls, same order, the global CPU generator), then keeps its slice. Seeding every rank
alike (``torch.manual_seed(s)``) and building the layers in the dense model's order therefore
gives the dense model's weights, split. ``from_dense`` slices an existing dense module instead.
(Megatron's ``use_cpu_initialization`` does the same; the transient full weight costs one dense
layer of CPU memory at build time.)

[Note: overlapping the input-gradient all-reduce]
A column-parallel linear's input gradient ``dX = dY W_r`` is a partial sum over the tp ranks'
output columns and must be all-reduced (reduce-scattered under sequence parallelism) before it
flows on. As in Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``, backward issues
that collective asynchronously, computes ``dW = dYᵀ X`` and ``db`` while it is in flight, then
waits: the weight-gradient matmul hides the communication. In a backward split into an input
and a weight pass (ZB-H1) each pass computes only its half ([Note: only the gradients this
backward pass uses] in :mod:`~shardkit.parallel.tensor.functions`): the input pass has no
``dW`` to hide the collective behind, which the pipeline's schedule hides instead.

Communication per Column → Row pair on activations of ``T`` tokens of width ``h`` (element size
``e``), CommStats' payload unit (see ``docs/reference.md``, "Tensor parallel"): forward one
all-reduce of ``T h e`` bytes (Row), backward one of ``T h e`` (Column). With sequence
parallelism: forward all-gather + reduce-scatter, backward reduce-scatter + all-gather, each
``T h e``; plus, in backward, the all-reduce of the Row bias gradient (``h e``), which each rank
otherwise only holds for its own sequence chunk — coalesced with the norms' gradients when the
layers share a :class:`SequenceParallelGrads` (see [Note: one coalesced all-reduce per backward]).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.comm import CommStats, ParallelContext, all_reduce, reduce_scatter

from .functions import (
    gather_along,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tp_region,
    wanted_input_grads,
)
from .rng import set_tp_rng_stream
from .sequence_parallel import SequenceParallelGrads, SequenceParallelNorm

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "SequenceParallelNorm", "is_tp_sharded"]


def _divide(name: str, value: int, tp: int) -> int:
    if value % tp:
        raise ValueError(f"{name}={value} is not divisible by the tp size {tp}")
    return value // tp


def _dense_linear_init(
    out_features: int, in_features: int, bias: bool, init_method: Callable[[torch.Tensor], Any] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full fp32 weight and bias, drawn as ``nn.Linear.reset_parameters`` draws them on CPU."""
    weight = torch.empty(out_features, in_features)
    b = torch.empty(out_features) if bias else None
    if init_method is not None:
        init_method(weight)
        if b is not None:
            b.zero_()
        return weight, b
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if b is not None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
        nn.init.uniform_(b, -bound, bound)
    return weight, b


def _param(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str | None, shard_dim: int | None) -> nn.Parameter:
    p = nn.Parameter(t.to(dtype=dtype or torch.float32, device=device).contiguous())
    if shard_dim is not None:
        p.tensor_parallel_dim = shard_dim  # see is_tp_sharded
    return p


def is_tp_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is one tp rank's slice of a larger tensor (False: replicated on every rank).

    Set by the TP layers on their split weights and biases; a gradient norm over tp sums the
    sharded parameters' squares across ranks and counts replicated ones once.

    Example:
        >>> [is_tp_sharded(p) for p in RowParallelLinear(8, 4, ctx=ctx).parameters()]
        [True, False]
    """
    return getattr(p, "tensor_parallel_dim", None) is not None


def _check_last_dim(layer: str, x: torch.Tensor, expected: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != expected:
        raise ValueError(
            f"{layer}: input must have last dimension {expected} ({what}), got shape {tuple(getattr(x, 'shape', ()))}"
        )


def _check_seq(layer: str, x: torch.Tensor, tp: int) -> None:
    if x.dim() < 2:
        raise ValueError(f"{layer}: sequence_parallel needs an input [..., seq, features], got shape {tuple(x.shape)}")
    if x.shape[-2] % tp:
        raise ValueError(f"{layer}: sequence length {x.shape[-2]} (dim -2) is not divisible by the tp size {tp}")


class _ColumnLinear(torch.autograd.Function):
    """``Y = X_full Wᵀ + b`` with ``f`` (or the sequence all-gather) fused in; see
    [Note: overlapping the input-gradient all-reduce]."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        sequence_parallel: bool,
        stats: CommStats | None,
    ) -> torch.Tensor:
        total = gather_along(x, x.dim() - 2, group, stats) if sequence_parallel else x
        ctx.save_for_backward(total, weight)
        ctx.group, ctx.sp, ctx.stats, ctx.has_bias = group, sequence_parallel, stats, bias is not None
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        total, weight = ctx.saved_tensors
        group, n = ctx.group, ctx.group.size()
        grad_input = handle = None
        # BI of a split backward wants dX only, W dW and db only: [Note: only the gradients this
        # backward pass uses] (a plain backward wants all three, overlapped as the Note above says)
        need_x, need_w, need_b = wanted_input_grads(ctx, (True, True, ctx.has_bias, False, False, False))[:3]
        if need_x:
            grad_input = torch.matmul(grad, weight).contiguous()
            if ctx.sp:
                dim = grad_input.dim() - 2
                stacked = torch.stack(grad_input.chunk(n, dim), 0).contiguous()
                grad_input = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
                handle = reduce_scatter(grad_input, stacked, group=group, async_op=True, stats=ctx.stats)
            else:
                handle = all_reduce(grad_input, group=group, async_op=True, stats=ctx.stats)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_weight = torch.matmul(g2.t(), total.reshape(-1, total.shape[-1])) if need_w else None
        grad_bias = g2.sum(0) if ctx.has_bias and need_b else None
        if handle is not None:
            handle.wait()  # after the weight-gradient matmul: it ran while the collective flew
        return grad_input, grad_weight, grad_bias, None, None, None


_Linear = TypeVar("_Linear", bound="_ShardedLinear")


class _ShardedLinear(nn.Module):
    """What Column- and RowParallelLinear share: building this rank's slice from a dense layer."""

    @classmethod
    def from_dense(cls: type[_Linear], linear: nn.Linear, *, ctx: ParallelContext, **kwargs: Any) -> _Linear:
        """This rank's slice of an existing dense ``nn.Linear`` (same dtype and device).

        Example:
            >>> col = ColumnParallelLinear.from_dense(model.mlp.fc, ctx=ctx)
            >>> row = RowParallelLinear.from_dense(model.mlp.proj, ctx=ctx)
        """
        layer = cls(
            linear.in_features, linear.out_features, ctx=ctx, bias=linear.bias is not None, init_method=nn.init.zeros_, **kwargs
        )
        with torch.no_grad():
            w, b = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
            layer._set_shards(w, b, w.dtype, w.device)
        return layer


class ColumnParallelLinear(_ShardedLinear):
    """``Y = X Aᵀ + b`` with ``A [out, in]`` split by rows (output features) over tp.

    Args:
        in_features: input width (every rank sees the full input).
        out_features: dense output width; divisible by the tp size. Each rank holds
            ``out_features / tp`` rows of the weight and of the bias.
        ctx: the parallel context (tp group = ``ctx.group("tp")``).
        bias: whether to add a (split) bias.
        fused_chunks: the output is ``fused_chunks`` equal blocks split separately (e.g. 3 for a
            fused ``[q; k; v]`` projection: rank ``r`` keeps its heads of each of q, k and v, in
            that order); 1 splits the output as one block.
        gather_output: all-gather the output to ``[..., out]`` (default: return this rank's
            ``[..., out/tp]``, ready for a :class:`RowParallelLinear`).
        sequence_parallel: the input is this rank's sequence chunk ``[..., s/tp, in]``; it is
            all-gathered along the sequence (dim -2) first, and the input gradient
            reduce-scattered back.
        dtype, device: of the parameters (initialized on CPU in fp32, then converted; see
            [Note: TP initialization equals the dense layer]).
        init_method: optional in-place initializer of the full weight (bias then zero); default
            ``nn.Linear``'s.
        stats: optional CommStats recording this layer's collectives.

    Raises:
        ValueError: ``out_features`` not divisible by tp; in ``forward``, an input whose last
            dimension is not ``in_features`` (or, with sequence parallelism, whose sequence
            length is not divisible by tp), before any collective.

    Example:
        >>> torch.manual_seed(0)
        >>> up = ColumnParallelLinear(512, 2048, ctx=ctx)          # rank r: weight [2048/tp, 512]
        >>> down = RowParallelLinear(2048, 512, ctx=ctx)
        >>> y = down(F.gelu(up(x)))                                 # = the dense MLP's output
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        ctx: ParallelContext,
        bias: bool = True,
        fused_chunks: int = 1,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        stats: CommStats | None = None,
    ) -> None:
        super().__init__()
        self.group = ctx.group("tp")
        self.tp, self.tp_rank = self.group.size(), self.group.rank()
        self.in_features, self.out_features = in_features, out_features
        if not isinstance(fused_chunks, int) or fused_chunks < 1:
            raise ValueError(f"fused_chunks must be a positive int, got {fused_chunks!r}")
        self.fused_chunks = fused_chunks
        if fused_chunks > 1 and out_features % (fused_chunks * self.tp):
            raise ValueError(f"out_features={out_features} is not divisible by fused_chunks * tp = {fused_chunks} * {self.tp}")
        self.out_per_rank = _divide("out_features", out_features, self.tp)
        self.gather_output, self.sequence_parallel, self.stats = gather_output, sequence_parallel, stats
        weight, b = _dense_linear_init(out_features, in_features, bias, init_method)
        self._set_shards(weight, b, dtype, device)

    def _set_shards(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None, device: Any) -> None:
        k = self.fused_chunks
        per = self.out_per_rank // k
        rows = torch.cat(
            [torch.arange(j * per * self.tp + self.tp_rank * per, j * per * self.tp + (self.tp_rank + 1) * per) for j in range(k)]
        )
        self.weight = _param(weight[rows.to(weight.device)], dtype, device, 0)
        self.bias = _param(bias[rows.to(bias.device)], dtype, device, 0) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in]`` (``[..., s/tp, in]`` with sequence parallelism) -> ``[..., out/tp]``
        (``[..., out]`` with ``gather_output``)."""
        _check_last_dim(type(self).__name__, x, self.in_features, "in_features")
        if self.sequence_parallel:
            _check_seq(type(self).__name__, x, 1)
        if self.tp == 1:
            return F.linear(x, self.weight, self.bias)
        y = _ColumnLinear.apply(x, self.weight, self.bias, self.group, self.sequence_parallel, self.stats)
        set_tp_rng_stream(sharded=not self.gather_output)  # [Note: tensor-parallel RNG streams]
        if not self.gather_output:
            return y
        y = gather_from_tp_region(y, group=self.group, stats=self.stats)
        if self.fused_chunks > 1:  # [tp, chunks, per] blocks -> [chunks, tp, per]: the dense order
            k, per = self.fused_chunks, self.out_per_rank // self.fused_chunks
            y = y.unflatten(-1, (self.tp, k, per)).transpose(-3, -2).flatten(-3)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} ({self.out_per_rank}/rank), tp={self.tp}, sequence_parallel={self.sequence_parallel}"


class RowParallelLinear(_ShardedLinear):
    """``Y = X Aᵀ + b`` with ``A [out, in]`` split by columns (input features) over tp.

    Each rank multiplies its input slice ``[..., in/tp]`` by its weight columns; the partial
    outputs are all-reduced (``g``) — or reduce-scattered along the sequence with sequence
    parallelism — and the replicated bias is added after.

    Args:
        in_features: dense input width; divisible by the tp size.
        out_features: output width.
        ctx, dtype, device, init_method, stats: as for :class:`ColumnParallelLinear`.
        bias: whether to add a (replicated) bias.
        input_is_parallel: the input is already this rank's ``[..., in/tp]`` (the output of a
            :class:`ColumnParallelLinear`); if False, the full input is split here.
        sequence_parallel: return this rank's sequence chunk ``[..., s/tp, out]``; the bias, then
            added on sequence shards, gets its gradient summed over tp.
        grad_sync: with ``sequence_parallel``, the :class:`SequenceParallelGrads` that sums the
            bias gradient (default: one of its own; ``tensor_parallelize`` shares one per model).

    Raises:
        ValueError: ``in_features`` not divisible by tp; wrong input width, or a sequence length
            not divisible by tp, before any collective.

    Example:
        >>> down = RowParallelLinear(2048, 512, ctx=ctx)      # rank r: weight [512, 2048/tp]
        >>> y = down(h_shard)                                 # [..., 512], summed over tp
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        ctx: ParallelContext,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        stats: CommStats | None = None,
        grad_sync: SequenceParallelGrads | None = None,
    ) -> None:
        super().__init__()
        self.group = ctx.group("tp")
        self.tp, self.tp_rank = self.group.size(), self.group.rank()
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _divide("in_features", in_features, self.tp)
        self.input_is_parallel, self.sequence_parallel, self.stats = input_is_parallel, sequence_parallel, stats
        weight, b = _dense_linear_init(out_features, in_features, bias, init_method)
        self._set_shards(weight, b, dtype, device)
        if sequence_parallel:  # the bias is added on sequence shards: see SequenceParallelGrads
            self.grad_sync = grad_sync if grad_sync is not None else SequenceParallelGrads(group=self.group, stats=stats)
            self.grad_sync.register(self.replicated_parameters())

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters used on sequence shards (the bias, with ``sequence_parallel``)."""
        return [self.bias] if self.sequence_parallel and self.bias is not None else []

    def _set_shards(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None, device: Any) -> None:
        cols = slice(self.tp_rank * self.in_per_rank, (self.tp_rank + 1) * self.in_per_rank)
        old = self.replicated_parameters() if hasattr(self, "grad_sync") else []
        self.weight = _param(weight[:, cols], dtype, device, 1)
        self.bias = _param(bias, dtype, device, None) if bias is not None else None
        if old:  # from_dense replaced the bias: the sum covers the new one only
            self.grad_sync.unregister(old)
            self.grad_sync.register(self.replicated_parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in/tp]`` (``[..., in]`` unless ``input_is_parallel``) -> ``[..., out]``
        (``[..., s/tp, out]`` with sequence parallelism)."""
        name = type(self).__name__
        if self.input_is_parallel:
            _check_last_dim(name, x, self.in_per_rank, f"in_features / tp = {self.in_features} / {self.tp}")
        else:
            _check_last_dim(name, x, self.in_features, "in_features")
        if self.sequence_parallel:
            _check_seq(name, x, self.tp)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, group=self.group, stats=self.stats)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, group=self.group, stats=self.stats)
            # Each rank's bias gradient covers only its sequence chunk: summed over tp.
            bias = None if self.bias is None else self.grad_sync.use(self.bias)
        else:
            # partial is F.linear's fresh output, saved by no backward: summed in place
            y = reduce_from_tp_region(partial, group=self.group, stats=self.stats, inplace=True)
            bias = self.bias
        if self.tp > 1:  # the output: sequence shards, or replicated ([Note: tensor-parallel RNG streams])
            set_tp_rng_stream(sharded=self.sequence_parallel)
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} ({self.in_per_rank}/rank), out_features={self.out_features}, tp={self.tp}, sequence_parallel={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary (rows of ``weight [V, D]``) split over tp.

    Rank ``r`` holds rows ``[r Vs, (r+1) Vs)``, ``Vs = ceil(V / tp)``, zero-padded past ``V``.
    Each rank looks up the ids in its range of real rows (others give 0) and the results are
    all-reduced (reduce-scattered along the sequence with ``sequence_parallel``). The same weight
    can serve as a tied column-parallel LM head: ``logits_shard = copy_to_tp_region(h) @
    emb.weight.t()``.

    Ids outside ``[0, V)`` raise ``IndexError`` as ``nn.Embedding`` does — on every tp rank
    alike, from one all-reduce of 24 bytes (a rank that raised alone would leave the others
    waiting in the lookup's collective), at the cost of a host sync. With ``check_ids=False`` they
    give zero vectors and no gradient; the pad rows past ``V`` never get one either way.

    Args:
        num_embeddings: the real vocabulary size ``V`` (any size; padded per rank).
        embedding_dim: ``D``.
        ctx: the parallel context.
        padding_idx: as ``nn.Embedding``: that row starts at zero and gets no gradient.
        sequence_parallel: return this rank's sequence chunk ``[..., s/tp, D]``.
        dtype, device, stats: as for :class:`ColumnParallelLinear`.
        init_method: optional in-place initializer of the full ``[V, D]`` weight (default
            ``nn.Embedding``'s ``normal_``); ``padding_idx``'s row is zeroed after it.
        check_ids: check that every id is in ``[0, V)`` (the attribute of the same name can be
            changed later, e.g. off once the data pipeline is trusted).

    Raises:
        ValueError: bad ``padding_idx``; non-integer ids or a sequence length not divisible by tp
            (with ``sequence_parallel``), before any collective.
        IndexError: in ``forward``, an id outside ``[0, V)`` (``check_ids``), on every tp rank.

    Example:
        >>> torch.manual_seed(0)
        >>> emb = VocabParallelEmbedding(50257, 768, ctx=ctx)    # rank r: weight [12565, 768] at tp=4
        >>> h = emb(idx)                                        # [b, s, 768], = nn.Embedding's
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        ctx: ParallelContext,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        stats: CommStats | None = None,
        check_ids: bool = True,
    ) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx={padding_idx} must be within num_embeddings={num_embeddings}")
            padding_idx %= num_embeddings
        self.group = ctx.group("tp")
        self.tp, self.tp_rank = self.group.size(), self.group.rank()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.sequence_parallel, self.stats, self.check_ids = sequence_parallel, stats, check_ids
        self.per_rank = -(-num_embeddings // self.tp)
        self.vocab_start = self.tp_rank * self.per_rank
        # real rows of this shard: the rest pad V to tp * Vs and must never be looked up
        self.n_valid = max(0, min(self.per_rank, num_embeddings - self.vocab_start))
        weight = torch.empty(num_embeddings, embedding_dim)
        (init_method or nn.init.normal_)(weight)  # default: nn.Embedding.reset_parameters
        if padding_idx is not None:
            weight[padding_idx].zero_()
        self._set_shard(weight, dtype, device)

    def _set_shard(self, weight: torch.Tensor, dtype: torch.dtype | None, device: Any) -> None:
        shard = weight.new_zeros(self.per_rank, self.embedding_dim)
        rows = weight[self.vocab_start : self.vocab_start + self.per_rank]
        shard[: rows.shape[0]] = rows
        self.weight = _param(shard, dtype, device, 0)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, *, ctx: ParallelContext, **kwargs: Any) -> VocabParallelEmbedding:
        """This rank's rows of an existing dense ``nn.Embedding`` (same dtype and device)."""
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            ctx=ctx,
            padding_idx=embedding.padding_idx,
            init_method=nn.init.zeros_,
            **kwargs,
        )
        with torch.no_grad():
            w = embedding.weight.detach()
            layer._set_shard(w, w.dtype, w.device)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """int ``[...]`` ids -> ``[..., D]`` (``[..., s/tp, D]`` with sequence parallelism)."""
        name = type(self).__name__
        if not isinstance(idx, torch.Tensor) or idx.is_floating_point() or idx.is_complex():
            raise ValueError(f"{name}: input must be an integer tensor of ids, got {getattr(idx, 'dtype', type(idx))}")
        if self.sequence_parallel:
            if idx.dim() < 1 or idx.shape[-1] % self.tp:
                raise ValueError(
                    f"{name}: sequence length {tuple(idx.shape)[-1:]} (last dim of the ids) is not divisible by the tp size {self.tp}"
                )
        if self.check_ids:
            self._check_ids(idx)
        local_pad = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < self.per_rank:
            local_pad = self.padding_idx - self.vocab_start
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.n_valid)  # other ranks' rows, pad rows, bad ids
        if self.tp == 1 and not self.check_ids:
            # F.embedding would raise (CPU) or assert on the device (CUDA): unchecked ids give 0
            out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=local_pad)
            return out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp == 1:
            return F.embedding(idx, self.weight, padding_idx=local_pad)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_region(out, group=self.group, stats=self.stats)
        else:
            out = reduce_from_tp_region(out, group=self.group, stats=self.stats, inplace=True)  # masked_fill's own output
        set_tp_rng_stream(sharded=self.sequence_parallel)  # [Note: tensor-parallel RNG streams]
        return out

    def _check_ids(self, idx: torch.Tensor) -> None:
        """Raise ``IndexError`` on every tp rank if any rank's ids leave ``[0, V)``."""
        if idx.numel() == 0:  # the same shape on every rank: all skip
            return
        # [count of bad ids, -min id, max id], max-reduced: the verdict and the message are the
        # same on every rank, even if some rank's ids differ from the others' (a broken loader)
        bad = ((idx < 0) | (idx >= self.num_embeddings)).sum()
        summary = torch.stack([bad, -idx.min().long(), idx.max().long()])
        if self.tp > 1:
            all_reduce(summary, group=self.group, op="max", stats=self.stats)
        n_bad, neg_lo, hi = summary.tolist()
        if n_bad:
            raise IndexError(
                f"{type(self).__name__}: ids must be in [0, {self.num_embeddings}), got ids in [{-neg_lo}, {hi}] "
                f"({n_bad} out of range on the worst tp rank), as nn.Embedding would raise. "
                "check_ids=False skips this check (its all-reduce and host sync): such ids then give zero vectors"
            )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} ({self.per_rank} rows/rank), tp={self.tp}, check_ids={self.check_ids}"
        )
