"""Fused linear + (vocab-parallel) cross-entropy: the LM head's matmul and the loss, chunk by chunk.

The logits of a language model are its largest activation: ``T x V`` values (32k tokens of a
128k vocabulary in fp32 are 16.8 GB), plus as much again for their gradient. Here they never
exist whole. The tokens are walked in chunks; for each chunk

1. ``logits = hidden_chunk @ W_rᵀ (+ b_r)`` for this rank's vocabulary shard (cuBLAS / torch),
2. its per-token statistics (:func:`shardkit.kernels.cross_entropy.ce_shard_stats`, the Triton
   pass on CUDA), all-reduced over tp as :func:`vocab_parallel_cross_entropy` does,
3. the loss, and (when a gradient is wanted) the logits' gradient written over the chunk
   (:func:`shardkit.kernels.cross_entropy.ce_grad_`),
4. ``dhidden_chunk = dlogits @ W_r`` and ``dW_r += dlogitsᵀ @ hidden_chunk`` (fp32 accumulator),

and the chunk is freed before the next. Peak extra memory is one chunk of logits (``chunk_tokens
x V/tp``), whatever ``T`` and ``V`` are.

[Note: the gradient in the forward pass]
For ``reduction="mean"`` or ``"sum"`` the loss is a scalar, so its upstream gradient ``g`` is one
number: the forward pass computes the gradients for ``g = 1`` while each chunk's logits are at
hand, and backward only multiplies them by ``g`` (Liger-Kernel's and Cut Cross-Entropy's trick).
That is three matmuls per chunk, as many as an unfused head + loss (one forward, two backward).
``reduction="none"`` has one upstream gradient per token, which does not factor out of
``dW = Σ_i g_i dlogits_iᵀ h_i``: its backward walks the chunks again and recomputes the logits
(four matmuls). Under ``torch.no_grad()`` or with no input needing a gradient, the forward pass
computes the loss only.

[Note: sequence-parallel chunks]
With sequence parallelism each tp rank holds ``hidden`` for its ``s/tp`` slice of the sequence.
A chunk is ``c`` local rows from every rank, all-gathered into ``tp * c`` rows (never the whole
sequence); the target rows are taken in that gathered order. The chunk's ``dhidden`` (partial
over the vocabulary shards) is reduce-scattered straight back to the ranks that own the rows.
Without sequence parallelism ``hidden`` is the same on every tp rank and its gradient, partial
per shard, is all-reduced once at the end.

[Note: fp16 gradients formed in the forward pass]
The logits' gradient of a mean over ``n`` tokens is ``(p - onehot) / n``: with ``n`` in the
thousands and ``p`` about ``1/V`` that is far below fp16's smallest normal number (6e-5), and an
fp16 gradient formed at upstream gradient 1 loses most of its digits before a loss scale could
lift it (the unfused path multiplies by the scale first). So for fp16 the forward pass forms the
gradients of the *sum* (``p - onehot``, well inside fp16's range) and backward multiplies by
``g / n`` in fp32; the weight gradient is always summed in fp32 there. bf16 has fp32's exponent
range and keeps the mean's gradients as they are.

[Note: the fp32 weight-gradient accumulator]
``dW`` is the sum over chunks of ``dlogitsᵀ @ hidden``. For bf16/fp16 operands it is summed in an
fp32 buffer. On CUDA one GEMM adds each chunk's product into it (cuBLAS with an fp32 output,
``addmm(out_dtype=float32)``); elsewhere the product is formed in the operands' dtype and added.
Either way the accumulator is read and written once per chunk: ``12 x V/tp x d`` bytes, against
``2 x V/tp x d x chunk`` flops. Below about a thousand tokens per chunk that traffic, not the
matmul, sets the time (measured on an H100, d = 4096, V = 256k: 512-token chunks take 1.5x the
time of 4096-token ones), which is why the default chunk is never smaller than
:data:`MIN_CHUNK_TOKENS`. A weight fed by one chunk gets its gradient from one GEMM in its own
dtype, as ``F.linear``'s backward does. Since more than one chunk costs the accumulator's
``4 x V/tp x d`` bytes anyway, the default lets a bf16/fp16 chunk's logits take as much
(``2 d`` tokens, 8192 at d = 4096): when the whole batch fits that (``T <= 2 d``) it is one
chunk, else the fewest chunks the accumulator's size allows. The loss path's peak is then about
twice the accumulator (one chunk of logits beside it), whatever ``T`` is; at the end the fp32
accumulator and the gradient it is rounded to exist together for a moment (``6 x V/tp x d`` bytes
for bf16).

Equal to ``F.cross_entropy(softcap(F.linear(hidden, W, b).float()), target, ...)`` on the gathered
weight: the logits are computed in the inputs' dtype as ``F.linear`` does, then everything is
fp32; the gradient of the logits is rounded to their dtype before the two backward matmuls, as
autograd's backward of ``.float()`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.comm import CommStats, ParallelContext, all_gather, all_reduce, reduce_scatter
from shardkit.kernels.cross_entropy import ce_grad, ce_grad_, ce_shard_stats
from shardkit.kernels.runtime import Backend

from .vocab_parallel_loss import (
    _out_of_range,
    _target_error,
    check_loss_options,
    reduce_shard_stats,
    resolve_vocab_size,
    token_losses,
    vocab_shard_range,
)

__all__ = [
    "fused_linear_cross_entropy",
    "DEFAULT_CHUNK_BYTES",
    "MIN_CHUNK_TOKENS",
    "default_chunk_tokens",
    "planned_chunk_tokens",
]

Reduction = Literal["none", "mean", "sum"]

#: bytes of logits (in their dtype) one chunk may hold when ``chunk_tokens`` is not given ...
DEFAULT_CHUNK_BYTES = 1 << 29
#: ... but never fewer tokens than this: [Note: the fp32 weight-gradient accumulator].
MIN_CHUNK_TOKENS = 2048

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_chunk_tokens(shard_classes: int, element_size: int = 2, *, chunk_bytes: int | None = None) -> int:
    """Tokens per chunk: as many as fit ``chunk_bytes`` (default :data:`DEFAULT_CHUNK_BYTES`) of
    logits over ``shard_classes`` columns (``element_size`` bytes each), and at least
    :data:`MIN_CHUNK_TOKENS`.

    Example:
        >>> default_chunk_tokens(32768)             # bf16: 512 MiB of logits
        8192
        >>> default_chunk_tokens(262144)            # the floor: 1 GiB of bf16 logits
        2048
    """
    budget = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    fit = budget // (max(int(element_size), 1) * max(int(shard_classes), 1))
    return max(MIN_CHUNK_TOKENS, fit)


def planned_chunk_tokens(tokens: int, shard_classes: int, hidden_size: int, dtype: torch.dtype, *, softcap: bool = False) -> int:
    """The chunk :func:`fused_linear_cross_entropy` takes when ``chunk_tokens`` is None.

    :func:`default_chunk_tokens`, except for bf16/fp16: there a chunk may take as much memory as
    the fp32 weight-gradient accumulator that more than one chunk needs anyway (``4 x
    shard_classes x hidden_size`` bytes: ``2 x hidden_size`` tokens of 2-byte logits). With
    ``softcap`` a chunk also holds the capped logits and their gradient in fp32 (10 bytes per
    bf16/fp16 logit more, 4 per fp32 one), and the chunk shrinks to match. When all ``tokens`` fit one chunk they are one;
    otherwise the chunks are made equal (``ceil(tokens / chunks)`` each), so that a last sliver
    does not cost a pass over the accumulator of its own ([Note: the fp32 weight-gradient
    accumulator]).

    Example:
        >>> planned_chunk_tokens(4096, 131072, 4096, torch.bfloat16)     # one chunk
        4096
        >>> planned_chunk_tokens(16384, 131072, 4096, torch.bfloat16)    # 2 GiB, as the accumulator
        8192
        >>> planned_chunk_tokens(9000, 131072, 4096, torch.bfloat16)     # 2 equal chunks, not 8192 + 808
        4500
        >>> planned_chunk_tokens(16384, 131072, 4096, torch.bfloat16, softcap=True)   # the 2048 floor
        2048
        >>> planned_chunk_tokens(16384, 131072, 4096, torch.float32)     # the floor (512 MiB: 1024)
        2048
    """
    element_size = torch.empty(0, dtype=dtype).element_size()
    # softcap: the capped logits in fp32 (in place when they are fp32) and their fp32 gradient, rounded
    # to the logits' dtype: 4 bytes more per fp32 logit, 10 per bf16/fp16 one
    per_logit = element_size + ((4 if element_size == 4 else 10) if softcap else 0)
    rows = default_chunk_tokens(shard_classes, per_logit)
    if dtype != torch.float32:
        rows = max(rows, 4 * hidden_size // per_logit)
    tokens = max(int(tokens), 1)
    chunks = -(-tokens // max(rows, 1))
    return -(-tokens // chunks)


def _equal_local_chunks(n_local: int, rows: int) -> int:
    """Local rows per chunk under sequence parallelism: ``rows`` at most, in equal chunks of the
    ``n_local`` rows (``rows // tp`` alone could leave a sliver, a pass over the accumulator)."""
    n_local, rows = max(n_local, 1), max(rows, 1)
    return -(-n_local // -(-n_local // rows))


@dataclass(frozen=True)
class _Options:
    group: dist.ProcessGroup | None  # None: one vocabulary shard, no collective
    sequence_parallel: bool
    vocab_size: int
    vocab_start: int
    n_valid: int
    ignore_index: int
    smoothing: float
    z_loss: float
    softcap: float | None
    reduction: str
    chunk_rows: int  # local rows per chunk
    backend: Backend
    stats: CommStats | None

    @property
    def tp(self) -> int:
        return 1 if self.group is None else self.group.size()


def _chunk_rows(h: torch.Tensor, t_rows: torch.Tensor, lo: int, hi: int, o: _Options) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden, target)`` of one chunk: local rows, or all ranks' rows gathered
    ([Note: sequence-parallel chunks])."""
    if not o.sequence_parallel:
        return h[lo:hi], t_rows[0, lo:hi]
    rows = torch.empty(o.tp, hi - lo, h.shape[1], dtype=h.dtype, device=h.device)
    all_gather(rows, h[lo:hi].contiguous(), group=o.group, stats=o.stats)
    return rows.view(-1, h.shape[1]), t_rows[:, lo:hi].reshape(-1)


def _capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """fp32 ``cap * tanh(logits / cap)`` (Gemma-2's soft-capping), or the logits themselves."""
    if cap is None:
        return logits
    return logits.float().div_(cap).tanh_().mul_(cap)  # in place when the logits are fp32 already


def _dlogits(
    logits: torch.Tensor, x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, o: _Options
) -> torch.Tensor:
    """The gradient of the chunk's logits in their dtype, written over the chunk when possible."""
    options = dict(
        vocab_size=o.vocab_size,
        vocab_start=o.vocab_start,
        n_valid=o.n_valid,
        ignore_index=o.ignore_index,
        label_smoothing=o.smoothing,
        z_loss=o.z_loss,
        backend=o.backend,
    )
    if o.softcap is None:
        return ce_grad_(logits, t, lse, coef, **options)
    g = ce_grad(x, t, lse, coef, **options)  # fp32, with respect to the capped logits
    g.mul_(x.div_(o.softcap).square_().neg_().add_(1.0))  # d(cap tanh(l / cap))/dl = 1 - tanh²
    return g.to(logits.dtype)


class _WeightGrad:
    """The head weight's gradient, summed over the chunks ([Note: the fp32 weight-gradient
    accumulator]): an fp32 buffer for a bf16/fp16 weight fed by more than one chunk, else a
    buffer of the weight's dtype written by one GEMM per chunk."""

    def __init__(self, weight: torch.Tensor, n_chunks: int) -> None:
        self.dtype = weight.dtype
        # fp16 always sums in fp32: its products are formed unnormalized ([Note: fp16 gradients
        # formed in the forward pass]) and could pass fp16's range
        direct = weight.dtype == torch.float32 or (n_chunks <= 1 and weight.dtype == torch.bfloat16)
        dtype = weight.dtype if direct else torch.float32
        self.acc = torch.empty(weight.shape, dtype=dtype, device=weight.device)
        self.started = False

    def add(self, g: torch.Tensor, hc: torch.Tensor) -> None:
        """``acc += gᵀ @ hc``; the first chunk overwrites (no zero fill)."""
        _gemm_into(self.acc, g.t(), hc, accumulate=self.started)
        self.started = True

    def result(self, scale: torch.Tensor | None) -> torch.Tensor:
        """The gradient in the weight's dtype, times ``scale`` (``None``: 1)."""
        acc, self.acc = self.acc, None
        if not self.started:
            acc.zero_()
        if scale is not None:
            acc.mul_(scale)
        return acc.to(self.dtype)


def _gemm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """``acc (+)= a @ b``; ``acc`` may be fp32 for bf16/fp16 operands (cuBLAS writes fp32 directly)."""
    if acc.dtype == a.dtype:
        torch.addmm(acc, a, b, beta=1 if accumulate else 0, out=acc)
        return
    if acc.is_cuda and _FP32_OUTPUT_GEMM.get(acc.device.type, True):
        try:
            torch.addmm(acc, a, b, beta=1 if accumulate else 0, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):  # a torch without addmm's out_dtype on this device
            _FP32_OUTPUT_GEMM[acc.device.type] = False
    product = torch.mm(a, b)
    acc.add_(product) if accumulate else acc.copy_(product)


#: whether ``torch.addmm(..., out_dtype=float32)`` works on a device type (learned on first use).
_FP32_OUTPUT_GEMM: dict[str, bool] = {}


def _walk(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    t_rows: torch.Tensor,
    o: _Options,
    *,
    loss: torch.Tensor | None,
    lse: torch.Tensor,
    coef: torch.Tensor | None,
    grads: tuple[torch.Tensor | None, _WeightGrad | None, torch.Tensor | None] | None,
) -> None:
    """One pass over the chunks. ``loss`` given: fill it and ``lse`` (``[tp or 1, n_local]``
    fp32, rows in ``t_rows``' order); else read ``lse``. ``grads = (dh, dw, db)``: accumulate the
    gradients scaled by ``coef`` (``[tp or 1, n_local]`` fp32) into those that are not None."""
    n_local = h.shape[0]
    for lo in range(0, n_local, o.chunk_rows):
        hi = min(lo + o.chunk_rows, n_local)
        hc, tc = _chunk_rows(h, t_rows, lo, hi, o)
        logits = F.linear(hc, weight, bias)
        x = _capped(logits, o.softcap)
        if loss is not None:
            local = ce_shard_stats(
                x, tc, vocab_start=o.vocab_start, n_valid=o.n_valid, ignore_index=o.ignore_index, backend=o.backend
            )
            lse_c, x_t, q, _ = reduce_shard_stats(local, o.group, stats=o.stats)
            loss_c = token_losses(
                lse_c, x_t, q, tc, vocab_size=o.vocab_size, ignore_index=o.ignore_index, smoothing=o.smoothing, z_loss=o.z_loss
            )
            lse[:, lo:hi] = lse_c.view(-1, hi - lo)
            loss[:, lo:hi] = loss_c.view(-1, hi - lo)
        if grads is None:
            continue
        lse_c = lse[:, lo:hi].reshape(-1).contiguous()
        coef_c = coef[:, lo:hi].reshape(-1).contiguous()
        g = _dlogits(logits, x, tc, lse_c, coef_c, o)
        del x
        dh, dw, db = grads
        if dh is not None:
            if o.sequence_parallel:  # the rows go back to their ranks, summed over the shards
                reduce_scatter(dh[lo:hi], torch.mm(g, weight), group=o.group, stats=o.stats)
            else:
                torch.mm(g, weight, out=dh[lo:hi])
        if dw is not None:
            dw.add(g, hc)
        if db is not None:
            db.add_(g.sum(0, dtype=torch.float32))
        del g, logits


def _target_rows(target: torch.Tensor, o: _Options) -> torch.Tensor:
    """Targets as ``[tp, n_local]`` (row ``r``: the tokens whose hidden states rank ``r`` holds)
    under sequence parallelism, else ``[1, T]``."""
    if not o.sequence_parallel:
        return target.reshape(1, -1)
    s = target.shape[-1]
    return target.reshape(-1, o.tp, s // o.tp).transpose(0, 1).reshape(o.tp, -1)


def _from_rows(rows: torch.Tensor, target: torch.Tensor, o: _Options) -> torch.Tensor:
    """Inverse of :func:`_target_rows` for a per-token tensor: back to the target's shape."""
    if not o.sequence_parallel:
        return rows.reshape(target.shape)
    s = target.shape[-1]
    return rows.reshape(o.tp, -1, s // o.tp).transpose(0, 1).reshape(target.shape)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        o: _Options,
        want: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        d = hidden.shape[-1]
        h = hidden.reshape(-1, d)
        t_rows = _target_rows(target, o)
        n_keep = (target != o.ignore_index).sum()
        stat_rows = t_rows.shape
        loss = torch.empty(stat_rows, dtype=torch.float32, device=h.device)
        lse = torch.empty(stat_rows, dtype=torch.float32, device=h.device)
        eager = any(want) and o.reduction != "none"  # [Note: the gradient in the forward pass]
        grads = None
        if eager:
            coef = torch.full(stat_rows, 1.0, dtype=torch.float32, device=h.device)
            # [Note: fp16 gradients formed in the forward pass]
            ctx.count = n_keep if o.reduction == "mean" and h.dtype == torch.float16 else None
            if o.reduction == "mean" and ctx.count is None:
                coef /= n_keep  # all tokens ignored: inf, but every gradient term is masked to 0
            grads = _new_grads(h, weight, bias, want, o)
            _walk(h, weight, bias, t_rows, o, loss=loss, lse=lse, coef=coef, grads=grads)
            _finish_hidden_grad(grads[0], o)
            ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grads[0], grads[2])))
            ctx.weight_grad = grads[1]  # an attribute: backward takes it and frees it (not kept with the graph)
        else:
            _walk(h, weight, bias, t_rows, o, loss=loss, lse=lse, coef=None, grads=None)
            ctx.save_for_backward(hidden, weight, bias, t_rows, lse)
        ctx.eager, ctx.o, ctx.want, ctx.consumed = eager, o, want, False
        ctx.shapes = (hidden.shape, None if bias is None else bias.dtype)
        if o.reduction == "sum":
            return loss.sum()
        if o.reduction == "mean":
            return loss.sum() / n_keep  # all tokens ignored: 0 / 0 = nan, as torch
        return _from_rows(loss, target, o)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        o, want = ctx.o, ctx.want
        hidden_shape, bias_dtype = ctx.shapes
        if ctx.eager:
            if ctx.consumed:
                raise RuntimeError(
                    "fused_linear_cross_entropy: a second backward through the same loss (retain_graph=True). "
                    "With reduction='mean' or 'sum' its gradients are computed in the forward pass and handed "
                    "over by the first backward; call it again for another backward, or use reduction='none'"
                )
            ctx.consumed = True
            # Scaled in place (these buffers are this node's own, and this is their only use), and
            # not at all for the usual ``loss.backward()``: one host sync instead of a pass over dW.
            if ctx.count is not None:  # [Note: fp16 gradients formed in the forward pass]
                scale = grad_loss.float() / ctx.count
            else:
                scale = None if bool(grad_loss == 1) else grad_loss.float()
            dh, db = (
                (g if scale is None else g.mul_(scale)) if w else None for g, w in zip(ctx.saved_tensors, (want[0], want[2]))
            )
            dw, ctx.weight_grad = ctx.weight_grad, None
            dw = None if dw is None else dw.result(scale)
        else:
            hidden, weight, bias, t_rows, lse = ctx.saved_tensors
            h = hidden.reshape(-1, hidden.shape[-1])
            coef = _target_rows(grad_loss.float(), o).contiguous()
            dh, dw, db = _new_grads(h, weight, bias, want, o)
            _walk(h, weight, bias, t_rows, o, loss=None, lse=lse, coef=coef, grads=(dh, dw, db))
            _finish_hidden_grad(dh, o)
            dw = None if dw is None else dw.result(None)
        return (
            None if dh is None else dh.view(hidden_shape),
            dw,
            None if db is None else db.to(bias_dtype),
            None,
            None,
            None,
        )


def _new_grads(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, want: tuple[bool, bool, bool], o: _Options
) -> tuple[torch.Tensor | None, _WeightGrad | None, torch.Tensor | None]:
    """Gradient buffers: ``dh`` in the hidden states' dtype (each chunk writes its rows), the
    weight's accumulator, ``db`` zeroed fp32."""
    dh = torch.empty_like(h) if want[0] else None
    dw = _WeightGrad(weight, -(-h.shape[0] // o.chunk_rows)) if want[1] else None
    db = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want[2] else None
    return dh, dw, db


def _finish_hidden_grad(dh: torch.Tensor | None, o: _Options) -> None:
    """Sum the hidden states' gradient over the vocabulary shards (not under sequence
    parallelism: the chunks were reduce-scattered already)."""
    if dh is not None and o.group is not None and not o.sequence_parallel:
        all_reduce(dh, group=o.group, stats=o.stats)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ctx: ParallelContext | None = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: Reduction = "mean",
    chunk_tokens: int | None = None,
    softcap: float | None = None,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
    backend: Backend = "auto",
    stats: CommStats | None = None,
    check_targets: bool = True,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weightᵀ`` without ever holding the logits of all tokens.

    Equals ``F.cross_entropy(softcap(F.linear(hidden, W, b).float()), target, ignore_index=...,
    label_smoothing=..., reduction=...)`` plus ``z_loss * lse²`` per token, where ``W``/``b`` are
    the tp ranks' shards concatenated (unpadded) and ``softcap(x) = softcap * tanh(x / softcap)``.
    The logits are formed ``chunk_tokens`` tokens at a time (see the module docstring), so the
    loss path needs one chunk of logits instead of ``T x V/tp`` for the logits and as much again
    for their gradient.

    Args:
        hidden: ``[..., d]`` fp32/bf16/fp16, the final hidden states (the LM head's input). Under
            ``sequence_parallel`` this rank's sequence slice ``[..., s/tp, d]``.
        weight: ``[V/tp, d]``, same dtype: this rank's rows of the head (or the tied
            embedding's) weight, rank ``r`` holding classes ``[r V/tp, (r+1) V/tp)`` padded with
            zero rows past ``V`` as :class:`VocabParallelEmbedding` pads. With ``ctx=None`` the
            whole ``[V, d]`` weight.
        target: int64 ``[...]``, the hidden states' leading shape (under ``sequence_parallel``:
            the whole sequence, ``[..., s]``, the same on every tp rank): class indices in
            ``[0, V)`` or ``ignore_index``.
        ctx: the parallel context; the statistics are all-reduced over ``ctx.group("tp")``.
            ``None``: one process, no collective.
        bias: optional ``[V/tp]``, the head's bias shard.
        ignore_index: targets equal to it add nothing and are not counted by ``"mean"``.
        label_smoothing: ``ε`` in ``[0, 1]``, torch's definition.
        z_loss: weight of ``lse²`` (PaLM's z-loss; 0 disables it).
        reduction: ``"mean"`` over non-ignored tokens, ``"sum"``, or ``"none"`` (the target's
            shape; its backward recomputes the logits: [Note: the gradient in the forward pass]).
        chunk_tokens: tokens per chunk (summed over the tp ranks under sequence parallelism);
            default: :func:`planned_chunk_tokens`: 512 MiB of logits and at least 2048 tokens,
            and for bf16/fp16 as much as the fp32 weight-gradient accumulator several chunks
            would need (``2 d`` tokens; all at once when ``T <= 2 d``; fewer with ``softcap``),
            in equal chunks. Smaller chunks hold less memory and take more time.
        softcap: Gemma-2's logit soft-capping ``c`` (``c * tanh(x / c)`` before the loss), > 0.
        vocab_size: the real ``V`` when it is not ``tp * V/tp`` (pad rows are masked).
        sequence_parallel: ``hidden`` holds this rank's sequence slice ([Note: sequence-parallel
            chunks]); needs ``ctx``.
        backend: the statistics and gradient kernels' executor
            (:func:`shardkit.kernels.runtime.resolve_backend`).
        stats: optional CommStats recording the collectives.
        check_targets: raise ``IndexError`` (on every tp rank alike, before any collective) when a
            target is outside ``[0, V)`` and not ``ignore_index``; one host sync.

    Returns:
        fp32 loss: a scalar, or the target's shape for ``reduction="none"``. Gradients reach
        ``hidden`` (its dtype), ``weight`` and ``bias`` (accumulated in fp32, returned in their
        dtype).

    Raises:
        ValueError / TypeError: a bad shape, dtype or option, naming the argument, before any
            collective.
        IndexError: an out-of-range target (``check_targets``).
        RuntimeError: a second backward through the same scalar loss (``retain_graph=True``).

    Not twice differentiable: gradients taken with ``create_graph=True`` carry no graph.

    Example:
        >>> h = model.transformer(ids)                              # [b, s, d], no logits
        >>> loss = fused_linear_cross_entropy(h[:, :-1], model.lm_head.weight, ids[:, 1:])
        >>> # tensor parallel: this rank's vocabulary shard of the (tied) weight
        >>> loss = fused_linear_cross_entropy(h, emb.weight, y, ctx=ctx, vocab_size=50257)
        >>> loss.backward()
    """
    group = None if ctx is None else ctx.group("tp")
    tp = 1 if group is None else group.size()
    if isinstance(hidden, torch.Tensor) and torch.is_autocast_enabled(hidden.device.type):
        # as F.linear under autocast: the matmul's operands in the autocast dtype (the casts are
        # ordinary autograd ops: fp32 params get their gradients through them)
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype) if isinstance(weight, torch.Tensor) else weight
        bias = bias.to(dtype) if isinstance(bias, torch.Tensor) else bias
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [vocabulary shard, d], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden must be [..., {weight.shape[1]}] (the weight's d), got shape {tuple(hidden.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype, as for F.linear")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must be a {weight.dtype} tensor of shape [{weight.shape[0]}], got {getattr(bias, 'dtype', type(bias))} "
            f"{tuple(getattr(bias, 'shape', ()))}"
        )
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64:
        raise TypeError(f"target must be an int64 tensor, got {getattr(target, 'dtype', type(target).__name__)}")
    if target.device != hidden.device:
        raise ValueError(f"target is on {target.device} but hidden is on {hidden.device}")
    sp = bool(sequence_parallel) and tp > 1
    if sequence_parallel and ctx is None:
        raise ValueError("sequence_parallel=True needs ctx (the tp group holding the other sequence slices)")
    if sp:
        whole = (*hidden.shape[:-2], hidden.shape[-2] * tp) if hidden.dim() >= 2 else None
        if whole is None or target.shape != whole:
            raise ValueError(
                f"with sequence_parallel, target must be the whole sequence {whole} for hidden slices "
                f"{tuple(hidden.shape)} [..., s/tp, d] at tp={tp}, got {tuple(target.shape)}"
            )
    elif target.shape != hidden.shape[:-1]:
        raise ValueError(f"target must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(target.shape)}")
    check_loss_options(reduction, label_smoothing, z_loss)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int (or None), got {chunk_tokens!r}")
    vocab_size = resolve_vocab_size(vocab_size, tp, weight.shape[0])
    if check_targets:  # the targets are the same on every tp rank: every rank raises alike
        t = target.reshape(-1)
        bad = _out_of_range(t, vocab_size, ignore_index)
        if bool(bad.any()):
            raise IndexError(_target_error(t, vocab_size, ignore_index, int(bad.sum()), "fused_linear_cross_entropy"))
    rows = chunk_tokens
    if rows is None:
        rows = planned_chunk_tokens(target.numel(), weight.shape[0], weight.shape[1], weight.dtype, softcap=softcap is not None)
    start, n_valid = vocab_shard_range(vocab_size, weight.shape[0], 0 if group is None else group.rank())
    options = _Options(
        group=group if tp > 1 else None,
        sequence_parallel=sp,
        vocab_size=vocab_size,
        vocab_start=start,
        n_valid=n_valid,
        ignore_index=int(ignore_index),
        smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        softcap=None if softcap is None else float(softcap),
        reduction=reduction,
        chunk_rows=_equal_local_chunks(target.numel() // tp, rows // tp) if sp else rows,
        backend=backend,
        stats=stats,
    )
    grad_on = torch.is_grad_enabled()
    want = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are settled above
        return _FusedLinearCE.apply(hidden, weight, bias, target, options, want)
