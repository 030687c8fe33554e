"""``shardkit bench <name>``: finds a benchmark program in the source tree's ``perf/`` and runs it.

The benchmarks themselves, with their peers (torch DDP and FSDP2, DTensor, DeepSpeed,
torch.distributed.pipelining, a CUDA C AdamW), live in ``perf/`` next to their results; none of
that is part of the installed package, which keeps only this list and the launcher. From a
checkout (``pip install -e .``, as the Makefile does) ``shardkit bench zero ...`` is
``python perf/zero.py ...``; elsewhere point ``SHARDKIT_PERF_DIR`` at a checkout's ``perf/``.

Example:
    >>> from shardkit.bench import run
    >>> run("optim", ["--quick", "--out", "/tmp/optim.json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

__all__ = ["BENCHMARKS", "Benchmark", "perf_dir", "run"]


class Benchmark(NamedTuple):
    """A benchmark: its program in ``perf/`` and a one-line help."""

    program: str
    help: str


#: benchmark name -> program. perf/ddp.py, perf/engine.py and perf/offload.py run as scripts only.
BENCHMARKS: dict[str, Benchmark] = {
    "optim": Benchmark("optim.py", "fused optimizers vs torch.optim and DeepSpeed"),
    "tp": Benchmark(
        "tp.py", "tensor/sequence parallel step vs DTensor; vocab-parallel cross-entropy vs gather + F.cross_entropy"
    ),
    "context_parallel": Benchmark(
        "context_parallel.py",
        "context parallelism: attention vs PyTorch's ring and DeepSpeed Ulysses; per-rank step memory and time vs cp",
    ),
    "pipeline": Benchmark("pipeline.py", "pipeline schedules (step time, measured bubble) vs torch.distributed.pipelining"),
    "zero": Benchmark("zero.py", "ZeRO-1/2/3 (+ CPU offload) step time and memory vs ZeroRedundancyOptimizer, FSDP2, DeepSpeed"),
}


def perf_dir() -> Path:
    """The ``perf/`` folder holding the benchmark programs: ``$SHARDKIT_PERF_DIR``, else the one
    beside this package in a source checkout.

    Raises:
        FileNotFoundError: neither exists (an installed wheel without the source tree).

    Example:
        >>> perf_dir().name
        'perf'
    """
    env = os.environ.get("SHARDKIT_PERF_DIR")
    candidates = [Path(env)] if env else [Path(__file__).resolve().parents[2] / "perf"]
    for path in candidates:
        if (path / BENCHMARKS["optim"].program).is_file():
            return path
    where = f"SHARDKIT_PERF_DIR={env}" if env else f"{candidates[0]} (beside the installed package)"
    raise FileNotFoundError(
        f"no benchmark programs at {where}: they ship with the source tree, not the package; "
        "clone the repository (`make bench` there) or set SHARDKIT_PERF_DIR to a checkout's perf/"
    )


def run(name: str, argv: list[str] | None = None) -> int:
    """Run benchmark ``name``'s program with command-line arguments ``argv``; returns its exit code.

    Args:
        name: one of :data:`BENCHMARKS` (e.g. ``"optim"``).
        argv: its arguments (``None``: none).

    Raises:
        ValueError: unknown benchmark name.
        FileNotFoundError: no ``perf/`` folder (see :func:`perf_dir`).

    Example:
        >>> run("optim", ["--help"])  # doctest: +SKIP
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; available: {sorted(BENCHMARKS)}")
    program = perf_dir() / BENCHMARKS[name].program
    return subprocess.run([sys.executable, str(program), *(argv or [])], check=False).returncode
