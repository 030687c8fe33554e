"""Collectives over an explicit process group, returning :class:`~shardkit.comm.CommHandle` s.

Every function takes ``group=`` as a required keyword (usually ``ctx.group("dp")`` etc.), checks
its arguments before communicating, takes a local path with no collective on a group of size 1,
and turns a backend timeout into a :class:`~shardkit.comm.CommTimeoutError` naming the op and group.
Handles and their ordering rules: see :mod:`shardkit.comm.handle`.

[Note: avg without ReduceOp.AVG]
gloo implements neither ``ReduceOp.AVG`` nor ``PREMUL_SUM``, so ``op="avg"`` is a ``SUM``
followed by an in-place division by the group size in ``wait()``. On CUDA tensors with an NCCL
group the native ``AVG`` is used. The sum is formed in the tensor's dtype: fp16 sums of large
values can overflow before the division (pre-scale by ``1/N`` if that matters). ``avg``
requires a floating dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from .handle import CommHandle, as_timeout_error
from .stats import CommStats

__all__ = [
    "ReduceOpName",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "send",
    "recv",
    "all_to_all",
    "ring_shift",
]

ReduceOpName = Literal["sum", "avg", "max", "min"]
_REDUCE_OPS = ("sum", "avg", "max", "min")
#: on gloo, an all-gather whose output has at least this many bytes runs as one broadcast per
#: rank, in place (see [Note: gloo all-gather as broadcasts])
GLOO_BROADCAST_GATHER_BYTES = 64 * 1024


# ---- argument checks ---------------------------------------------------------------------------
def _check_group(fn: str, group: object) -> dist.ProcessGroup:
    if group is None:
        raise TypeError(f"{fn}: group= is required (e.g. group=ctx.group('dp'))")
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{fn}: this rank is not a member of the group passed as group=")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{fn}: group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    return group


def _check_tensor(fn: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{fn}: {name} must be dense, got a sparse tensor")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    return t


def _check_pair(fn: str, output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{fn}: output dtype {output.dtype} does not match input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{fn}: output is on {output.device} but input is on {input.device}")


def _check_op(fn: str, op: str, t: torch.Tensor) -> None:
    if op not in _REDUCE_OPS:
        raise ValueError(f"{fn}: op must be one of {_REDUCE_OPS}, got {op!r}")
    if op == "avg" and not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{fn}: op='avg' needs a floating tensor, got {t.dtype}")


def _check_peer(fn: str, name: str, peer: object, group: dist.ProcessGroup, *, allow_self: bool) -> int:
    if not isinstance(peer, int) or isinstance(peer, bool):
        raise TypeError(f"{fn}: {name} must be an int (a rank within group), got {type(peer).__name__}")
    if not 0 <= peer < group.size():
        raise ValueError(f"{fn}: {name}={peer} is not a rank of the group (size {group.size()})")
    if not allow_self and peer == group.rank():
        raise ValueError(f"{fn}: {name}={peer} is this rank itself")
    return peer


def _reduce_op(op: str, t: torch.Tensor, group: dist.ProcessGroup) -> tuple[dist.ReduceOp, bool]:
    """(backend op, divide in wait()) — see [Note: avg without ReduceOp.AVG]."""
    if op == "avg":
        if t.is_cuda and "nccl" in str(dist.get_backend(group)):
            return dist.ReduceOp.AVG, False
        return dist.ReduceOp.SUM, True
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op], False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _launch(
    op: str,
    group: dist.ProcessGroup,
    output: torch.Tensor,
    issue: Callable[[], dist.Work | None],
    *,
    async_op: bool,
    stats: CommStats | None,
    nbytes: int,
    post: Callable[[], None] | None = None,
) -> CommHandle:
    """Issue asynchronously, wrap in a handle, wait unless ``async_op`` (see the Note)."""
    if stats is not None:
        stats.record(op, group, nbytes)
    try:
        work = issue()
    except RuntimeError as exc:
        err = as_timeout_error(exc, op, group, output.device)
        if err is not None:
            raise err from exc
        raise
    handle = CommHandle(op, output, work=work, post=post, group=group)
    if not async_op:
        handle.wait()
    return handle


# ---- collectives -------------------------------------------------------------------------------
def all_reduce(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    op: ReduceOpName = "sum",
    async_op: bool = False,
    stats: CommStats | None = None,
) -> CommHandle:
    """Reduce ``tensor`` in place across ``group``.

    Args:
        tensor: any shape, contiguous, same shape/dtype on every rank. Overwritten with the
            result (``handle.output is tensor``).
        group: the process group (required keyword).
        op: ``"sum"``, ``"avg"`` (floating dtypes; see [Note: avg without ReduceOp.AVG]),
            ``"max"`` or ``"min"``.
        async_op: return before completion; see [Note: comm handles and ordering].
        stats: optional :class:`CommStats`; records the tensor's bytes.

    Returns:
        A :class:`CommHandle` whose ``output`` is ``tensor``.

    Raises:
        TypeError / ValueError: bad argument (named in the message), before any communication.
        CommTimeoutError: the group's timeout expired.

    Example:
        >>> g = torch.full((4,), float(ctx.rank("dp")))
        >>> all_reduce(g, group=ctx.group("dp"), op="avg").output   # dp size 2
        tensor([0.5000, 0.5000, 0.5000, 0.5000])
    """
    group = _check_group("all_reduce", group)
    tensor = _check_tensor("all_reduce", "tensor", tensor)
    _check_op("all_reduce", op, tensor)
    n = group.size()
    if n == 1:
        return CommHandle("all_reduce", tensor)
    red, divide = _reduce_op(op, tensor, group)
    post = (lambda: tensor.div_(n)) if divide else None
    return _launch(
        "all_reduce",
        group,
        tensor,
        lambda: dist.all_reduce(tensor, op=red, group=group, async_op=True),
        async_op=async_op,
        stats=stats,
        nbytes=_nbytes(tensor),
        post=post,
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    op: ReduceOpName = "sum",
    async_op: bool = False,
    stats: CommStats | None = None,
    input_is_scratch: bool = False,
) -> CommHandle:
    """Reduce ``input`` across ``group`` and leave chunk ``group.rank()`` of it in ``output``.

    Both tensors are treated as flat: with ``n = output.numel()``, rank ``r`` (within the group)
    receives ``reduce(input.view(-1)[r*n:(r+1)*n])`` over all ranks.

    gloo implements reduce-scatter as a copy of the whole input, an all-reduce of that copy and a
    copy of the chunk out (measured: 34.5 ms vs 21.0 ms for an all-reduce of a 25 MiB bucket on 2
    ranks). A caller that does not need ``input`` afterwards (a transient gradient bucket) passes
    ``input_is_scratch=True``: on gloo ``input`` is then all-reduced in place and the chunk copied
    out, which skips the full-size copy; other backends ignore the flag. ``stats`` records the
    same payload either way (the operation asked for is a reduce-scatter).

    Args:
        output: ``[n]`` (any shape with ``n`` elements), contiguous. It may be this rank's
            own chunk of ``input`` (an in-place reduce-scatter, as NCCL defines it).
        input: ``[N * n]`` (any shape with ``N * n`` elements, ``N = group.size()``), contiguous,
            same dtype and device as ``output``.
        group: the process group (required keyword).
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"`` (see :func:`all_reduce`).
        async_op: see [Note: comm handles and ordering].
        stats: optional :class:`CommStats`; records ``input``'s bytes.
        input_is_scratch: ``input``'s contents may be overwritten (see above); with ``output``
            its own chunk on gloo, no copy at all.

    Returns:
        A :class:`CommHandle` whose ``output`` is ``output``.

    Example:
        >>> out = torch.empty(3)
        >>> reduce_scatter(out, torch.arange(6.0), group=ctx.group("dp"))  # dp size 2
        >>> out   # rank 0: 2 * [0, 1, 2]; rank 1: 2 * [3, 4, 5]
        tensor([0., 2., 4.])
    """
    fn = "reduce_scatter"
    group = _check_group(fn, group)
    output = _check_tensor(fn, "output", output)
    input = _check_tensor(fn, "input", input)
    _check_pair(fn, output, input)
    _check_op(fn, op, input)
    n = group.size()
    if output.numel() * n != input.numel():
        raise ValueError(
            f"{fn}: output.numel() * group size must equal input.numel(); got {output.numel()} * {n} != {input.numel()}"
        )
    if n == 1:
        output.copy_(input.view_as(output))
        return CommHandle(fn, output)
    red, divide = _reduce_op(op, input, group)
    if input_is_scratch and dist.get_backend(group) == "gloo":
        chunk = input.view(-1).narrow(0, group.rank() * output.numel(), output.numel())

        def post_in_place() -> None:
            if output.data_ptr() != chunk.data_ptr():  # not already the chunk (in-place caller)
                output.view(-1).copy_(chunk)
            if divide:
                output.div_(n)

        return _launch(
            fn,
            group,
            output,
            lambda: dist.all_reduce(input, red, group, True),
            async_op=async_op,
            stats=stats,
            nbytes=_nbytes(input),
            post=post_in_place,
        )
    post = (lambda: output.div_(n)) if divide else None
    return _launch(
        fn,
        group,
        output,
        lambda: dist.reduce_scatter_single(output.view(-1), input.view(-1), red, group, True),
        async_op=async_op,
        stats=stats,
        nbytes=_nbytes(input),
        post=post,
    )


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    async_op: bool = False,
    stats: CommStats | None = None,
) -> CommHandle:
    """Concatenate every rank's ``input`` (in group-rank order) into ``output``.

    Both tensors are treated as flat: with ``n = input.numel()``,
    ``output.view(-1)[r*n:(r+1)*n]`` receives rank ``r``'s input.

    Args:
        output: ``[N * n]`` (any shape with ``N * n`` elements, ``N = group.size()``), contiguous.
        input: ``[n]`` (any shape), contiguous, same dtype and device as ``output``.
        group: the process group (required keyword).
        async_op: see [Note: comm handles and ordering].
        stats: optional :class:`CommStats`; records ``output``'s bytes.

    Returns:
        A :class:`CommHandle` whose ``output`` is ``output``.

    Example:
        >>> out = torch.empty(2, 3)
        >>> all_gather(out, torch.full((3,), float(ctx.rank("dp"))), group=ctx.group("dp"))
        >>> out
        tensor([[0., 0., 0.],
                [1., 1., 1.]])
    """
    fn = "all_gather"
    group = _check_group(fn, group)
    output = _check_tensor(fn, "output", output)
    input = _check_tensor(fn, "input", input)
    _check_pair(fn, output, input)
    n = group.size()
    if input.numel() * n != output.numel():
        raise ValueError(
            f"{fn}: input.numel() * group size must equal output.numel(); got {input.numel()} * {n} != {output.numel()}"
        )
    if n == 1:
        output.copy_(input.view_as(output))
        return CommHandle(fn, output)
    issue = lambda: dist.all_gather_single(output.view(-1), input.view(-1), group=group, async_op=True)  # noqa: E731
    if _nbytes(output) >= GLOO_BROADCAST_GATHER_BYTES and dist.get_backend(group) == "gloo":
        issue = lambda: _gather_by_broadcasts(output.view(-1), input.view(-1), group)  # noqa: E731
    return _launch(fn, group, output, issue, async_op=async_op, stats=stats, nbytes=_nbytes(output))


class _Works:
    """Several works in flight, waited and polled as one (a :class:`CommHandle`'s work)."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> _Works:
    """[Note: gloo all-gather as broadcasts]
    gloo's all-gather into one tensor is 2.5-4x slower than one in-place broadcast per rank of
    the same chunks (measured on 2 and 4 CPU ranks, 1-64 MiB outputs: e.g. 64 MiB on 2 ranks,
    88 ms vs 22 ms at the minimum), as torch's ZeroRedundancyOptimizer syncs its partitions.
    Each rank copies its input into its own chunk of ``output`` and broadcasts that chunk; the
    other chunks are received in place. The bytes moved are the same ((N-1)/N of the output per
    rank), so CommStats records one all-gather either way.
    """
    k = input.numel()
    mine = output.narrow(0, group.rank() * k, k)
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input)
    return _Works(
        [dist.broadcast(output.narrow(0, r * k, k), group_src=r, group=group, async_op=True) for r in range(group.size())]
    )


