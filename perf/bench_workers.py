"""Start a benchmark's worker processes and collect rank 0's result (every ``shardkit bench`` and
``perf/`` script that needs several ranks uses this).

Example:
    >>> result = run_workers(_worker, 2, args, timeout=600, what="tp benchmark")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["machine_info", "reporting_errors", "run_workers", "worker_env"]


def run_workers(target: Callable[..., None], nproc: int, *args: Any, timeout: float, what: str) -> Any:
    """Run ``target(rank, nproc, port, *args, queue)`` in ``nproc`` spawned processes and return
    the first object put on ``queue`` (rank 0's result, by the workers' convention).

    ``port`` is a free TCP port on 127.0.0.1 for the workers' rendezvous. The wait polls, so a
    worker that dies (or a run that exceeds ``timeout`` seconds) kills the others and raises
    instead of blocking forever on the queue.

    Args:
        target: a module-level function (spawn pickles it by reference).
        nproc: number of processes.
        *args: passed after ``(rank, nproc, port)``.
        timeout: seconds before the run is abandoned.
        what: the benchmark's name, for the error message.

    Raises:
        RuntimeError: a worker exited with an error, or the timeout passed (the exit codes named).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, nproc, port, *args, queue)) for r in range(nproc)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    while queue.empty():
        if time.monotonic() > deadline or any(proc.exitcode not in (None, 0) for proc in procs):
            for proc in procs:
                proc.kill()
            late = " (timed out)" if time.monotonic() > deadline else ""
            raise RuntimeError(f"{what}: a worker failed{late}; exit codes {[proc.exitcode for proc in procs]}")
        time.sleep(0.2)
    result = queue.get()
    for proc in procs:
        proc.join(timeout=120)
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"{what}: a worker exited with an error; exit codes {[proc.exitcode for proc in procs]}")
    return result


@contextlib.contextmanager
def reporting_errors(rank: int, queue: Any) -> Iterator[None]:
    """A worker's body: an exception is put on ``queue`` by rank 0 as ``{"error": "Type: message"}``
    (so :func:`run_workers`' caller can print the cause, not only exit codes), then re-raised.

    Example:
        >>> with reporting_errors(rank, queue):    # doctest: +SKIP
        ...     queue.put(run_benchmark()) if rank == 0 else run_benchmark()
    """
    try:
        yield
    except BaseException as exc:
        if rank == 0:
            queue.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def worker_env(rank: int, world: int, port: int, *, threads: int | None = None) -> None:
    """Inside a worker: torchrun's variables for ``rank`` of ``world`` (rendezvous on ``port``),
    DeepSpeed's CPU accelerator, and ``threads`` intra-op threads (default: the cores shared out).

    Example:
        >>> worker_env(rank, world, port)   # first thing in a run_workers target  # doctest: +SKIP
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // world))


def machine_info() -> dict[str, Any]:
    """What a results file records about the machine and the time of the run.

    Example:
        >>> sorted(machine_info())
        ['cpu_count', 'date', 'loadavg', 'platform', 'torch']
    """
    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
