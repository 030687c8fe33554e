"""Handles returned by the collectives, and the timeout error they raise.

[Note: comm handles and ordering]
* Issue order. On every rank of a group, collectives on that group must be issued in the same
  order with matching shapes and dtypes; the backend executes them in issue order. Collectives on
  *different* groups are not ordered with respect to each other.
* Async handles. With ``async_op=True`` a function returns as soon as the op is enqueued. Until
  ``handle.wait()`` returns, do not read the output and do not write the input (the handle keeps
  both alive). Handles may be waited in any order; ``wait()`` is idempotent.
* What ``wait()`` waits for. On CPU/gloo it blocks the calling thread until the data is there.
  On CUDA/NCCL it makes the *current* CUDA stream wait for the communication stream (the host
  does not block), so kernels launched afterwards on the current stream see the result; another
  stream must be synchronised with the current one by the caller.
* ``is_completed()`` says whether the communication has finished (``wait()`` would not block).
  Post-processing still pending (the division of ``op="avg"`` on gloo) runs in ``wait()``, so an
  async output is final only after ``wait()``.
* Synchronous calls (``async_op=False``, the default) are an async call followed by ``wait()``:
  the returned handle is completed and its ``output`` final.
* Groups of size 1 issue nothing: the handle is complete on return (``avg``/``sum``/``max``/
  ``min`` of one contribution is that contribution).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .stats import group_label

__all__ = ["CommHandle", "CommTimeoutError", "as_timeout_error"]

# Backends report timeouts in their own words: gloo "Timed out waiting 2000ms for recv
# operation", NCCL "collective operation timeout" / "ran for N milliseconds before timing out"
# (the latter is what a blocking wait raises).
_TIMEOUT_RE = re.compile(r"timed\s*out|timeout|timing\s*out", re.IGNORECASE)


class CommTimeoutError(RuntimeError):
    """A collective did not complete within its process group's timeout.

    The message names the op, the group (see :func:`~shardkit.comm.stats.group_label`), the
    timeout and this rank; the backend's own error is chained as ``__cause__``. The usual cause
    is a rank that never issued the matching op (see [Note: comm handles and ordering]).

    Raised on gloo always, and on NCCL only for groups created with ``blocking_wait=True``: by
    default NCCL's watchdog aborts the process instead (see [Note: what a timeout looks like on
    each backend] in :mod:`shardkit.comm.context`).
    """


def _group_timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta | None:
    # Private c10d accessors; only used to make the message precise, so any failure -> None.
    try:
        return group._get_backend(device).options._timeout
    except Exception:  # noqa: BLE001 - best effort for an error message
        return None


def as_timeout_error(exc: BaseException, op: str, group: dist.ProcessGroup, device: torch.device) -> CommTimeoutError | None:
    if not isinstance(exc, RuntimeError) or isinstance(exc, CommTimeoutError):
        return None
    if not _TIMEOUT_RE.search(str(exc)):
        return None
    timeout = _group_timeout(group, device)
    after = f"{timeout.total_seconds():g} s" if timeout is not None else "the group timeout"
    return CommTimeoutError(
        f"{op} on group {group_label(group)} timed out after {after} "
        f"(rank {group.rank()} of {group.size()} in that group); a peer probably never issued "
        f"the matching {op}. Backend error: {exc}"
    )


class CommHandle:
    """The result of a collective: its output tensor and, while in flight, its work.

    See [Note: comm handles and ordering].

    Attributes:
        op: the op name (``"all_reduce"``, ...).
        output: the tensor the result is written to (final after :meth:`wait`).

    Example:
        >>> h = all_reduce(grad, group=ctx.group("dp"), op="avg", async_op=True)
        >>> ...  # overlap other work; do not touch grad
        >>> grad = h.wait()
    """

    __slots__ = ("op", "output", "_work", "_post", "_group", "_device", "_done")

    def __init__(
        self,
        op: str,
        output: torch.Tensor,
        *,
        work: dist.Work | None = None,
        post: Callable[[], None] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.op = op
        self.output = output
        self._work = work
        self._post = post
        self._group = group
        self._device = output.device
        self._done = work is None and post is None

    def wait(self) -> torch.Tensor:
        """Wait for the op (see the Note), apply pending post-processing, return ``output``.

        Raises:
            CommTimeoutError: the group's timeout expired.
        """
        if self._done:
            return self.output
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as exc:
                err = as_timeout_error(exc, self.op, self._group, self._device)
                if err is not None:
                    raise err from exc
                raise
            self._work = None
        if self._post is not None:
            self._post()
            self._post = None
        self._done = True
        return self.output

    def is_completed(self) -> bool:
        """True when the communication has finished (``wait()`` would not block)."""
        return self._done or self._work is None or self._work.is_completed()

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"CommHandle({self.op}, {state}, output={tuple(self.output.shape)} {self.output.dtype})"
