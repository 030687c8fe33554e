"""Shared fixtures. ``dist_pool``: run a test body on N local gloo ranks (see docs/testing.md)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# Test modules and the harness import each other by plain name (``from distributed import ...``)
# and workers re-import test modules by name, whatever pytest's import mode.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
# The benchmark programs (perf/*.py) import their siblings by plain name, as they do when run as
# scripts; their smoke tests import them the same way (appended: a test module name wins).
_PERF_DIR = os.path.join(os.path.dirname(_TESTS_DIR), "perf")
if _PERF_DIR not in sys.path:
    sys.path.append(_PERF_DIR)

# Under pytest-xdist each worker's torch gets its share of the cores, not all of them: with the
# default (one intra-op thread per core) every worker's OpenMP regions wait on threads that the
# other workers' processes hold, and a 10 ms step of a tiny model takes a second on 2 busy cores.
# In the environment too, so notebook kernels and the processes tests start inherit it (an
# explicit OMP_NUM_THREADS wins).
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // _XDIST_WORKERS))
    import torch  # noqa: E402

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from distributed import DistPool  # noqa: E402


@pytest.hookimpl(trylast=True)  # after -m/-k deselected: the chunks are of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (they start their own processes: torchrun, ``shardkit train``, a
    notebook kernel; 10 s to 2 min each) run first, spread over the pytest-xdist workers.

    ``--dist load`` (make test) hands each of the ``n`` workers a first chunk of
    ``len(items) // n // 4`` consecutive tests, then more as they finish. Putting every slow test
    at the front would give them all to the first worker; instead chunk ``k`` starts with every
    ``n``-th slow test, so the workers start on them together and end together on short tests.
    Without xdist: slow tests first, the rest in collection order.
    """
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    fast = [item for item in items if item.get_closest_marker("slow") is None]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        items[:] = slow + fast
        return
    chunk = max(2, len(items) // workers // 4)  # xdist's first chunk per worker (LoadScheduling)
    ordered: list[pytest.Item] = []
    for k in range(workers):
        head = slow[k::workers]
        take = max(0, chunk - len(head))
        ordered += head + fast[:take]
        fast = fast[take:]
    items[:] = ordered + fast


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[DistPool]:
    """Session-wide worker pools, one per world size, started on first use.

    ``dist_pool.run(fn, *args, world_size=2, timeout=60, **kwargs) -> list`` runs the
    module-level function ``fn`` on every rank of an initialized gloo world and returns the
    per-rank results; a failure, hang or crash raises with the failing rank's traceback.
    """
    pool = DistPool()
    yield pool
    pool.close()
