"""The shape exchange between pipeline stages, run before any activation is sent.

[Note: the shape exchange]
Receive buffers need each boundary's shape and dtype. On the first step, and again whenever the
micro-batch input or target signature changes, the stages run once in stage order on zeros of
the announced shape (no grad): stage ``s`` receives ``(shape, dtype)`` of its input from stage
``s - 1``, runs, and passes its output's on. A stage that fails passes the failure on instead;
the last stage broadcasts the outcome and the failed stage's owner broadcasts the message, so
*every* rank raises the same ``ValueError`` naming both stages, instead of one rank raising and
the others hanging. The signature check at the start of each step is one tiny all-reduce.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import ParallelContext, all_reduce, broadcast

from .p2p import META_LEN, decode_meta, encode_meta, irecv, isend, p2p_tag
from .schedules import Schedule

__all__ = ["agree_step", "broadcast_text", "describe", "exchange_shapes", "signature"]

_MSG_BYTES = 2048
Meta = tuple[torch.Size, torch.dtype]


class _Pipe(Protocol):
    """What the exchange reads from a :class:`~shardkit.parallel.pipeline.PipelineParallel`
    (a protocol, so this module does not import the executor that imports it)."""

    ctx: ParallelContext
    group: dist.ProcessGroup
    rank: int
    schedule: Schedule
    stages: dict[int, nn.Module]
    stage_blocks: list[range]
    loss_fn: Callable[..., Any]
    stats: Any
    _in_meta: dict[int, Meta]
    _out_meta: dict[int, Meta]
    _signature: tuple[int, ...] | None
    _stale_p2p: int


def signature(t: torch.Tensor | None) -> int:
    """A 32-bit digest of a micro-batch's shape and dtype (0 for none)."""
    return 0 if t is None else zlib.crc32(f"{tuple(t.shape)}:{t.dtype}".encode())


def describe(shape: torch.Size, dtype: torch.dtype) -> str:
    """``float32[4, 3, 16]``."""
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _try_stage(pipe: _Pipe, s: int, x: torch.Tensor, y_mbs: list | None, what: str) -> tuple[Meta | None, str]:
    """Run stage ``s`` on ``x`` without grad (and the loss on the last stage); its output's meta,
    or None and the message naming both stages."""
    S = pipe.schedule.num_stages
    step = "its forward"
    try:
        with torch.no_grad():
            y = pipe.stages[s](x)
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"a stage must return one tensor, got {type(y).__name__}")
            if s == S - 1:
                step = "the loss"
                what = f"its output {describe(y.shape, y.dtype)} and targets {describe(y_mbs[0].shape, y_mbs[0].dtype)}"
                pipe.loss_fn(y, y_mbs[0])
            elif not y.is_floating_point():
                raise TypeError(f"stage output must be floating point to carry gradients, got {y.dtype}")
        return (y.shape, y.dtype), ""
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
        blocks = pipe.stage_blocks[s]
        return None, (
            f"pipeline stage {s} (pp rank {pipe.rank}, blocks {blocks.start}..{blocks.stop - 1}) "
            f"cannot run {step} on {what}: {type(exc).__name__}: {exc}"
        )


def exchange_shapes(pipe: _Pipe, x_mbs: list | None, y_mbs: list | None) -> None:
    """Fill ``pipe._in_meta``/``pipe._out_meta``; see [Note: the shape exchange].

    Raises:
        ValueError: on every pp rank, naming the stage that failed and its input.
    """
    p, S = pipe.schedule.num_ranks, pipe.schedule.num_stages
    dev = pipe.ctx.device  # NCCL carries CUDA tensors only
    failed, message = -1, ""
    meta: Meta | None = None  # output of the previous stage
    for s in range(S):
        if s % p != pipe.rank:
            continue
        if s == 0:
            x = x_mbs[0]
            what = f"the micro-batch inputs {describe(x.shape, x.dtype)}"
        else:
            if (s - 1) % p != pipe.rank:
                msg = torch.empty(META_LEN, dtype=torch.int64, device=dev)
                irecv(msg, src=(s - 1) % p, tag=p2p_tag(s - 1, 0, False, S), group=pipe.group).wait()
                failed, shape, dtype = decode_meta(msg)
                meta = None if failed >= 0 else (shape, dtype)
            if meta is not None:
                pipe._in_meta[s] = meta
                x = torch.zeros(meta[0], dtype=meta[1], device=dev)
                what = f"stage {s - 1}'s output (pp rank {(s - 1) % p}, {describe(*meta)})"
        if failed < 0:
            meta, message = _try_stage(pipe, s, x, y_mbs, what)
            if meta is None:
                failed = s
            else:
                pipe._out_meta[s] = meta
        if s < S - 1 and (s + 1) % p != pipe.rank:
            out = encode_meta(None, None, failed_stage=failed) if failed >= 0 else encode_meta(*meta)
            isend(out.to(dev), dst=(s + 1) % p, tag=p2p_tag(s, 0, False, S), group=pipe.group).wait()
    # the outcome, from the last stage, then the failed stage's message, from its owner
    status = torch.tensor([failed], dtype=torch.int64, device=dev)
    broadcast(status, src=p - 1, group=pipe.group)
    failed = int(status[0])
    if failed >= 0:
        raise ValueError(broadcast_text(message, src=failed % p, rank=pipe.rank, group=pipe.group, device=dev))


