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

from distributed import DistPool  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (they start their own processes: torchrun, a notebook kernel; up to
    a minute or two each) run first, the rest in collection order. With pytest-xdist's
    worksteal, the two workers of ``make test`` then end on short tests, instead of one idling
    while the other runs a notebook that came last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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
