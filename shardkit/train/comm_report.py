"""What a training run's summary says about its communication: the payload per op, and per link.

Both training loops (the parallelize path, ``loop.py``, and the ``--config`` engine path,
``engine_loop.py``) report each rank's collectives from the :class:`~shardkit.comm.CommStats`
objects its model records into: :func:`comm_summary` merges them, :func:`bytes_per_link` splits
their payload by where each group lies when the world spans machines, and :func:`fmt_links`
writes that split for the summary line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from shardkit.comm import CommStats

from .progress import fmt_bytes

__all__ = ["bytes_per_link", "comm_summary", "fmt_links"]


def comm_summary(stats: Sequence[CommStats]) -> dict[str, Any] | None:
    """The rank's objects' :meth:`CommStats.summary` merged: ``{op: {"calls", "bytes", "groups"}}``
    (None when nothing was recorded). An object given twice counts once.

    Example:
        >>> comm_summary(par.comm_stats())["all_gather"]["bytes"]
        154980352
    """
    out: dict[str, Any] = {}
    for s in {id(s): s for s in stats}.values():
        for op, v in s.summary().items():
            entry = out.setdefault(op, {"calls": 0, "bytes": 0, "groups": {}})
            entry["calls"] += v["calls"]
            entry["bytes"] += v["bytes"]
            for label, g in v["groups"].items():
                have = entry["groups"].setdefault(label, {"calls": 0, "bytes": 0})
                have["calls"] += g["calls"]
                have["bytes"] += g["bytes"]
    return out or None


def bytes_per_link(stats: Sequence[CommStats], world: int) -> dict[str, int] | None:
    """This rank's payload bytes within and across machines (``LOCAL_WORLD_SIZE`` ranks each,
    :meth:`CommStats.bytes_per_link`), summed over its stats objects; None when the world is one
    machine.

    Example:
        >>> bytes_per_link(par.comm_stats(), world=4)    # LOCAL_WORLD_SIZE=2
        {'within_machine': 63447040, 'across_machines': 160190464, 'unplaced': 0}
    """
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_machine >= world:
        return None
    total = {"within_machine": 0, "across_machines": 0, "unplaced": 0}
    for s in {id(s): s for s in stats}.values():
        for k, v in s.bytes_per_link(per_machine).items():
            total[k] += v
    return total


def fmt_links(links: dict[str, int] | None) -> str:
    """``" (X across machines, Y within)"`` for a summary line, or ``""`` on one machine.

    Example:
        >>> fmt_links({"within_machine": 2**20, "across_machines": 3 * 2**20, "unplaced": 0})
        ' (3.00 MiB across machines, 1.00 MiB within)'
    """
    if not links:
        return ""
    return f" ({fmt_bytes(links['across_machines'])} across machines, {fmt_bytes(links['within_machine'])} within)"
