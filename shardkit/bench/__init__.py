"""Benchmarks shipped with the package, so ``shardkit bench <name>`` runs from an install.

Each benchmark is a module here with a ``main(argv) -> int`` entry point; the ``perf/`` scripts
are thin wrappers around them. Nothing is imported until a benchmark is run.

Example:
    >>> from shardkit.bench import run
    >>> run("optim", ["--quick", "--out", "/tmp/optim.json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import importlib

__all__ = ["BENCHMARKS", "run"]

#: benchmark name -> module under ``shardkit.bench`` that implements it
BENCHMARKS = {"optim": "optim"}


def run(name: str, argv: list[str] | None = None) -> int:
    """Run benchmark ``name`` with command-line arguments ``argv``; returns its exit code.

    Args:
        name: one of :data:`BENCHMARKS` (e.g. ``"optim"``).
        argv: its arguments (``None`` reads ``sys.argv[1:]``, as argparse does).

    Raises:
        ValueError: unknown benchmark name.

    Example:
        >>> run("optim", ["--help"])  # doctest: +SKIP
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; available: {sorted(BENCHMARKS)}")
    module = importlib.import_module(f"{__name__}.{BENCHMARKS[name]}")
    return int(module.main(argv))
