"""The ``shardkit`` command line: ``shardkit train ...`` and ``shardkit bench optim ...``.

``shardkit train --nproc N`` (N > 1) re-runs ``python -m shardkit.cli train <same flags>`` under
``torch.distributed.run`` (torchrun) with N workers; each worker trains in process, as one rank.

Example:
    $ shardkit train --steps 300                      # one process
    $ shardkit train --nproc 2 --strategy ddp --bf16  # two processes, data parallel
    $ shardkit bench optim --help
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

import shardkit
from shardkit.bench import BENCHMARKS
from shardkit.bench import run as run_benchmark
from shardkit.train.config import TrainConfig, add_arguments, from_args, to_argv

__all__ = ["build_parser", "launch", "main"]

_EXAMPLES = """\
examples:
  shardkit train --steps 300                         train on this process
  shardkit train --nproc 2 --strategy ddp --bf16     2 processes, data parallel, bf16 autocast
  shardkit train --steps 50 --log-json run.json      write loss curves and per-rank summaries
  shardkit bench optim                               fused AdamW vs torch.optim

`shardkit COMMAND --help` lists a command's flags.
"""

_TRAIN_DESCRIPTION = """\
Train TinyGPT (char-level, ~0.8M params by default) on a deterministic generated corpus.
--nproc N > 1 re-launches with torchrun (needs --strategy ddp); rank 0 shows progress and
prints every rank's summary: losses, tokens/s, wall time, bytes of params/grads/optimizer
state per rank, and communication volume. bf16/fp16 are emulated (slow) on most CPUs."""


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def launch(cfg: TrainConfig) -> int:
    """Run ``cfg`` with ``cfg.nproc`` processes; returns the exit code (0 on success).

    ``nproc == 1`` trains in this process (``ddp`` then runs as a world of one; inside a torchrun
    worker, as that worker's rank). ``nproc > 1`` runs ``python -m torch.distributed.run
    --standalone --nproc-per-node N -m shardkit.cli train <flags>`` with ``OMP_NUM_THREADS =
    cores // N`` unless already set, so CPU workers do not oversubscribe the cores. A failure in
    this process raises; a failed worker gives torchrun's non-zero exit code.

    Example:
        >>> launch(TrainConfig(nproc=2, strategy="ddp", steps=100))
        0
    """
    from shardkit.train import resolve_device, train

    cfg.validate()
    # Before starting any worker: local rank r would take cuda:r, so N ranks need N GPUs here.
    resolve_device(cfg.device, ranks_per_node=cfg.nproc)
    if cfg.nproc == 1:
        train(cfg)
        return 0
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cpu_count() // cfg.nproc)))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.nproc}",
        # Workers get no --nproc (so each trains in process); torchrun's parser also scans the
        # script's flags and would reject --nproc as an ambiguous prefix of --nproc-per-node.
        "-m", "shardkit.cli", "train", *to_argv(cfg, skip={"nproc"}),
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, check=False).returncode


def build_parser() -> argparse.ArgumentParser:
    """The ``shardkit`` argument parser (sub-commands ``train`` and ``bench``).

    Example:
        >>> ns = build_parser().parse_args(["train", "--steps", "10"])
        >>> ns.command, ns.steps
        ('train', 10)
    """
    parser = argparse.ArgumentParser(
        prog="shardkit",
        description="shardkit: Triton-kernel fused optimizers and data/tensor/pipeline parallelism for PyTorch.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardkit {shardkit.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    train = commands.add_parser(
        "train",
        help="train a small GPT on a built-in synthetic corpus (one process or DDP)",
        description=_TRAIN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(train)
    bench = commands.add_parser("bench", help="run a benchmark (`shardkit bench --help` lists them)")
    benches = bench.add_subparsers(dest="bench", metavar="NAME", title="benchmarks", required=True)
    for name, entry in BENCHMARKS.items():
        # add_help=False: every flag after NAME, --help included, belongs to the benchmark's parser.
        benches.add_parser(name, help=f"{entry.help} (`shardkit bench {name} --help`)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardkit`` command line; returns the process exit code.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Example:
        >>> main(["train", "--steps", "20", "--d-model", "64"])
        0
    """
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return run_benchmark(args.bench, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    cfg = from_args(args)
    from shardkit.train import resolve_device  # imports torch: only for `train`

    try:
        cfg.validate()
        resolve_device(cfg.device, ranks_per_node=cfg.nproc)  # more ranks than GPUs: a usage error
    except ValueError as e:
        parser.error(str(e))
    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
