"""Blockwise attention with a log-sum-exp output, its backward, and the merge of two blocks.

Context parallelism (``shardkit.parallel.context``) computes the attention of a query block
against the key/value blocks of the whole sequence one block at a time (ring attention), so it
needs from each block both the block's output and the log-sum-exp of its scores, and merges them
(the online-softmax rule). This module does that arithmetic and never communicates.

Math, per batch ``b``, query head ``h`` (using key/value head ``h // g``, ``g = H / Hkv``: GQA),
query row ``i`` and key column ``j`` of one block (fp32 throughout)::

    s_ij = scale * q_i · k_j                 visible_ij = not causal or q_pos_i >= k_pos_j
    lse_i = log Σ_{j visible} exp(s_ij)      (-inf when row i sees no key of the block)
    o_i = Σ_{j visible} exp(s_ij - lse_i) v_j (0 when lse_i = -inf)

Two blocks ``(o_a, lse_a)``, ``(o_b, lse_b)`` of the same rows merge to the attention over
their union (:func:`merge_attention_blocks`)::

    lse = logaddexp(lse_a, lse_b)      o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

Backward of the attention over all blocks, given the merged ``lse`` and ``delta_i = dO_i · O_i``
of the final output ``O`` (so each block's gradients are computed independently and summed)::

    p_ij = exp(s_ij - lse_i) (visible only)    dv_j += Σ_i p_ij dO_i
    ds_ij = p_ij (dO_i · v_j - delta_i)        dq_i += scale Σ_j ds_ij k_j     dk_j += scale Σ_i ds_ij q_i

``q_pos``/``k_pos`` are the tokens' positions in the full sequence, so one rule covers every
layout of the sequence over ranks (contiguous, zigzag) and blocks that are partly visible.

Shapes/dtypes: ``q`` ``[B, H, Sq, D]``, ``k``/``v`` ``[B, Hkv, Sk, D]`` with ``H % Hkv == 0``,
fp32/bf16/fp16 (all three the same dtype); ``q_pos`` int64 ``[Sq]``, ``k_pos`` int64 ``[Sk]``;
outputs, ``lse``, ``delta`` and gradients fp32.

[Note: bounded working memory]
The torch path never holds the whole ``[Sq, Sk]`` score matrix. On the CPU, when the positions
form runs of consecutive tokens (the contiguous and zigzag layouts: one or two runs per rank),
every (query run, key run) pair is either fully visible, invisible, or the same run under the
causal mask; those pairs go to torch's fused CPU flash attention
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which tile internally:
memory linear in the sequence), merged with :func:`merge_attention_blocks`. Any other pattern
(and any other device) takes ``chunk_rows`` query rows at a time: one fp32
``[B, H, chunk_rows, Sk]`` score block plus its probabilities, skipping key columns no query
row of the chunk can see under ``causal``.

[Note: kernel tiling]
The Triton path (``backend="triton"``: compiled on CUDA, interpreted on CPU) is
FlashAttention-2 in three kernels, fp32 accumulation, no atomics (deterministic):

* forward: one program per ``(BLOCK_M query rows, b * H + h)``, heaviest tiles first; it reads
  key/value head ``h // g``. It first scans ``k_pos`` for the first and last key any of its rows
  can see (``k_pos <= max q_pos`` of the tile; a whole tile's range, not per row), then runs the
  online softmax (base 2) over the ``BLOCK_N`` key tiles of that range, masking each score by
  ``q_pos >= k_pos``. For sorted positions (contiguous, zigzag) the range is exactly the tiles
  with a visible key; for unsorted ones, tiles inside it may be wholly masked (correct, wasted).
  ``p`` is rounded to the input dtype for ``p @ v``, as flash attention does. A row that saw
  nothing keeps ``l = 0``: out 0, lse ``-inf``.
* backward dk/dv: one program per ``(BLOCK_N keys, b * Hkv + hkv)`` loops over the ``g`` query
  heads of its group and, for each, the query tiles that can see its keys (the same scan, for
  ``q_pos >= min k_pos``), so dk/dv of a key/value head are summed in registers and stored once.
* backward dq: one program per ``(BLOCK_M query rows, b * H + h)`` over the key tiles, as the
  forward. Both recompute ``p`` from the merged lse; a row with lse ``-inf`` gets ``p = 0``.

Launch configs (:func:`_cuda_tiles`) come from ``perf/cuda/attention_kernels.py --sweep`` on an
H200 (bf16, causal, S = 4096) among those with 0 spills: forward 128 x 64 tiles on 8 warps at
D = 128 (128 x 32 on 4 at D <= 64), dq 64 x 32 on 4 (128 x 32 on 8), dk/dv 32 x 64 on 4 warps —
one warpgroup per 64 keys, 2.4x faster there than 8 warps. An sm_80 GPU keeps k and v in
registers for its dots, and at D = 128 needs 8 warps for them not to spill. fp32 inputs take
smaller tiles and exact ("ieee") dots, no TF32. Rows are addressed through their strides (the
feature dimension must be contiguous, else the launcher copies); ``ROW_ALIGN`` tells the
compiler the strides are multiples of 16 bytes, for 128-bit loads. On that H200 at B = 1,
H = 32, Hkv = 8, D = 128, bf16, causal, S = 16384 the forward takes 1.02x and forward + backward
1.01x the time of ``F.scaled_dot_product_attention`` with the flash backend (1.7x and 1.6x at
S = 1024, where fixed costs dominate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .runtime import Backend, resolve_backend, triton_helper, triton_kernel
from .tl_helpers import round_to, widen

__all__ = [
    "attention_block_forward",
    "attention_block_backward",
    "merge_attention_blocks",
    "DEFAULT_CHUNK_ROWS",
]

#: Query rows the torch path scores at once (see [Note: bounded working memory]).
DEFAULT_CHUNK_ROWS = 1024

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be fp32/bf16/fp16, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, sq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be [batch={b}, kv_heads, seq, head_dim={d}], got {tuple(k.shape)}")
    if k.shape[1] < 1 or h % k.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({k.shape[1]})")
    for name, pos, n in (("q_pos", q_pos, sq), ("k_pos", k_pos, k.shape[2])):
        if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or pos.shape != (n,):
            shape = tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__
            raise ValueError(f"{name} must be an int64 tensor of shape ({n},), got {shape}")


def _grouped(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B, Hkv, g, S, D]``: query heads grouped by their key/value head."""
    b, h, s, d = q.shape
    return q.reshape(b, n_kv, h // n_kv, s, d)


def _visible_columns(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> slice | None:
    """Key columns any of these query rows can see: a slice over ``k_pos`` when the visible ones
    are a contiguous run of sorted positions, ``slice(None)`` otherwise; None when none is."""
    if not causal or k_pos.numel() == 0:
        return slice(None)
    top = int(q_pos.max())
    if int(k_pos.min()) > top:
        return None
    if bool((k_pos[1:] >= k_pos[:-1]).all()):
        return slice(0, int(torch.searchsorted(k_pos, top, right=True)))
    return slice(None)


def _runs(pos: torch.Tensor) -> list[slice]:
    """Index ranges over which ``pos`` counts up by one (a layout's chunks)."""
    if pos.numel() == 0:
        return []
    starts = [0, *((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist(), pos.numel()]
    return [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]


#: More (query run, key run) pairs than this: not a chunked layout, take the chunked math path.
_MAX_RUN_PAIRS = 16


def _run_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> list[tuple[slice, slice, bool]] | None:
    """``(query rows, key columns, causal)`` blocks that cover every visible (query, key) pair,
    each fully visible or the same run under the causal mask; None when some pair is partly
    visible otherwise (see [Note: bounded working memory])."""
    if not causal:
        return [(slice(0, q_pos.numel()), slice(0, k_pos.numel()), False)]
    q_runs, k_runs = _runs(q_pos), _runs(k_pos)
    if len(q_runs) * len(k_runs) > _MAX_RUN_PAIRS:
        return None
    if q_pos.numel() == k_pos.numel() and torch.equal(q_pos, k_pos) and bool((q_pos[1:] > q_pos[:-1]).all()):
        # the same increasing positions (a ring's own block): causal by index is causal by position
        return [(slice(0, q_pos.numel()), slice(0, k_pos.numel()), True)]
    pairs = []
    for qs in q_runs:
        q_lo, q_hi = int(q_pos[qs.start]), int(q_pos[qs.stop - 1])
        for ks in k_runs:
            k_lo, k_hi = int(k_pos[ks.start]), int(k_pos[ks.stop - 1])
            if k_lo > q_hi:
                continue  # every key after every query
            if k_hi <= q_lo:
                pairs.append((qs, ks, False))
            elif (q_lo, q_hi) == (k_lo, k_hi):
                pairs.append((qs, ks, True))
            else:
                return None
    return _joined(pairs)


def _joined(pairs: list[tuple[slice, slice, bool]]) -> list[tuple[slice, slice, bool]]:
    """Fully visible pairs with the same query rows and adjacent key columns (then the same key
    columns and adjacent query rows) as one pair: fewer, larger kernel calls and merges (a zigzag
    shard sees a whole other shard's first or second run in one call, as PyTorch's ring does)."""
    for side in (1, 0):  # join key columns, then query rows
        out: list[tuple[slice, slice, bool]] = []
        for pair in pairs:
            last = out[-1] if out else None
            if (
                last is not None
                and not pair[2]
                and not last[2]
                and last[1 - side] == pair[1 - side]
                and last[side].stop == pair[side].start
            ):
                joined = slice(last[side].start, pair[side].stop)
                out[-1] = (last[0], joined, False) if side == 1 else (joined, last[1], False)
            else:
                out.append(pair)
        pairs = sorted(out, key=lambda p: (p[1].start, p[0].start)) if side == 1 else out
    return pairs


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, H, S, D]``: each key/value head repeated for its query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """``t[:, :, rows]`` for torch's CPU flash attention: a strided view (the op reads strides;
    a copy of each slice per run pair was most of ring attention's working memory on the CPU),
    copied only when its last dim is not dense."""
    part = t[:, :, rows]
    return part if part.stride(-1) == 1 else part.contiguous()


def _first_write(seen: torch.Tensor, span: slice, *targets: tuple[torch.Tensor, float]) -> bool:
    """Whether ``span`` of the uninitialized buffers is written for the first time (then the
    caller copies into it); otherwise its unwritten part is set first, each ``(buffer, value)``
    of ``targets`` (indexed ``[:, :, span]``), so the caller can merge or add into all of it.
    Marks ``span`` written in ``seen`` (a bool mask over the buffers' dim 2)."""
    part = seen[span]
    fresh = not bool(part.any())
    if not fresh and not bool(part.all()):  # partly written: initialize the rest
        for buf, value in targets:
            buf[:, :, span][:, :, ~part] = value
    seen[span] = True
    return fresh


def _cpu_flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: list[tuple[slice, slice, bool]],
    out: torch.Tensor, lse: torch.Tensor, scale: float,
) -> None:  # fmt: skip
    """The run pairs through torch's fused CPU flash attention (in fp32, as the chunked path),
    into ``out``/``lse``, which may start uninitialized: each row is set by its first pair,
    merged with later ones, and set to (0, -inf) when no pair covers it."""
    q, kx, vx = q.float(), _expand_kv(k, q.shape[1]).float(), _expand_kv(v, q.shape[1]).float()
    seen = torch.zeros(q.shape[2], dtype=torch.bool)  # rows of out/lse set so far
    for qs, ks, causal in pairs:
        o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _rows(q, qs), _rows(kx, ks), _rows(vx, ks), 0.0, causal, scale=scale
        )
        if _first_write(seen, qs, (out, 0.0), (lse, float("-inf"))):  # merging into (0, -inf) is a copy
            out[:, :, qs] = o
            lse[:, :, qs] = m
        else:
            merge_attention_blocks(out[:, :, qs], lse[:, :, qs], o, m)
    if not bool(seen.all()):  # rows that see no key of this block
        out[:, :, ~seen] = 0
        lse[:, :, ~seen] = float("-inf")


def _cpu_flash_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    pairs: list[tuple[slice, slice, bool]], dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: float,
) -> None:  # fmt: skip
    """The run pairs' gradients through torch's fused CPU flash-attention backward, given the
    merged ``out`` and ``lse`` (so each block's part is exact), added into ``dq``; ``dk``/``dv``
    may start uninitialized: each column is set by its first pair, added to by later ones, and
    zeroed when no pair covers it."""
    h, n_kv = q.shape[1], k.shape[1]
    q, kx, vx, dout = q.float(), _expand_kv(k, h).float(), _expand_kv(v, h).float(), dout.float()
    seen = torch.zeros(k.shape[2], dtype=torch.bool)  # key columns of dk/dv set so far
    for qs, ks, causal in pairs:
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _rows(dout, qs), _rows(q, qs), _rows(kx, ks), _rows(vx, ks), _rows(out, qs), _rows(lse, qs), 0.0, causal,
            scale=scale,
        )  # fmt: skip
        dq[:, :, qs] += gq
        if n_kv != h:  # each key/value head's gradient: the sum over its query heads
            b, _, sk, d = gk.shape
            gk, gv = gk.view(b, n_kv, h // n_kv, sk, d).sum(2), gv.view(b, n_kv, h // n_kv, sk, d).sum(2)
        if _first_write(seen, ks, (dk, 0.0), (dv, 0.0)):
            dk[:, :, ks] = gk
            dv[:, :, ks] = gv
        else:
            dk[:, :, ks] += gk
            dv[:, :, ks] += gv
    if not bool(seen.all()):  # keys no query of this block sees: no gradient
        dk[:, :, ~seen] = 0
        dv[:, :, ~seen] = 0


def attention_block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    backend: Backend = "auto",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query block over one key/value block, with the rows' log-sum-exp.

    See the module docstring for the math.

    Args:
        q: ``[B, H, Sq, D]``; k, v: ``[B, Hkv, Sk, D]`` (``H % Hkv == 0``), one float dtype.
        q_pos, k_pos: int64 ``[Sq]``/``[Sk]``, the tokens' positions in the full sequence.
        scale: score scale; default ``1/sqrt(D)``.
        causal: query ``i`` sees key ``j`` only when ``q_pos[i] >= k_pos[j]``.
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`.
        chunk_rows: torch path only: see [Note: bounded working memory].

    Returns:
        ``(out, lse)``: fp32 ``[B, H, Sq, D]`` (0 on rows that see nothing) and fp32
        ``[B, H, Sq]`` (``-inf`` on those rows).

    Example:
        >>> pos = torch.arange(q.shape[2])
        >>> out, lse = attention_block_forward(q, k, v, pos, pos)
        >>> torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True).float())
    """
    _check(q, k, v, q_pos, k_pos)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    b, h, sq, d = q.shape
    n_kv = k.shape[1]
    triton_path = resolve_backend(backend, q.device) == "triton"
    pairs = _run_pairs(q_pos, k_pos, causal) if q.device.type == "cpu" and not triton_path else None
    if pairs is not None:  # it sets every row itself
        out = torch.empty(b, h, sq, d, dtype=torch.float32, device=q.device)
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        _cpu_flash_forward(q, k, v, pairs, out, lse, scale)
        return out, lse
    out = torch.zeros(b, h, sq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    if triton_path:
        _triton_forward(q, k, v, q_pos, k_pos, out, lse, scale=scale, causal=causal)
        return out, lse
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)  # [B, Hkv, 1, Sk, D]
    qg = _grouped(q, n_kv)
    og, lg = _grouped(out, n_kv), lse.view(b, n_kv, h // n_kv, sq)
    for lo in range(0, sq, max(1, chunk_rows)):
        hi = min(lo + chunk_rows, sq)
        cols = _visible_columns(q_pos[lo:hi], k_pos, causal)
        if cols is None:
            continue
        s = torch.matmul(qg[:, :, :, lo:hi].float(), kf[..., cols, :].transpose(-1, -2)).mul_(scale)
        if causal:
            s.masked_fill_(q_pos[lo:hi, None] < k_pos[None, cols], float("-inf"))
        m = s.logsumexp(dim=-1)
        seen = torch.isfinite(m)
        p = s.sub_(torch.where(seen, m, 0.0).unsqueeze(-1)).exp_()
        og[:, :, :, lo:hi] = torch.matmul(p, vf[..., cols, :])
        lg[:, :, :, lo:hi] = m
    return out, lse


def attention_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    backend: Backend = "auto",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    out: torch.Tensor | None = None,
    dq_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This key/value block's part of the attention gradients.

    ``lse`` and ``delta`` belong to the attention over *all* blocks (merged), so the parts of
    every block sum to the full gradients; see the module docstring.

    Args:
        dout: ``[B, H, Sq, D]``, the gradient of the final output (any float dtype).
        q, k, v, q_pos, k_pos, scale, causal: as in :func:`attention_block_forward`.
        lse: fp32 ``[B, H, Sq]``, the merged log-sum-exp.
        delta: fp32 ``[B, H, Sq]``, ``(dout * out).sum(-1)`` of the merged output.
        backend, chunk_rows: as in :func:`attention_block_forward`.
        out: optional fp32 ``[B, H, Sq, D]``, the merged output ``delta`` came from; with it the
            CPU torch path can use torch's fused flash-attention backward ([Note: bounded working
            memory]).
        dq_into: optional contiguous fp32 ``[B, H, Sq, D]`` the block's query gradient is added
            into (and returned as ``dq``): a ring's running ``dq``, with no second q-sized buffer
            on the torch paths (the Triton path still computes into a fresh one, then adds).
            ``dout`` may be strided (e.g. the transposed gradient of a ``[B, Sq, H, D]`` output).

    Returns:
        ``(dq, dk, dv)``: fp32 ``[B, H, Sq, D]``, ``[B, Hkv, Sk, D]``, ``[B, Hkv, Sk, D]``.

    Example:
        >>> out, lse = attention_block_forward(q, k, v, pos, pos)
        >>> dq, dk, dv = attention_block_backward(dout, q, k, v, lse, (dout * out).sum(-1), pos, pos)
    """
    _check(q, k, v, q_pos, k_pos)
    b, h, sq, d = q.shape
    for name, t in (("lse", lse), ("delta", delta)):
        if t.shape != (b, h, sq) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 of shape {(b, h, sq)}, got {t.dtype} {tuple(t.shape)}")
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {tuple(q.shape)}, got {tuple(dout.shape)}")
    if dq_into is not None and (
        dq_into.shape != q.shape or dq_into.dtype != torch.float32 or not dq_into.is_contiguous() or dq_into.device != q.device
    ):
        raise ValueError(f"dq_into must be a contiguous fp32 tensor of q's shape {tuple(q.shape)} on q's device")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    n_kv = k.shape[1]
    triton_path = resolve_backend(backend, q.device) == "triton"
    # the kernels below add into dq, except the Triton one, which stores
    dq = dq_into if dq_into is not None and not triton_path else torch.zeros(b, h, sq, d, dtype=torch.float32, device=q.device)
    pairs = _run_pairs(q_pos, k_pos, causal) if q.device.type == "cpu" and out is not None and not triton_path else None
    # the CPU flash path sets every key column itself (first write, then adds; unseen keys 0)
    alloc = torch.empty if pairs is not None else torch.zeros
    dk = alloc(k.shape, dtype=torch.float32, device=q.device)
    dv = alloc(k.shape, dtype=torch.float32, device=q.device)
    if triton_path:
        _triton_backward(dout, q, k, v, lse, delta, q_pos, k_pos, dq, dk, dv, scale=scale, causal=causal)
        if dq_into is not None:
            dq = dq_into.add_(dq)
        return dq, dk, dv
    if pairs is not None:
        assert out is not None
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
        _cpu_flash_backward(dout, q, k, v, out, lse, pairs, dq, dk, dv, scale)
        return dq, dk, dv
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    qg, dog, dqg = _grouped(q, n_kv), _grouped(dout, n_kv), _grouped(dq, n_kv)
    lg, dg = lse.view(b, n_kv, h // n_kv, sq), delta.view(b, n_kv, h // n_kv, sq)
    for lo in range(0, sq, max(1, chunk_rows)):
        hi = min(lo + chunk_rows, sq)
        cols = _visible_columns(q_pos[lo:hi], k_pos, causal)
        if cols is None:
            continue
        qc, doc = qg[:, :, :, lo:hi].float(), dog[:, :, :, lo:hi].float()
        kc, vc = kf[..., cols, :], vf[..., cols, :]
        m = lg[:, :, :, lo:hi]
        s = torch.matmul(qc, kc.transpose(-1, -2)).mul_(scale)
        # rows that saw no key anywhere have lse = -inf and no gradient
        p = s.sub_(torch.where(torch.isfinite(m), m, float("inf")).unsqueeze(-1)).exp_()
        if causal:
            p.masked_fill_(q_pos[lo:hi, None] < k_pos[None, cols], 0.0)
        dv[:, :, cols] += torch.matmul(p.transpose(-1, -2), doc).sum(dim=2)
        ds = p.mul_(torch.matmul(doc, vc.transpose(-1, -2)).sub_(dg[:, :, :, lo:hi].unsqueeze(-1)))
        dqg[:, :, :, lo:hi] += torch.matmul(ds, kc).mul_(scale)
        dk[:, :, cols] += torch.matmul(ds.transpose(-1, -2), qc).sum(dim=2).mul_(scale)
    return dq, dk, dv


def merge_attention_blocks(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block's ``(block_out, block_lse)`` into the running ``(out, lse)``, in place.

    Rows where both log-sum-exps are ``-inf`` stay ``(0, -inf)``.

    Args:
        out: fp32 ``[..., S, D]``, updated in place; lse: fp32 ``[..., S]``, updated in place.
        block_out, block_lse: the same shapes, from :func:`attention_block_forward`.

    Example:
        >>> out, lse = attention_block_forward(q, k[:, :, :n], v[:, :, :n], q_pos, k_pos[:n])
        >>> merge_attention_blocks(out, lse, *attention_block_forward(q, k[:, :, n:], v[:, :, n:], q_pos, k_pos[n:]))
    """
    new = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, 0.0)
    w_old = torch.where(finite, (lse - safe).exp(), 0.0).unsqueeze(-1)
    w_new = torch.where(finite, (block_lse - safe).exp(), 0.0).unsqueeze(-1)
    out.mul_(w_old).add_(block_out * w_new)
    lse.copy_(new)


# ---- Triton kernels (see [Note: kernel tiling]) -------------------------------------------------

_LOG2E = 1.4426950408889634  # the kernels work in base 2: exp(x) = exp2(x * log2(e))
_MAX_HEAD_DIM = 128


@triton_helper
def _visible_span(pos_ptr, n, bound, KEYS: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr):
    """``(lo, hi)``: the indices of ``pos[:n]`` to visit, from the first visible one rounded down
    to a multiple of ``BLOCK`` to one past the last; ``lo >= hi`` when none is visible.

    Visible means ``pos <= bound`` for keys (``KEYS``: ``bound`` is the tile's largest query
    position) and ``pos >= bound`` for queries (``bound`` is the tile's smallest key position).
    Scans ``pos`` in pieces of ``SCAN`` (int64 positions, ~8 per thread)."""
    first = n
    last = n * 0 - 1
    for start in range(0, n, SCAN):
        idx = start + tl.arange(0, SCAN)
        inside = idx < n
        pos = tl.load(pos_ptr + idx, mask=inside, other=0)
        if KEYS:
            seen = inside & (pos <= bound)
        else:
            seen = inside & (pos >= bound)
        first = tl.minimum(first, tl.min(tl.where(seen, idx, n), 0))
        last = tl.maximum(last, tl.max(tl.where(seen, idx, -1), 0))
    return first // BLOCK * BLOCK, last + 1


@triton_helper
def _feature_mask(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The valid lanes of the padded feature dimension; a constant when there is no padding, so
    that masked row loads stay vectorized along it."""
    if BLOCK_D == HEAD_DIM:
        return tl.full([BLOCK_D], 1, tl.int1)
    else:
        return tl.arange(0, BLOCK_D) < HEAD_DIM


@triton_helper
def _dot(a, b, DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr):
    """``a @ b`` accumulated in fp32.

    With ``WIDEN_DOT`` (interpreted bf16 only) the operands are first widened, exactly, to fp32:
    Triton 3.9's interpreter multiplies bf16 operands' raw 16-bit patterns. Products of bf16
    values are exact in fp32, so this is the tensor cores' arithmetic up to the order of the sum.
    """
    if WIDEN_DOT:
        return tl.dot(widen(a), widen(b), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton_helper
def _narrow(x, DTYPE: tl.constexpr, WIDEN_DOT: tl.constexpr):
    """fp32 ``x`` as a ``DTYPE`` dot operand, rounded to nearest even by both executors (the
    interpreter truncates a plain fp32 -> bf16 cast; see ``round_to``)."""
    if WIDEN_DOT:
        return round_to(x, DTYPE)
    else:
        return x.to(DTYPE)


@triton_helper
def _aligned(stride, ROW_ALIGN: tl.constexpr):
    """``stride`` (a multiple of ``ROW_ALIGN``, which the launcher checked), written so that the
    compiler knows it: a hint on a scalar argument is dropped, the rounding is not."""
    if ROW_ALIGN > 1:
        return stride // ROW_ALIGN * ROW_ALIGN
    else:
        return stride


def _attn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_pos_ptr,  # int64 [Sq]
    k_pos_ptr,  # int64 [Sk]
    out_ptr,  # fp32 [B, H, Sq, D], contiguous
    lse_ptr,  # fp32 [B, H, Sq], contiguous
    stride_qb: tl.int64,
    stride_qh: tl.int64,
    stride_qm: tl.int64,
    stride_kb: tl.int64,
    stride_kh: tl.int64,
    stride_kn: tl.int64,
    stride_vb: tl.int64,
    stride_vh: tl.int64,
    stride_vn: tl.int64,
    n_heads: tl.int32,  # H
    group: tl.int32,  # H // Hkv: query heads per key/value head
    seq_q: tl.int32,
    seq_k: tl.int32,
    qk_scale: tl.float32,  # scale * log2(e)
    HEAD_DIM: tl.constexpr,  # D (the last dimension has unit stride)
    CAUSAL: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # every row stride is a multiple of this many elements
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32)
    WIDEN_DOT: tl.constexpr,  # interpreter, bf16: see _dot
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    SCAN: tl.constexpr,
):
    # heaviest query tiles first (under a causal mask with sorted positions): a shorter tail
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    hkv = h // group
    start_m = pid_m * BLOCK_M
    stride_qb = _aligned(stride_qb, ROW_ALIGN)
    stride_qh = _aligned(stride_qh, ROW_ALIGN)
    stride_qm = _aligned(stride_qm, ROW_ALIGN)
    stride_kb = _aligned(stride_kb, ROW_ALIGN)
    stride_kh = _aligned(stride_kh, ROW_ALIGN)
    stride_kn = _aligned(stride_kn, ROW_ALIGN)
    stride_vb = _aligned(stride_vb, ROW_ALIGN)
    stride_vh = _aligned(stride_vh, ROW_ALIGN)
    stride_vn = _aligned(stride_vn, ROW_ALIGN)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < seq_q
    d_in = _feature_mask(HEAD_DIM, BLOCK_D)
    if CAUSAL:
        # padding rows repeat the tile's first position, so they widen nothing
        qp = tl.load(q_pos_ptr + offs_m, mask=m_in, other=tl.load(q_pos_ptr + start_m))
        lo, hi = _visible_span(k_pos_ptr, seq_k, tl.max(qp, 0), True, BLOCK_N, SCAN)
    else:
        lo = 0
        hi = seq_k
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_in[:, None] & d_in[None, :], other=0.0)
    kt_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None]  # [BLOCK_D, BLOCK_N]: k transposed
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scaled scores (base 2)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_in = cols < seq_k
        kt = tl.load(kt_ptrs + start_n * stride_kn, mask=n_in[None, :] & d_in[:, None], other=0.0)
        s = _dot(q, kt, DOT_PRECISION, WIDEN_DOT) * qk_scale
        if CAUSAL:
            # padding columns get the largest position: one comparison masks them too
            kp = tl.load(k_pos_ptr + cols, mask=n_in, other=9223372036854775807)
            s = tl.where(qp[:, None] >= kp[None, :], s, float("-inf"))
        else:
            s = tl.where(n_in[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=n_in[:, None] & d_in[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(_narrow(p, v.dtype, WIDEN_DOT), v, DOT_PRECISION, WIDEN_DOT)
        m_i = m_new
    seen = l_i > 0.0
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    row = bh.to(tl.int64) * seq_q + offs_m
    tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=m_in[:, None] & d_in[None, :])
    tl.store(lse_ptr + row, lse, mask=m_in)


def _attn_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,  # dout, in q's dtype
    lse_ptr,  # fp32 [B, H, Sq], contiguous: the merged log-sum-exp
    delta_ptr,  # fp32 [B, H, Sq], contiguous
    q_pos_ptr,
    k_pos_ptr,
    dk_ptr,  # fp32 [B, Hkv, Sk, D], contiguous
    dv_ptr,  # fp32 [B, Hkv, Sk, D], contiguous
    stride_qb: tl.int64,
    stride_qh: tl.int64,
    stride_qm: tl.int64,
    stride_kb: tl.int64,
    stride_kh: tl.int64,
    stride_kn: tl.int64,
    stride_vb: tl.int64,
    stride_vh: tl.int64,
    stride_vn: tl.int64,
    stride_dob: tl.int64,
    stride_doh: tl.int64,
    stride_dom: tl.int64,
    n_heads: tl.int32,
    group: tl.int32,
    seq_q: tl.int32,
    seq_k: tl.int32,
    qk_scale: tl.float32,  # scale * log2(e)
    scale: tl.float32,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCAN: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)  # b * Hkv + hkv
    n_kv = n_heads // group
    b = bhk // n_kv
    hkv = bhk % n_kv
    stride_qb = _aligned(stride_qb, ROW_ALIGN)
    stride_qh = _aligned(stride_qh, ROW_ALIGN)
    stride_qm = _aligned(stride_qm, ROW_ALIGN)
    stride_kb = _aligned(stride_kb, ROW_ALIGN)
    stride_kh = _aligned(stride_kh, ROW_ALIGN)
    stride_kn = _aligned(stride_kn, ROW_ALIGN)
    stride_vb = _aligned(stride_vb, ROW_ALIGN)
    stride_vh = _aligned(stride_vh, ROW_ALIGN)
    stride_vn = _aligned(stride_vn, ROW_ALIGN)
    stride_dob = _aligned(stride_dob, ROW_ALIGN)
    stride_doh = _aligned(stride_doh, ROW_ALIGN)
    stride_dom = _aligned(stride_dom, ROW_ALIGN)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_in = offs_n < seq_k
    d_in = _feature_mask(HEAD_DIM, BLOCK_D)
    if CAUSAL:
        kp = tl.load(k_pos_ptr + offs_n, mask=n_in, other=tl.load(k_pos_ptr + start_n))
        lo, hi = _visible_span(q_pos_ptr, seq_q, tl.min(kp, 0), False, BLOCK_M, SCAN)
    else:
        lo = 0
        hi = seq_q
    kv_mask = n_in[:, None] & d_in[None, :]
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    # every query head of the group, in order: dk/dv sum over them here, with no atomics
    for g in range(0, group):
        h = hkv * group + g
        bh = b.to(tl.int64) * n_heads + h
        qt_ptrs = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[None, :] * stride_qm + offs_d[:, None]
        do_ptrs = (
            do_ptr + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :]
        )
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            m_in = rows < seq_q
            qt = tl.load(qt_ptrs + start_m * stride_qm, mask=m_in[None, :] & d_in[:, None], other=0.0)
            # rows that saw no key anywhere (lse = -inf) and padding rows get p = exp2(s - inf) = 0
            lse = tl.load(lse_ptr + bh * seq_q + rows, mask=m_in, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
            pt = tl.math.exp2(_dot(k, qt, DOT_PRECISION, WIDEN_DOT) * qk_scale - lse[None, :])  # [N, M]
            if CAUSAL:
                qp = tl.load(q_pos_ptr + rows, mask=m_in, other=0)
                pt = tl.where(qp[None, :] >= kp[:, None], pt, 0.0)
            do = tl.load(do_ptrs + start_m * stride_dom, mask=m_in[:, None] & d_in[None, :], other=0.0)
            dv += _dot(_narrow(pt, do.dtype, WIDEN_DOT), do, DOT_PRECISION, WIDEN_DOT)
            dpt = _dot(v, tl.trans(do), DOT_PRECISION, WIDEN_DOT)
            delta = tl.load(delta_ptr + bh * seq_q + rows, mask=m_in, other=0.0)
            dst = pt * (dpt - delta[None, :])
            dk += _dot(_narrow(dst, qt.dtype, WIDEN_DOT), tl.trans(qt), DOT_PRECISION, WIDEN_DOT)
    out = (bhk.to(tl.int64) * seq_k + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dk_ptr + out, dk * scale, mask=kv_mask)
    tl.store(dv_ptr + out, dv, mask=kv_mask)


def _attn_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,  # dout, in q's dtype
    lse_ptr,
    delta_ptr,
    q_pos_ptr,
    k_pos_ptr,
    dq_ptr,  # fp32 [B, H, Sq, D], contiguous
    stride_qb: tl.int64,
    stride_qh: tl.int64,
    stride_qm: tl.int64,
    stride_kb: tl.int64,
    stride_kh: tl.int64,
    stride_kn: tl.int64,
    stride_vb: tl.int64,
    stride_vh: tl.int64,
    stride_vn: tl.int64,
    stride_dob: tl.int64,
    stride_doh: tl.int64,
    stride_dom: tl.int64,
    n_heads: tl.int32,
    group: tl.int32,
    seq_q: tl.int32,
    seq_k: tl.int32,
    qk_scale: tl.float32,
    scale: tl.float32,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCAN: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    hkv = h // group
    start_m = pid_m * BLOCK_M
    stride_qb = _aligned(stride_qb, ROW_ALIGN)
    stride_qh = _aligned(stride_qh, ROW_ALIGN)
    stride_qm = _aligned(stride_qm, ROW_ALIGN)
    stride_kb = _aligned(stride_kb, ROW_ALIGN)
    stride_kh = _aligned(stride_kh, ROW_ALIGN)
    stride_kn = _aligned(stride_kn, ROW_ALIGN)
    stride_vb = _aligned(stride_vb, ROW_ALIGN)
    stride_vh = _aligned(stride_vh, ROW_ALIGN)
    stride_vn = _aligned(stride_vn, ROW_ALIGN)
    stride_dob = _aligned(stride_dob, ROW_ALIGN)
    stride_doh = _aligned(stride_doh, ROW_ALIGN)
    stride_dom = _aligned(stride_dom, ROW_ALIGN)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < seq_q
    d_in = _feature_mask(HEAD_DIM, BLOCK_D)
    if CAUSAL:
        qp = tl.load(q_pos_ptr + offs_m, mask=m_in, other=tl.load(q_pos_ptr + start_m))
        lo, hi = _visible_span(k_pos_ptr, seq_k, tl.max(qp, 0), True, BLOCK_N, SCAN)
    else:
        lo = 0
        hi = seq_k
    qd_mask = m_in[:, None] & d_in[None, :]
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    do_base = do_ptr + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=qd_mask, other=0.0)
    row = bh.to(tl.int64) * seq_q + offs_m
    lse = tl.load(lse_ptr + row, mask=m_in, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(delta_ptr + row, mask=m_in, other=0.0)
    kt_ptrs = k_ptr + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None]
    vt_ptrs = v_ptr + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh + offs_n[None, :] * stride_vn + offs_d[:, None]
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_in = cols < seq_k
        kt = tl.load(kt_ptrs + start_n * stride_kn, mask=n_in[None, :] & d_in[:, None], other=0.0)
        vt = tl.load(vt_ptrs + start_n * stride_vn, mask=n_in[None, :] & d_in[:, None], other=0.0)
        p = tl.math.exp2(_dot(q, kt, DOT_PRECISION, WIDEN_DOT) * qk_scale - lse[:, None])
        if CAUSAL:
            kp = tl.load(k_pos_ptr + cols, mask=n_in, other=9223372036854775807)
            p = tl.where(qp[:, None] >= kp[None, :], p, 0.0)
        else:
            p = tl.where(n_in[None, :], p, 0.0)
        dp = _dot(do, vt, DOT_PRECISION, WIDEN_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(_narrow(ds, kt.dtype, WIDEN_DOT), tl.trans(kt), DOT_PRECISION, WIDEN_DOT)
    tl.store(dq_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], dq * scale, mask=qd_mask)


_FWD = triton_kernel(_attn_fwd_kernel)
_BWD_DKDV = triton_kernel(_attn_bwd_dkdv_kernel)
_BWD_DQ = triton_kernel(_attn_bwd_dq_kernel)


@dataclass(frozen=True)
class _Tiles:
    """One kernel's launch config."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    scan: int


def _launch_config(kernel: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> _Tiles:
    """The launch config of ``kernel`` (``"fwd"``, ``"dkdv"``, ``"dq"``) on ``device``.

    CUDA: :func:`_cuda_tiles` for the device's compute capability. Interpreter: 16 x 16 tiles,
    so that the tests' small shapes still run several tiles, partial ones and the multi-piece
    position scan.
    """
    if device.type != "cuda":
        return _Tiles(16, 16, 4, 1, 16)
    major, minor = torch.cuda.get_device_capability(device)
    return _cuda_tiles(kernel, 10 * major + minor, head_dim, dtype)


def _cuda_tiles(kernel: str, cc: int, head_dim: int, dtype: torch.dtype) -> _Tiles:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages, SCAN)`` on ``sm_<cc>``; a pure function.

    See [Note: kernel tiling]. Every config compiles with 0 spills for the targets it is launched
    on (the fp16/bf16 ones are ``AOT_CONFIGS``, but for the Hopper-only one, checked in
    tests/kernels/test_attention_kernels.py).
    """
    if dtype == torch.float32:  # exact dots on FMA units: small tiles, 0 spills at D = 128 (the
        # fp32 path is for correctness; bf16/fp16 is the fast one)
        table = {"fwd": (16, 16, 4, 2), "dkdv": (32, 32, 8, 2), "dq": (16, 32, 4, 2)}
    elif head_dim <= 64:
        table = {"fwd": (128, 32, 4, 3), "dkdv": (32, 64, 4, 3), "dq": (128, 32, 8, 3)}
    else:
        # dk/dv: 4 warps on Hopper (one warpgroup per 64 keys; wgmma reads k and v from shared
        # memory): 2.4x faster than 8 there; sm_80 keeps them in registers and needs 8 warps
        dkdv = (32, 64, 4, 3) if cc >= 90 else (32, 64, 8, 3)
        table = {"fwd": (128, 64, 8, 3), "dkdv": dkdv, "dq": (64, 32, 4, 3)}
    return _Tiles(*table[kernel], scan=1024)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous, else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _row_align(tensors: tuple[torch.Tensor, ...]) -> int:
    """``ROW_ALIGN``: 16 bytes' worth of elements when every tensor starts on 16 bytes and every
    stride of a dimension of size > 1 (batch, head, row) is a multiple of 16 bytes, else 1."""
    elements = 16 // tensors[0].element_size()
    for t in tensors:
        if t.data_ptr() % 16 or any(n > 1 and st % elements for n, st in zip(t.shape[:3], t.stride()[:3])):
            return 1
    return elements


def _check_head_dim(d: int) -> None:
    if d > _MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention kernels take head_dim <= {_MAX_HEAD_DIM}, got {d}: use backend='torch'")


def _triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
) -> None:
    """Launch the forward kernel into ``out`` (zeros) and ``lse`` (``-inf``), both contiguous."""
    b, h, sq, d = q.shape
    n_kv, sk = k.shape[1], k.shape[2]
    _check_head_dim(d)
    if b * h * sq == 0 or sk == 0:
        return  # nothing visible: out stays 0, lse -inf
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    cfg = _launch_config("fwd", q.device, d, q.dtype)
    grid = (triton.cdiv(sq, cfg.block_m), b * h)
    _FWD[grid](
        q,
        k,
        v,
        q_pos.contiguous(),
        k_pos.contiguous(),
        out,
        lse,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        h,
        h // n_kv,
        sq,
        sk,
        scale * _LOG2E,
        HEAD_DIM=d,
        CAUSAL=bool(causal),
        ROW_ALIGN=_row_align((q, k, v)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN_DOT=q.device.type != "cuda" and q.dtype == torch.bfloat16,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        SCAN=cfg.scan,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _triton_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    scale: float,
    causal: bool,
) -> None:
    """Launch the two backward kernels into ``dq``, ``dk``, ``dv`` (zeros, contiguous).

    ``dout`` is taken in q's dtype (as flash attention does: a bf16 model's output gradient is
    bf16); the torch path uses it as given, in fp32.
    """
    b, h, sq, d = q.shape
    n_kv, sk = k.shape[1], k.shape[2]
    _check_head_dim(d)
    if b * h * sq == 0 or sk == 0:
        return
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    dout = _unit_last(dout.to(q.dtype))
    lse, delta = lse.contiguous(), delta.contiguous()
    q_pos, k_pos = q_pos.contiguous(), k_pos.contiguous()
    args = (q, k, v, dout, lse, delta, q_pos, k_pos)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    scalars = (h, h // n_kv, sq, sk, scale * _LOG2E, scale)
    common = dict(
        HEAD_DIM=d,
        CAUSAL=bool(causal),
        ROW_ALIGN=_row_align((q, k, v, dout)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN_DOT=q.device.type != "cuda" and q.dtype == torch.bfloat16,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )
    cfg = _launch_config("dkdv", q.device, d, q.dtype)
    _BWD_DKDV[(triton.cdiv(sk, cfg.block_n), b * n_kv)](
        *args,
        dk,
        dv,
        *strides,
        *scalars,
        **common,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SCAN=cfg.scan,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    cfg = _launch_config("dq", q.device, d, q.dtype)
    _BWD_DQ[(triton.cdiv(sq, cfg.block_m), b * h)](
        *args,
        dq,
        *strides,
        *scalars,
        **common,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SCAN=cfg.scan,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _aot_configs() -> list[dict]:
    """The launchers' CUDA configs to compile ahead of time (see :mod:`shardkit.kernels.aot`):
    causal, 16-byte aligned rows, bf16 at D = 64 and 128 and fp16 at D = 128, as launched on
    sm_80 (the AOT checks compile every config for sm_80 and sm_90). The one Hopper-only config
    (:func:`_cuda_tiles`: dk/dv at D = 128 on 4 warps) would spill if compiled for sm_80, where it
    never runs; tests/kernels/test_attention_kernels.py checks its sm_90 compile instead.

    ``elements_per_program`` counts the (row, feature) values of the program's own tile and
    ``bytes_per_element`` what is read and written per such value (fp16/bf16 inputs, fp32
    outputs); the key/value (or query) stream the program loops over is shared between programs
    through L2 and not counted.
    """
    out = []
    for dtype, suffix, ty, d in (
        (torch.bfloat16, "bf16", "*bf16", 64),
        (torch.bfloat16, "bf16", "*bf16", 128),
        (torch.float16, "fp16", "*fp16", 128),
    ):
        for kind, kernel, pointers, bytes_per_element in (
            ("fwd", _FWD, dict(out_ptr="*fp32", lse_ptr="*fp32"), 2 + 4),  # read q, write out
            (
                "dkdv",
                _BWD_DKDV,
                dict(do_ptr=ty, lse_ptr="*fp32", delta_ptr="*fp32", dk_ptr="*fp32", dv_ptr="*fp32"),
                2 * 2 + 2 * 4,
            ),
            ("dq", _BWD_DQ, dict(do_ptr=ty, lse_ptr="*fp32", delta_ptr="*fp32", dq_ptr="*fp32"), 2 * 2 + 4),  # q, dout; dq
        ):
            cfg = _cuda_tiles(kind, 80, d, dtype)
            own_rows = cfg.block_n if kind == "dkdv" else cfg.block_m
            out.append(
                dict(
                    kernel=kernel,
                    name=f"attention_{kind}_{suffix}_d{d}",
                    pointers=dict(q_ptr=ty, k_ptr=ty, v_ptr=ty, q_pos_ptr="*i64", k_pos_ptr="*i64", **pointers),
                    num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages,  # documentation only: aot compiles with Triton's default (3)
                    constexprs=dict(
                        HEAD_DIM=d,
                        CAUSAL=True,
                        ROW_ALIGN=8,
                        DOT_PRECISION="tf32",
                        WIDEN_DOT=False,
                        BLOCK_M=cfg.block_m,
                        BLOCK_N=cfg.block_n,
                        BLOCK_D=d,
                        SCAN=cfg.scan,
                    ),
                    elements_per_program=own_rows * d,
                    bytes_per_element=bytes_per_element,
                )
            )
    return out


AOT_CONFIGS = _aot_configs
