"""Benchmarks shipped with the package: the registry behind ``shardkit bench <name>``.

Each benchmark is a module here with a ``main(argv) -> int`` entry point; ``shardkit bench``
offers exactly the entries of :data:`BENCHMARKS`, and the ``perf/`` scripts of the same subject
are thin wrappers around them. Nothing is imported until a benchmark is run.

Example:
    >>> from shardkit.bench import run
    >>> run("optim", ["--quick", "--out", "/tmp/optim.json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

__all__ = ["BENCHMARKS", "Benchmark", "run"]


class Benchmark(NamedTuple):
    """A registered benchmark: the module under ``shardkit.bench`` and a one-line help."""

    module: str
    help: str


#: benchmark name -> implementation. The data-parallel step-time benchmark (perf/ddp.py) spawns
#: its own processes and stays a repository script for now.
BENCHMARKS: dict[str, Benchmark] = {
    "optim": Benchmark("optim", "fused optimizers vs torch.optim and DeepSpeed"),
    "tp": Benchmark("tp", "tensor/sequence parallel step vs DTensor; vocab-parallel cross-entropy vs gather + F.cross_entropy"),
    "pipeline": Benchmark("pipeline", "pipeline schedules (step time, measured bubble) vs torch.distributed.pipelining"),
    "zero": Benchmark("zero", "ZeRO-1/2/3 (+ CPU offload) step time and memory vs ZeroRedundancyOptimizer, FSDP2, DeepSpeed"),
}


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
    module = importlib.import_module(f"{__name__}.{BENCHMARKS[name].module}")
    result = module.main(argv)
    return result if isinstance(result, int) else 0  # some mains return their results dict
