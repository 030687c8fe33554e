"""The parallel context and collectives over ``torch.distributed`` (never imports Triton).

* :class:`ParallelContext` — named ``pp`` × ``dp`` × ``cp`` × ``tp`` axes over a ``DeviceMesh``.
* :func:`all_reduce`, :func:`reduce_scatter`, :func:`all_gather`, :func:`broadcast`,
  :func:`send`, :func:`recv`, :func:`all_to_all`, :func:`ring_shift` — take ``group=``
  explicitly and return a :class:`CommHandle`.
* :class:`CommStats` — explicit, thread-safe call/byte accounting (``stats=``), with a flight
  recorder of the newest calls (:class:`CollectiveRecord`, :func:`merge_recent`).
* :class:`Heartbeat` — each rank beats and watches the next: a frozen rank is named and ended in
  seconds instead of the collective timeout (see [Note: heartbeats]).
* :class:`CommTimeoutError` — a collective outlived its group's timeout (gloo; on NCCL only with
  ``blocking_wait=True``, else NCCL's watchdog aborts the process: see [Note: what a timeout
  looks like on each backend] in :mod:`shardkit.comm.context`).

Nothing runs at import: no environment reads, no device queries, no process groups.

Example:
    >>> from shardkit.comm import ParallelContext, CommStats, all_reduce
    >>> ctx = ParallelContext.from_env(tp=2)            # under torchrun
    >>> stats = CommStats()
    >>> all_reduce(grad, group=ctx.group("dp"), op="avg", stats=stats)
"""

from .collectives import (
    ReduceOpName,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    recv,
    reduce_scatter,
    ring_shift,
    send,
)
from .context import AXES, DEFAULT_TIMEOUT, DP_CP, CpSplit, ParallelContext
from .handle import CommHandle, CommTimeoutError
from .heartbeat import Heartbeat
from .stats import CollectiveRecord, CommStats, group_label, merge_recent

__all__ = [
    "AXES",
    "DEFAULT_TIMEOUT",
    "DP_CP",
    "CpSplit",
    "ParallelContext",
    "CommHandle",
    "CollectiveRecord",
    "CommStats",
    "CommTimeoutError",
    "Heartbeat",
    "ReduceOpName",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "send",
    "recv",
    "all_to_all",
    "ring_shift",
    "group_label",
    "merge_recent",
]
