"""What a training run's summary says about where its communication went: per link.

Both training loops (the parallelize path, ``loop.py``, and the ``--config`` engine path,
``engine_loop.py``) take the payload per op from ``ParallelModel.report()``; :func:`bytes_per_link`
splits it by where each group lies when the world spans machines (from the
:class:`~shardkit.comm.CommStats` objects the model records into), and :func:`fmt_links` writes
that split for the summary line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from shardkit.comm import CommStats

from .progress import fmt_bytes

__all__ = ["bytes_per_link", "fmt_links"]


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