def broadcast(
    tensor: torch.Tensor,
    *,
    src: int,
    group: dist.ProcessGroup,
    async_op: bool = False,
    stats: CommStats | None = None,
) -> CommHandle:
    """Copy ``tensor`` from rank ``src`` of ``group`` to every other rank, in place.

    Args:
        tensor: any shape, contiguous; same shape/dtype on every rank. Read on ``src``,
            overwritten elsewhere.
        src: the source as a rank *within* ``group`` (``0 <= src < group.size()``), not a
            global rank: ``src=0`` of ``ctx.group("tp")`` is the first rank of this tp group.
        group: the process group (required keyword).
        async_op: see [Note: comm handles and ordering].
        stats: optional :class:`CommStats`; records the tensor's bytes on every rank.

    Returns:
        A :class:`CommHandle` whose ``output`` is ``tensor``.

    Example:
        >>> w = torch.randn(4, 4) if ctx.rank("dp") == 0 else torch.empty(4, 4)
        >>> broadcast(w, src=0, group=ctx.group("dp"))
    """
    group = _check_group("broadcast", group)
    tensor = _check_tensor("broadcast", "tensor", tensor)
    _check_peer("broadcast", "src", src, group, allow_self=True)
    if group.size() == 1:
        return CommHandle("broadcast", tensor)
    return _launch(
        "broadcast",
        group,
        tensor,
        lambda: dist.broadcast(tensor, group=group, group_src=src, async_op=True),
        async_op=async_op,
        stats=stats,
        nbytes=_nbytes(tensor),
    )


