"""Communication accounting: :class:`CommStats`, passed explicitly to the collectives.

[Note: payload bytes]
``CommStats`` counts, per rank, the *payload* of every collective this rank issues: the bytes
of the full (unsharded) logical tensor the collective is about, ``numel * element_size``:

====================  ==========================================  ===========================
op                    payload bytes (on every participating rank)  example, Ψ elements, fp32
====================  ==========================================  ===========================
``all_reduce``        the reduced tensor                           4Ψ
``reduce_scatter``    the input (before scattering; output × N)   4Ψ
``all_gather``        the output (after gathering; input × N)     4Ψ
``broadcast``         the broadcast tensor (src and receivers)     4Ψ
``send`` / ``recv``   the tensor, on the sender / the receiver     4Ψ
====================  ==========================================  ===========================

This is the unit the ZeRO paper counts in (Rajbhandari et al. 2019: DDP all-reduce "2Ψ" =
reduce-scatter Ψ + all-gather Ψ, each Ψ being the full tensor), so a DDP test can assert
``stats.bytes("all_reduce") == sum(p.numel() * p.element_size() for p in params)`` per step,
and a ZeRO-3 test ``3 ×`` that. It is *not* the number of bytes on the wire, which depends on
the algorithm (a ring all-reduce sends ``2 (N-1)/N`` × payload per rank). A group of size 1
takes the local path, issues no collective, and records nothing. Calls are recorded when
issued (not when completed), so an async op counts even before its handle is waited on.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch.distributed as dist

__all__ = ["CommStats", "group_label"]


def group_label(group: dist.ProcessGroup) -> str:
    """A readable, rank-independent name for a process group: ``"<desc>[r0, r1, ...]"``.

    ``<desc>`` is the group's description (e.g. ``"shardkit_tp"``) when it has one, else its
    name. The ranks are global ranks, so every member of the group gets the same label.

    Example:
        >>> group_label(ctx.group("tp"))
        'shardkit_tp[0, 1]'
    """
    desc = getattr(group, "group_desc", "") or ""
    if desc in ("", "undefined"):
        desc = f"group{group.group_name}"
    return f"{desc}{dist.get_process_group_ranks(group)}"


class CommStats:
    """Thread-safe counter of collective calls and payload bytes, per (op, group).

    Pass it to a collective as ``stats=``; nothing is recorded globally. Recording takes a lock
    because DDP gradient hooks may fire from autograd worker threads. See
    [Note: payload bytes] (module docstring) for exactly what is counted.

    Example:
        >>> stats = CommStats()
        >>> all_reduce(grad, group=ctx.group("dp"), stats=stats)   # grad: fp32 [1024]
        >>> stats.calls("all_reduce"), stats.bytes("all_reduce")
        (1, 4096)
        >>> stats.summary()["all_reduce"]
        {'calls': 1, 'bytes': 4096, 'groups': {'shardkit_dp[0, 1]': {'calls': 1, 'bytes': 4096}}}
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (op, group label) -> [calls, bytes]
        self._counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self._issued = 0  # every call recorded since construction (reset() keeps it: see progress)
        self._last: tuple[str, str] | None = None
        self._phase: tuple[str, float] = ("", 0.0)  # (label, time.monotonic() when set)

    def record(self, op: str, group: dist.ProcessGroup | str, nbytes: int) -> None:
        """Record one call of ``op`` on ``group`` moving ``nbytes`` payload bytes.

        The collectives call this themselves; code that communicates by other means (e.g.
        ``batch_isend_irecv``) calls it to stay in the same accounting.

        Args:
            op: op name, e.g. ``"all_reduce"``.
            group: the process group (or an already computed :func:`group_label`).
            nbytes: payload bytes, as defined in [Note: payload bytes]; must be >= 0.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        label = group if isinstance(group, str) else group_label(group)
        with self._lock:
            entry = self._counts[(op, label)]
            entry[0] += 1
            entry[1] += int(nbytes)
            self._issued += 1
            self._last = (op, label)

    def _total(self, index: int, op: str | None, group: dist.ProcessGroup | str | None) -> int:
        label = None if group is None else (group if isinstance(group, str) else group_label(group))
        with self._lock:
            return sum(
                v[index] for (o, g), v in self._counts.items() if (op is None or o == op) and (label is None or g == label)
            )

    def calls(self, op: str | None = None, *, group: dist.ProcessGroup | str | None = None) -> int:
        """Number of calls recorded for ``op`` (all ops if None), optionally on one ``group``."""
        return self._total(0, op, group)

    def bytes(self, op: str | None = None, *, group: dist.ProcessGroup | str | None = None) -> int:
        """Payload bytes recorded for ``op`` (all ops if None), optionally on one ``group``."""
        return self._total(1, op, group)

    def progress(self) -> tuple[int, tuple[str, str] | None]:
        """``(calls issued so far, (op, group label) of the last one)``, for telling which rank is
        behind when a collective stalls (:meth:`~shardkit.comm.Heartbeat.stall_report`). Unlike
        :meth:`calls`, the count survives :meth:`reset`: ranks that run the same program have
        issued the same number of calls at the same point.

        Example:
            >>> stats.progress()
            (41, ('all_gather', 'shardkit_dp[0, 1]'))
        """
        with self._lock:
            return self._issued, self._last

    def set_phase(self, label: str) -> None:
        """Say what the code recording into this object is doing now, e.g. ``"forward: all-gather
        of unit 'blocks.3'"`` or ``"pipeline: receive of micro-batch 2 from stage 0"``.
        :class:`~shardkit.comm.Heartbeat` publishes the newest label of a rank's stats objects,
        and its stall report and verdicts show it.

        Example:
            >>> stats.set_phase("optimizer step")
            >>> stats.phase()[0]
            'optimizer step'
        """
        self._phase = (label, time.monotonic())

    def phase(self) -> tuple[str, float]:
        """``(label, when)``: the last :meth:`set_phase` label (``""`` before any) and its
        ``time.monotonic()`` stamp (to tell the newest of several objects)."""
        return self._phase

    def reset(self) -> None:
        """Forget everything recorded so far (e.g. at the start of each measured step)."""
        with self._lock:
            self._counts.clear()

    def summary(self) -> dict[str, dict]:
        """A JSON-friendly snapshot: ``{op: {"calls", "bytes", "groups": {label: {"calls", "bytes"}}}}``."""
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._counts.items())
        out: dict[str, dict] = {}
        for (op, label), (calls, nbytes) in items:
            entry = out.setdefault(op, {"calls": 0, "bytes": 0, "groups": {}})
            entry["calls"] += calls
            entry["bytes"] += nbytes
            entry["groups"][label] = {"calls": calls, "bytes": nbytes}
        return out

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls()}, bytes={self.bytes()})"
