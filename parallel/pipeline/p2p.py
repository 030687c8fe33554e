"""Tagged point-to-point transfers on the pp group, and the tensor-metadata messages of the
shape exchange.

``shardkit.comm.send``/``recv`` have no tag; the executor matches each transfer by identity
(see [Note: matching sends and receives] in :mod:`shardkit.parallel.pipeline.schedules`), so
it posts ``torch.distributed.isend``/``irecv`` itself with a tag, wraps the work in a
:class:`~shardkit.comm.CommHandle` (timeouts become :class:`~shardkit.comm.CommTimeoutError`)
and records the payload in :class:`~shardkit.comm.CommStats` as ``"send"``/``"recv"``, the
same accounting as the comm helpers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardkit.comm import CommHandle, CommStats
from shardkit.comm.handle import as_timeout_error

__all__ = ["META_LEN", "decode_meta", "encode_meta", "isend", "irecv", "p2p_tag", "post"]

#: Largest activation rank the shape exchange carries.
MAX_NDIM = 8
#: Length of a metadata message: [status, failed stage, dtype code, ndim, dims...].
META_LEN = 4 + MAX_NDIM
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def p2p_tag(sender_stage: int, mb: int, backward: bool, num_stages: int) -> int:
    """A tag unique within one step: (micro-batch, sending stage, direction)."""
    return ((mb * num_stages + sender_stage) << 1) | int(backward)


def encode_meta(shape: torch.Size | None, dtype: torch.dtype | None, *, failed_stage: int = -1) -> torch.Tensor:
    """An int64 message describing a tensor, or (``failed_stage >= 0``) an upstream failure.

    Raises:
        ValueError: more than ``MAX_NDIM`` dims or an unsupported dtype (named).
    """
    msg = torch.zeros(META_LEN, dtype=torch.int64)
    if failed_stage >= 0:
        msg[0], msg[1] = 1, failed_stage
        return msg
    assert shape is not None and dtype is not None
    if len(shape) > MAX_NDIM:
        raise ValueError(f"stage outputs may have at most {MAX_NDIM} dims, got shape {tuple(shape)}")
    if dtype not in _DTYPES:
        raise ValueError(f"stage output dtype {dtype} is not supported between pipeline stages")
    msg[1], msg[2], msg[3] = -1, _DTYPES.index(dtype), len(shape)
    msg[4 : 4 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
    return msg


def decode_meta(msg: torch.Tensor) -> tuple[int, torch.Size | None, torch.dtype | None]:
    """``(failed_stage, shape, dtype)``; ``failed_stage`` is -1 when the message is a tensor."""
    if int(msg[0]):
        return int(msg[1]), None, None
    ndim = int(msg[3])
    return -1, torch.Size(msg[4 : 4 + ndim].tolist()), _DTYPES[int(msg[2])]


def _post(op: str, tensor: torch.Tensor, peer: int, tag: int, group: dist.ProcessGroup, stats: CommStats | None) -> CommHandle:
    if stats is not None:
        stats.record(op, group, tensor.numel() * tensor.element_size())
    fn = dist.isend if op == "send" else dist.irecv
    try:
        if op == "send":
            work = fn(tensor, group=group, group_dst=peer, tag=tag)
        else:
            work = fn(tensor, group=group, group_src=peer, tag=tag)
    except RuntimeError as exc:
        err = as_timeout_error(exc, op, group, tensor.device)
        if err is not None:
            raise err from exc
        raise
    return CommHandle(op, tensor, work=work, group=group)


def isend(tensor: torch.Tensor, *, dst: int, tag: int, group: dist.ProcessGroup, stats: CommStats | None = None) -> CommHandle:
    """Post a send of ``tensor`` (contiguous; untouched until waited) to ``dst`` (rank in ``group``)."""
    return _post("send", tensor.contiguous(), dst, tag, group, stats)


def irecv(tensor: torch.Tensor, *, src: int, tag: int, group: dist.ProcessGroup, stats: CommStats | None = None) -> CommHandle:
    """Post a receive into ``tensor`` from ``src`` (rank in ``group``); wait on the handle."""
    return _post("recv", tensor, src, tag, group, stats)


def post(
    ops: list[tuple[str, torch.Tensor, int, int]], *, group: dist.ProcessGroup, stats: CommStats | None = None
) -> list[CommHandle]:
    """Post ``(op, tensor, peer, tag)`` transfers (``op`` is ``"send"`` or ``"recv"``) together.

    Several ops go through one ``torch.distributed.batch_isend_irecv`` (an NCCL group), so a send
    and a receive that face each other between two ranks cannot block each other; one op is a
    plain ``isend``/``irecv``. Returns one handle per op, in order; nothing is waited.
    """
    if len(ops) == 1:
        op, t, peer, tag = ops[0]
        return [
            (
                isend(t, dst=peer, tag=tag, group=group, stats=stats)
                if op == "send"
                else irecv(t, src=peer, tag=tag, group=group, stats=stats)
            )
        ]
    p2p = []
    for op, t, peer, tag in ops:
        t = t.contiguous()
        if stats is not None:
            stats.record(op, group, t.numel() * t.element_size())
        p2p.append((op, t, dist.P2POp(dist.isend if op == "send" else dist.irecv, t, group=group, group_peer=peer, tag=tag)))
    try:
        works = dist.batch_isend_irecv([o for _, _, o in p2p])
    except RuntimeError as exc:
        err = as_timeout_error(exc, "batch_isend_irecv", group, ops[0][1].device)
        if err is not None:
            raise err from exc
        raise
    return [CommHandle(op, t, work=w, group=group) for (op, t, _), w in zip(p2p, works, strict=True)]