def send(
    tensor: torch.Tensor,
    *,
    dst: int,
    group: dist.ProcessGroup,
    async_op: bool = False,
    stats: CommStats | None = None,
) -> CommHandle:
    """Send ``tensor`` to rank ``dst`` of ``group`` (matched by a :func:`recv` there).

    Args:
        tensor: any shape, contiguous. Must not be modified until the handle is waited.
        dst: destination rank *within* ``group``; not this rank.
        group: the process group (required keyword); a group of size 1 has no valid ``dst``.
        async_op: see [Note: comm handles and ordering].
        stats: optional :class:`CommStats`; records the tensor's bytes on the sender.

    Returns:
        A :class:`CommHandle` whose ``output`` is ``tensor``.

    Example:
        >>> if ctx.rank("pp") == 0:
        ...     send(activations, dst=1, group=ctx.group("pp"))
    """
    group = _check_group("send", group)
    tensor = _check_tensor("send", "tensor", tensor)
    _check_peer("send", "dst", dst, group, allow_self=False)
    return _launch(
        "send",
        group,
        tensor,
        lambda: dist.isend(tensor, group=group, group_dst=dst),
        async_op=async_op,
        stats=stats,
        nbytes=_nbytes(tensor),
    )


def recv(
    tensor: torch.Tensor,
    *,
    src: int,
    group: dist.ProcessGroup,
    async_op: bool = False,
    stats: CommStats | None = None,
) -> CommHandle:
    """Receive into ``tensor`` from rank ``src`` of ``group`` (matching its :func:`send`).

    Args:
        tensor: preallocated buffer with the sender's shape and dtype, contiguous.
        src: source rank *within* ``group``; not this rank.
        group: the process group (required keyword).
        async_op: see [Note: comm handles and ordering].
        stats: optional :class:`CommStats`; records the tensor's bytes on the receiver.

    Returns:
        A :class:`CommHandle` whose ``output`` is ``tensor``.

    Example:
        >>> buf = torch.empty(8, 512)
        >>> x = recv(buf, src=0, group=ctx.group("pp")).output
    """
    group = _check_group("recv", group)
    tensor = _check_tensor("recv", "tensor", tensor)
    _check_peer("recv", "src", src, group, allow_self=False)
    return _launch(
        "recv",
        group,
        tensor,
        lambda: dist.irecv(tensor, group=group, group_src=src),
        async_op=async_op,
        stats=stats,
        nbytes=_nbytes(tensor),
    )


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    async_op: bool = False,
    stats: CommStats | None = None,
) -> CommHandle:
    """Rank ``r`` sends its ``input``'s ``j``-th slice (dim 0) to rank ``j``, which stores it as
    the ``r``-th slice of its ``output``.

    Args:
        output: ``[N * m, ...]`` (``N = group.size()``), contiguous.
        input: the same shape, dtype and device as ``output``, contiguous; dim 0 divisible by ``N``.
        group: the process group (required keyword).
        async_op: see [Note: comm handles and ordering].
        stats: optional :class:`CommStats`; records ``input``'s bytes.

    Returns:
        A :class:`CommHandle` whose ``output`` is ``output``.

    Example:
        >>> x = torch.tensor([10., 11.]) + 2 * ctx.rank("cp")   # rank 0: [10, 11]; rank 1: [12, 13]
        >>> all_to_all(out := torch.empty(2), x, group=ctx.group("cp")).output
        tensor([10., 12.])                                       # on rank 0; rank 1: [11, 13]
    """
    fn = "all_to_all"
    group = _check_group(fn, group)
    output = _check_tensor(fn, "output", output)
    input = _check_tensor(fn, "input", input)
    _check_pair(fn, output, input)
    n = group.size()
    if output.shape != input.shape or input.dim() == 0 or input.shape[0] % n:
        raise ValueError(
            f"{fn}: input and output must have one shape whose dim 0 is divisible by the group size {n}; "
            f"got {tuple(input.shape)} and {tuple(output.shape)}"
        )
    if n == 1:
        output.copy_(input)
        return CommHandle(fn, output)
    issue = lambda: dist.all_to_all_single(output, input, group=group, async_op=True)  # noqa: E731
    return _launch(fn, group, output, issue, async_op=async_op, stats=stats, nbytes=_nbytes(input))