def broadcast_text(text: str, *, src: int, rank: int, group: dist.ProcessGroup, device: torch.device) -> str:
    """``src``'s ``text`` (its first 2048 UTF-8 bytes) on every rank of ``group``: one broadcast,
    on the failure paths only, so that every rank raises the same message. Collective on ``group``.

    Example:
        >>> broadcast_text(message, src=failed_rank, rank=pipe.rank, group=pipe.group, device=dev)
    """
    buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8, device=device)  # NCCL carries CUDA tensors only
    if rank == src:
        raw = text.encode()[:_MSG_BYTES]
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    broadcast(buf, src=src, group=group)
    return bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")


def agree_step(pipe: _Pipe, x_mbs: list | str | None, y_mbs: list | str | None) -> None:
    """The start of every step, collective on pp: every rank learns every rank's input problems,
    micro-batch signatures and transfers a failed step left in flight (one tiny all-reduce); a
    new signature triggers the shape exchange.

    Args:
        pipe: the pipeline (its ``_signature`` is updated; ``_stale_p2p`` is read).
        x_mbs, y_mbs: this rank's input / target micro-batches, None where the stage takes none,
            or a string saying why they are unusable.

    Raises:
        RuntimeError: on every rank, when any rank has transfers of a failed step in flight
            (see [Note: a failed step's transfers] in :mod:`~shardkit.parallel.pipeline.transfers`).
        ValueError: on every rank, when any rank's inputs are unusable or the shape exchange
            fails (see [Note: the shape exchange]).

    Example:
        >>> agree_step(pipe, x.chunk(m), None)   # first stage; the last passes y's micro-batches
    """
    p = pipe.schedule.num_ranks
    rows = torch.zeros(p, 4, dtype=torch.int64, device=pipe.ctx.device)
    problem = next((v for v in (x_mbs, y_mbs) if isinstance(v, str)), None)
    rows[pipe.rank, 0] = problem is not None
    if problem is None:
        rows[pipe.rank, 1] = signature(x_mbs[0]) if x_mbs else 0
        rows[pipe.rank, 2] = signature(y_mbs[0]) if y_mbs else 0
    rows[pipe.rank, 3] = pipe._stale_p2p
    all_reduce(rows, group=pipe.group, stats=pipe.stats)
    stale = {r: int(rows[r, 3]) for r in range(p) if rows[r, 3]}
    if stale:  # [Note: a failed step's transfers] in transfers.py
        raise RuntimeError(
            f"a failed pipeline step left point-to-point transfers in flight on pp rank(s) {stale} "
            "(rank: count); they could match this step's transfers. Destroy the ParallelContext and "
            "build a new one and a new PipelineParallel (the blocks keep their weights) to go on"
        )
    bad = [r for r in range(p) if rows[r, 0]]
    if bad:
        here = f": {problem}" if problem else ""
        raise ValueError(f"pipeline step rejected by pp rank(s) {bad}{here}")
    sig = tuple(rows[:, 1:3].flatten().tolist())
    if sig != pipe._signature:
        pipe._signature = None  # until the exchange succeeds
        exchange_shapes(pipe, x_mbs, y_mbs)
        pipe._signature = sig
