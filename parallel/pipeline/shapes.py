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

from shardkit.comm import ParallelContext, broadcast

from .p2p import META_LEN, decode_meta, encode_meta, irecv, isend, p2p_tag
from .schedules import Schedule

__all__ = ["describe", "exchange_shapes", "signature"]

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
    _in_meta: dict[int, Meta]
    _out_meta: dict[int, Meta]


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
        buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8, device=dev)
        if failed % p == pipe.rank:
            raw = message.encode()[:_MSG_BYTES]
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev)
        broadcast(buf, src=failed % p, group=pipe.group)
        raise ValueError(bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace"))