def ring_shift(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    async_op: bool = False,
    stats: CommStats | None = None,
) -> CommHandle:
    """Send ``input`` to the next rank of ``group`` and receive the previous rank's into ``output``.

    Rank ``r`` sends to ``(r + 1) % N`` and receives from ``(r - 1) % N``. The send and the
    receive are posted together (one ``batch_isend_irecv``: an NCCL group), so two ranks facing
    each other cannot block one another.

    Args:
        output: the received tensor's buffer: ``input``'s shape and dtype, contiguous, not ``input``.
        input: contiguous; must not be modified until the handle is waited.
        group: the process group (required keyword).
        async_op: see [Note: comm handles and ordering].
        stats: optional :class:`CommStats`; records ``input``'s bytes as ``"ring_shift"``.

    Returns:
        A :class:`CommHandle` whose ``output`` is ``output``; waiting it waits both transfers.

    Example:
        >>> kv_next = torch.empty_like(kv)
        >>> h = ring_shift(kv_next, kv, group=ctx.group("cp"), async_op=True)
        >>> ...                        # compute with kv meanwhile
        >>> kv = h.wait()
    """
    fn = "ring_shift"
    group = _check_group(fn, group)
    output = _check_tensor(fn, "output", output)
    input = _check_tensor(fn, "input", input)
    _check_pair(fn, output, input)
    if output.shape != input.shape:
        raise ValueError(f"{fn}: output must have input's shape {tuple(input.shape)}, got {tuple(output.shape)}")
    n = group.size()
    if n == 1:
        output.copy_(input)
        return CommHandle(fn, output)
    if output.data_ptr() == input.data_ptr():
        raise ValueError(f"{fn}: output must not be input (the send reads input while the receive writes output)")
    me = group.rank()
    ops = [
        dist.P2POp(dist.isend, input, group=group, group_peer=(me + 1) % n),
        dist.P2POp(dist.irecv, output, group=group, group_peer=(me - 1) % n),
    ]
    issue = lambda: _Works(dist.batch_isend_irecv(ops))  # noqa: E731
    return _launch(fn, group, output, issue, async_op=async_op, stats=stats, nbytes=_nbytes(input))
