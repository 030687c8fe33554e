"""Activation memory per rank of a pre-LN GPT step, with and without context parallelism.

Pure arithmetic on the model's shape (nothing is built; torch is imported only by
:func:`activation_table`, for the ZeRO planner's number format): bytes that autograd keeps for
backward, counted tensor by tensor from what :class:`shardkit.models.TinyGPT` and the attention
paths save, and the working buffers of the moments in backward where the peak can fall. The
derivation, the terms left out and the measurement it is checked against are in
docs/planner.md, "Activations".

[Note: activation moments]
Symbols, per rank: ``T = batch * seq_len / cp`` tokens, ``a`` = ``dtype_bytes``, ``d`` =
``d_model``, ``f`` = ``ffn_hidden``, ``d_kv = kv_heads * d / n_heads``, ``H`` = ``n_heads``,
``V`` the vocabulary (every width divided by ``tp`` where Megatron's tensor parallelism splits
it). A block saves, per token, ``2a·d`` of LayerNorm inputs, ``16`` of LayerNorm statistics,
``2a·d`` of linear inputs (the LayerNorms' outputs), ``a·(d + 2·d_kv)`` of q/k/v, the attention
output and its fp32 log-sum-exp ``4H``, the output projection's input (a view of the attention
output at cp = 1 and in fp32 ring attention, a tensor of its own otherwise), and ``2a·f`` for
GELU's and the second linear's inputs. At
cp = 1 with ``d_kv = d`` and ``f = 4d`` that is ``16·a·d + 16 + 4H``: Korthikanti et al.'s
``34·s·b·h`` bytes per layer at ``a = 2`` with flash attention, less its two 1-byte dropout
masks, plus the fp32 statistics.

The peak of one forward + backward is the largest of three moments (the forward's own
transients are smaller for these block shapes):

* ``loss``: everything saved, plus the logits and fp32 log-probabilities around the
  cross-entropy (``max(a·V + 4V·[a ≠ 4], 8V)`` per token);
* ``mlp_backward``: the head's tensors freed, the last block's MLP backward holding the
  residual stream's gradient and the gradients of its ``f``-wide tensors (``a·d + a·f``);
* ``attention_backward``: the last block's MLP tensors freed too, its attention backward
  holding that mode's working buffers (ring, and hybrid on its head shards: the travelling
  key/value block and its spare, the fp32 dK/dV accumulator and its spare, fp32 dQ (added into
  in place), the block's dK/dV; SDPA/Ulysses: dQ, dK, dV and the kernel's fp32 accumulator; on
  the CPU path, ring attention also holds torch's fused CPU kernel's per-run gradients and
  buffers).

Example:
    >>> plan = activation_bytes(seq_len=512, batch=2, d_model=64, n_layers=2, n_heads=4, vocab_size=59, cp=2)
    >>> plan.per_rank, plan.peak_at
    (4892672, 'mlp_backward')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MLP_SIDE",
    "MOMENTS",
    "ActivationPlan",
    "AttentionDevice",
    "ContextParallelMode",
    "activation_bytes",
    "activation_table",
]

ContextParallelMode = Literal["ring", "ulysses", "hybrid"]
#: whose attention kernels the working buffers are those of: ``"cuda"`` (flash attention at cp = 1
#: and in Ulysses, shardkit's Triton blockwise kernels in ring attention) or ``"cpu"`` (torch's
#: CPU flash attention, which ring attention runs on each zigzag run's strided view)
AttentionDevice = Literal["cuda", "cpu"]

#: a block's tensors that its MLP half saves: freed before its attention's backward starts
MLP_SIDE = ("proj_input", "norm2_input", "norm2_stats", "fc_input", "gelu_input", "fc2_input")
#: the moments of [Note: activation moments], in the order they happen
MOMENTS = ("loss", "mlp_backward", "attention_backward")


@dataclass(frozen=True)
class ActivationPlan:
    """Predicted activation bytes of one rank for one forward + backward (see :func:`activation_bytes`).

    Attributes:
        seq_len, batch, cp, tp, mode, checkpointing, dtype_bytes, device: the settings planned for
            (``mode`` is ``"none"`` at cp = 1: plain attention).
        tokens: tokens this rank holds, ``batch * seq_len / cp``.
        per_layer: bytes one transformer block saves for backward on this rank, by tensor.
        parts: bytes saved at the end of forward on this rank: ``inputs`` (token ids and targets),
            ``positions``, ``layers`` (every block; with checkpointing their inputs only),
            ``head`` (final LayerNorm and LM head inputs) and ``loss`` (fp32 log-probabilities).
        moments: predicted bytes on this rank at each candidate peak ([Note: activation moments]).
        ulysses_size: the all-to-all group size of ``mode="hybrid"`` (else ``None``).
    """

    seq_len: int
    batch: int
    cp: int
    tp: int
    mode: str
    checkpointing: bool
    dtype_bytes: int
    device: str
    tokens: int
    per_layer: Mapping[str, int]
    parts: Mapping[str, int]
    moments: Mapping[str, int]
    ulysses_size: int | None = None

    @property
    def saved(self) -> int:
        """Bytes autograd holds on this rank when forward ends (the sum of ``parts``)."""
        return sum(self.parts.values())

    @property
    def per_rank(self) -> int:
        """Predicted peak activation bytes on this rank: the largest of ``moments``."""
        return max(self.moments.values())

    @property
    def peak_at(self) -> str:
        """The moment of ``per_rank``: ``"loss"``, ``"mlp_backward"`` or ``"attention_backward"``."""
        return max(MOMENTS, key=lambda m: self.moments[m])

    @property
    def working(self) -> int:
        """``per_rank - saved``: the working buffers on top of what forward saved, net of what
        backward has freed by the peak (>= 0: the ``loss`` moment holds everything saved)."""
        return self.per_rank - self.saved

    @property
    def total(self) -> int:
        """``per_rank`` over the ``cp * tp`` ranks that hold one replica's sequences: above the
        cp = 1 plan's by what cp adds (ring's fp32 output and working buffers for bf16/fp16,
        Ulysses' projection input, each rank's copy of the position ids)."""
        return self.per_rank * self.cp * self.tp


def _split(width: int, tp: int, name: str) -> int:
    if width % tp:
        raise ValueError(f"{name}={width} must be divisible by tp={tp} (tensor parallelism splits it)")
    return width // tp


def activation_bytes(
    *,
    seq_len: int,
    batch: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    vocab_size: int,
    kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    dtype_bytes: int = 4,
    cp: int = 1,
    tp: int = 1,
    mode: ContextParallelMode = "ring",
    ulysses_size: int | None = None,
    checkpointing: bool = False,
    device: AttentionDevice = "cuda",
) -> ActivationPlan:
    """Activation bytes per rank of one forward + backward of a pre-LN GPT (TinyGPT's blocks).

    Counts what autograd saves in each block (LayerNorm → fused qkv → causal attention → output
    projection, LayerNorm → ``d → f → d`` GELU MLP, no dropout), in the embedding and the LM head
    with its fp32 cross-entropy, and the working buffers of the three moments where the step's
    peak can fall ([Note: activation moments]; docs/planner.md, "Activations", per term).
    Attention is flash-style at every cp (no ``S × S`` matrix is kept: torch's flash attention at
    cp = 1, shardkit's blockwise kernels in ring attention, SDPA on head shards in Ulysses).

    Args:
        seq_len: ``S``, tokens per sequence (the whole sequence, before the cp split); with
            ``cp > 1`` a multiple of ``2 * cp`` (the zigzag layout: two chunks per cp rank).
        batch: ``B``, sequences per rank (per data-parallel replica and micro-batch).
        d_model, n_layers, n_heads, vocab_size: the model's shape.
        kv_heads: key/value heads (GQA/MQA); default ``n_heads``.
        ffn_hidden: the MLP's hidden width ``f``; default ``4 * d_model`` (TinyGPT).
        dtype_bytes: ``a``, bytes of each activation the model computes in its own dtype (4 fp32,
            2 bf16/fp16). LayerNorm statistics, log-sum-exps, ring attention's output and
            accumulators and the loss's log-probabilities are fp32 whatever it is.
        cp: context-parallel ranks: each holds ``S / cp`` tokens of every sequence.
        tp: tensor-parallel ranks, Megatron's split without sequence parallelism (heads, the MLP's
            hidden width and the vocabulary divide by tp; LayerNorm inputs and the linears' inputs
            are replicated).
        mode: ``"ring"``, ``"ulysses"`` or ``"hybrid"`` (ignored at ``cp == 1``, where attention
            is plain SDPA).
        ulysses_size: with ``mode="hybrid"``, ``U``, the cp ranks of each all-to-all group (a
            divisor of cp): ring attention over ``cp / U`` ranks on head shards of ``U`` ranks'
            tokens.
        checkpointing: every block recomputed in backward (``parallelize(blocks=gpt_blocks,
            checkpointing=True)``): forward keeps each block's input, backward holds one
            recomputed block at a time.
        device: ``"cuda"`` or ``"cpu"``: whose attention kernels' working buffers to count
            (:data:`AttentionDevice`).

    Returns:
        An :class:`ActivationPlan`; ``per_rank`` is the predicted peak in bytes on one rank,
        on top of model states (parameters, gradients, optimizer state: the ZeRO planner's).

    Raises:
        ValueError: a non-positive size, ``seq_len`` that does not split over cp in the zigzag
            layout, widths tp does not divide, or heads Ulysses cannot split over cp (each message
            names the argument).

    Example:
        >>> one = activation_bytes(seq_len=4096, batch=1, d_model=4096, n_layers=32, n_heads=32, vocab_size=32000, dtype_bytes=2)
        >>> two = activation_bytes(seq_len=4096, batch=1, d_model=4096, n_layers=32, n_heads=32, vocab_size=32000, dtype_bytes=2, cp=2)
        >>> one.per_layer["qkv"], round(two.per_rank / one.per_rank, 3)   # 3·a·d·S: 2-byte q, k, v
        (100663296, 0.557)
    """
    sizes = dict(seq_len=seq_len, batch=batch, d_model=d_model, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab_size)
    sizes.update(cp=cp, tp=tp, dtype_bytes=dtype_bytes)
    kv_heads = n_heads if kv_heads is None else kv_heads
    ffn_hidden = 4 * d_model if ffn_hidden is None else ffn_hidden
    sizes.update(kv_heads=kv_heads, ffn_hidden=ffn_hidden)
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if mode not in ("ring", "ulysses", "hybrid"):
        raise ValueError(f"mode must be 'ring', 'ulysses' or 'hybrid', got {mode!r}")
    if mode == "hybrid":
        if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1 or cp % ulysses_size:
            raise ValueError(f"mode='hybrid' needs ulysses_size, a positive divisor of cp={cp}; got {ulysses_size!r}")
    elif ulysses_size is not None:
        raise ValueError(f"ulysses_size applies to mode='hybrid' only, got mode={mode!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
    if n_heads % kv_heads:
        raise ValueError(f"n_heads={n_heads} must be divisible by kv_heads={kv_heads} (GQA groups)")
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} must be a multiple of 2 x cp = {2 * cp} (zigzag: two chunks per cp rank); "
            f"pad it to {-(-seq_len // (2 * cp)) * 2 * cp}"
        )
    heads, kv = _split(n_heads, tp, "n_heads"), _split(kv_heads, tp, "kv_heads")
    f = _split(ffn_hidden, tp, "ffn_hidden")
    a2a = cp if mode == "ulysses" else (ulysses_size or 1) if mode == "hybrid" else 1  # the all-to-all group
    if cp > 1 and a2a > 1 and (heads % a2a or (kv % a2a and a2a % kv)):
        raise ValueError(
            f"mode={mode!r} splits each rank's {heads} query and {kv} key/value heads (n_heads / tp, kv_heads / tp) "
            f"over {a2a} ranks: query heads must divide by {a2a}, key/value heads divide by it or divide it; "
            "or use mode='ring'"
        )
    a, d, head_dim = dtype_bytes, d_model, d_model // n_heads
    dh, dkv = heads * head_dim, kv * head_dim  # this rank's attention widths (d / tp, d_kv / tp)
    vocab = -(-vocab_size // tp)  # vocab-parallel head: each rank's ceil(V / tp) columns
    tokens = batch * seq_len // cp
    # hybrid is ring attention on head shards: per token of this rank, the same bytes as ring with
    # the key/value heads repeated up to U, plus Ulysses' separate projection input
    ring, ulysses, hybrid = cp > 1 and mode == "ring", cp > 1 and mode == "ulysses", cp > 1 and mode == "hybrid"
    kv_eff = max(kv, a2a) if cp > 1 else kv  # key/value heads after the all-to-all's repeat (GQA)

    # bytes per token one block saves, in the order its forward runs
    if ulysses or hybrid:  # q, k, v on head shards: U ranks' tokens of heads/U heads (kv heads repeated up to U)
        qkv = a * (dh + 2 * kv_eff * head_dim)
    else:  # cp = 1: the fused qkv output the q/k/v views keep; ring: their contiguous copies
        qkv = a * (dh + 2 * dkv)
    per_token = {
        "norm1_input": a * d,
        "norm1_stats": 8,  # fp32 mean and 1/std
        "qkv_input": a * d,
        "qkv": qkv,
        "attention_out": (4 if ring or hybrid else a) * dh,  # ring attention merges its blocks in fp32
        "attention_lse": 4 * heads,
        # a view of attention_out at cp = 1 (flash's [B, S, H, D] layout) and in fp32 ring attention
        # (the same layout); the all-to-all's output under Ulysses and hybrid, and ring's rounded
        # bf16/fp16 output
        "proj_input": a * dh if cp > 1 and not (ring and a == 4) else 0,
        "norm2_input": a * d,
        "norm2_stats": 8,
        "fc_input": a * d,
        "gelu_input": a * f,
        "fc2_input": a * f,
    }
    per_layer = {k: v * tokens for k, v in per_token.items()}
    layer = sum(per_layer.values())
    mlp_side = sum(per_layer[k] for k in MLP_SIDE)
    block_input = a * d * tokens

    inputs = 16 * tokens  # int64 token ids and targets (this rank's shards under cp)
    positions = 8 * (seq_len // cp)  # int64 position ids, the learned position table's input
    head = (a * d if checkpointing else 2 * a * d + 8) * tokens  # checkpointed: the head block's input
    loss = 4 * vocab * tokens  # cross-entropy's fp32 log-softmax output
    layers_fwd = n_layers * (block_input if checkpointing else layer)
    parts = {"inputs": inputs, "positions": positions, "layers": layers_fwd, "head": head, "loss": loss}

    # [Note: activation moments]; in backward the last block is the first one processed and,
    # with checkpointing, the one recomputed: its full set is alive next to the other blocks' inputs
    layers_bwd = (n_layers - 1) * block_input + layer if checkpointing else n_layers * layer
    logits = max(a * vocab + (4 * vocab if a != 4 else 0), 2 * 4 * vocab)  # fwd: logits (+ fp32 copy); bwd: two fp32 grads
    mlp_work = a * d + a * f  # the residual stream's gradient, then the f-wide gradients of the MLP
    if ring or hybrid:  # hybrid: the same per token, over U ranks' tokens of heads/U heads
        kvw = kv_eff * head_dim  # this rank's key/value width per token (kv heads repeated up to U)
        attn_work = (
            a * dh  # the output's gradient, strided as autograd hands it (no contiguous copy)
            + 4 * heads  # delta = rowsum(dO * O), fp32
            + 4 * dh  # dq, fp32: every step adds into it (dq_into)
            + 2 * 2 * a * kvw  # the travelling key/value block and its spare
            + 2 * 2 * 4 * kvw  # the fp32 dk/dv accumulator travelling one rank behind, and its spare
            + 4 * 2 * kvw  # this step's dk/dv, fp32
            + (4 * dh if device != "cpu" else 0)  # the Triton kernel's own dq (stored, then added)
        )
        if device == "cpu":  # kernels/attention.py, _cpu_flash_backward (zigzag: each run half a shard)
            # torch's CPU flash backward on strided views of the runs, adjacent visible runs
            # joined into one call (a block over itself is one causal call): that call's dq, dk,
            # dv over the whole block (6 half-shard buffers) and fp32 buffers of its own, 7 in
            # all (fitted to the measured peaks: 8 when each run pair was its own call, 9 before
            # the query gradient was added into the ring's dq in place); the same per token in
            # hybrid (its calls span U ranks' runs of heads/U heads)
            attn_work += 7 * 4 * dh // 2
            if a != 4:  # fp32 copies of q, k, v, dout
                attn_work += 4 * 4 * dh
            elif kv_eff != heads:  # k, v repeated to the query heads
                attn_work += 2 * 4 * dh
        if hybrid:  # the gradients' all-to-all back to sequence shards: its send and receive buffers
            attn_work += 2 * a * dh
    else:  # SDPA backward (cp = 1 and Ulysses' head shards): the output's gradient, dq, dk, dv, an fp32 dq accumulator
        kv_width = kv_eff * head_dim
        attn_work = a * dh + a * (dh + 2 * kv_width) + 4 * dh
        if device == "cpu":  # the CPU kernel's contiguous copy of the output's gradient
            attn_work += a * dh
    attn_work += a * d  # the residual stream's gradient
    moments = {
        "loss": inputs + positions + layers_fwd + head + loss + logits * tokens,
        "mlp_backward": inputs + positions + layers_bwd + mlp_work * tokens,
        "attention_backward": inputs + positions + layers_bwd - mlp_side + attn_work * tokens,
    }
    return ActivationPlan(
        seq_len=seq_len,
        batch=batch,
        cp=cp,
        tp=tp,
        mode=mode if cp > 1 else "none",
        checkpointing=checkpointing,
        dtype_bytes=dtype_bytes,
        device=device,
        tokens=tokens,
        per_layer=per_layer,
        parts=parts,
        moments=moments,
        ulysses_size=ulysses_size if hybrid else None,
    )


def activation_table(plans: Sequence[ActivationPlan], *, unit: int = 10**6) -> str:
    """One row per plan (e.g. cp = 1 and cp = N of the same model): tokens, saved, working buffers,
    the predicted peak per rank in ``unit`` bytes, its ratio to the first row's, and its moment.

    Example:
        >>> kw = dict(seq_len=512, batch=2, d_model=64, n_layers=2, n_heads=4, vocab_size=59)
        >>> print(activation_table([activation_bytes(**kw), activation_bytes(**kw, cp=2)]))
        cp  tokens/rank  saved  working  peak  vs cp=1  peak at
        1          1024   9.25    0.537  9.79    1.00x  mlp backward
        2           512   4.62    0.272  4.90    0.50x  attention backward
    """
    if not plans:
        raise ValueError("plans must hold at least one ActivationPlan")
    from shardkit.parallel.zero.planner import format_gb  # imports torch; the plans themselves do not

    base = plans[0].per_rank
    cols = ("cp", "tokens/rank", "saved", "working", "peak", f"vs cp={plans[0].cp}", "peak at")
    rows = [
        (
            str(p.cp),
            str(p.tokens),
            format_gb(p.saved, unit),
            format_gb(p.working, unit),
            format_gb(p.per_rank, unit),
            f"{p.per_rank / base:.2f}x",
            p.peak_at.replace("_", " "),
        )
        for p in plans
    ]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    last = len(cols) - 1
    line = lambda r: "  ".join(s.ljust(w) if i in (0, last) else s.rjust(w) for i, (s, w) in enumerate(zip(r, widths))).rstrip()  # noqa: E731
    return "\n".join([line(cols), *map(line, rows)])
