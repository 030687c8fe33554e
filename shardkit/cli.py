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
from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING

import shardkit

if TYPE_CHECKING:
    from shardkit.train import TrainConfig

__all__ = ["add_train_arguments", "build_parser", "config_from_args", "config_to_argv", "launch", "main"]

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


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags to ``parser``; defaults come from :class:`~shardkit.train.TrainConfig`.

    Example:
        >>> p = argparse.ArgumentParser(); add_train_arguments(p)
        >>> config_from_args(p.parse_args(["--steps", "300", "--bf16"])).precision
        'bf16'
    """
    from shardkit.train import TrainConfig  # imports torch: only when a parser is built

    d = TrainConfig()
    g = parser.add_argument_group("launch")
    g.add_argument("--nproc", metavar="N", type=int, default=d.nproc,
                   help="worker processes; > 1 re-launches with torchrun (default %(default)s)")
    g.add_argument("--strategy", choices=["none", "ddp"], default=d.strategy,
                   help="parallel strategy (default %(default)s)")
    g.add_argument("--bucket-mb", metavar="MB", type=float, default=d.bucket_mb,
                   help="ddp: gradient bucket size in MiB (default %(default)s)")
    g.add_argument("--grad-buckets", choices=["copy", "view"], default=d.grad_buckets,
                   help="ddp: 'view' makes each grad a view of its bucket (gradients held once, "
                        "no copy back); 'copy' keeps separate grads (default %(default)s)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device,
                   help="default %(default)s: cuda when available")
    g.add_argument("--seed", metavar="N", type=int, default=d.seed,
                   help="model and data seed, the same on every rank (default %(default)s)")
    g = parser.add_argument_group("model (TinyGPT)")
    g.add_argument("--d-model", metavar="D", type=int, default=d.d_model, help="residual width (default %(default)s)")
    g.add_argument("--n-layers", metavar="L", type=int, default=d.n_layers, help="blocks (default %(default)s)")
    g.add_argument("--n-heads", metavar="H", type=int, default=d.n_heads, help="attention heads (default %(default)s)")
    g.add_argument("--dropout", metavar="P", type=float, default=d.dropout, help="default %(default)s")
    g = parser.add_argument_group("optimization (FusedAdamW)")
    g.add_argument("--steps", metavar="N", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    g.add_argument("--batch-size", metavar="B", type=int, default=d.batch_size,
                   help="sequences per rank per step (default %(default)s)")
    g.add_argument("--seq-len", metavar="T", type=int, default=d.seq_len,
                   help="tokens per sequence (default %(default)s)")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    g.add_argument("--warmup", metavar="N", type=int, default=d.warmup,
                   help="linear warmup steps, then cosine decay (default %(default)s)")
    g.add_argument("--min-lr-ratio", metavar="R", type=float, default=d.min_lr_ratio,
                   help="final lr / peak lr; 1 = constant after warmup (default %(default)s)")
    g.add_argument("--weight-decay", metavar="WD", type=float, default=d.weight_decay,
                   help="decoupled, on matrices only (default %(default)s)")
    g.add_argument("--clip", metavar="NORM", type=float, default=d.clip,
                   help="max global grad norm, 0 disables (default %(default)s)")
    precision = g.add_mutually_exclusive_group()
    for name, what in (("fp32", "full precision (default)"), ("bf16", "bf16 autocast"),
                       ("fp16", "fp16 autocast with dynamic loss scaling")):  # fmt: skip
        precision.add_argument(f"--{name}", dest="precision", action="store_const", const=name, help=what)
    parser.set_defaults(precision=d.precision)
    g = parser.add_argument_group("evaluation and logging")
    g.add_argument("--eval-every", metavar="N", type=int, default=d.eval_every,
                   help="steps between eval-loss estimates (default %(default)s)")
    g.add_argument("--eval-iters", metavar="N", type=int, default=d.eval_iters,
                   help="fixed validation batches per estimate (default %(default)s)")
    g.add_argument("--sample", metavar="CHARS", type=int, default=d.sample,
                   help="print a generated sample of CHARS characters at the end")
    g.add_argument("--log-json", metavar="PATH", default=d.log_json,
                   help="write the config, loss curves and per-rank summaries here")


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """Build a :class:`~shardkit.train.TrainConfig` from parsed ``train`` flags (extras ignored)."""
    from shardkit.train import TrainConfig

    return TrainConfig(**{f.name: getattr(ns, f.name) for f in fields(TrainConfig) if hasattr(ns, f.name)})


def config_to_argv(cfg: TrainConfig, *, skip: Iterable[str] = ()) -> list[str]:
    """The ``train`` flags that parse back into ``cfg`` (inverse of :func:`config_from_args`).

    Args:
        cfg: the config.
        skip: field names to leave out.

    Example:
        >>> config_to_argv(TrainConfig(steps=7, precision="bf16"))[:4]
        ['--nproc', '1', '--strategy', 'none']
    """
    argv: list[str] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in skip or value is None:
            continue
        argv += [f"--{value}"] if f.name == "precision" else [f"--{f.name.replace('_', '-')}", str(value)]
    return argv


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
    from shardkit.train import train

    cfg.validate()
    if cfg.nproc == 1:
        train(cfg)
        return 0
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cpu_count() // cfg.nproc)))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.nproc}",
        # Workers get no --nproc (so each trains in process); torchrun's parser also scans the
        # script's flags and would reject --nproc as an ambiguous prefix of --nproc-per-node.
        "-m", "shardkit.cli", "train", *config_to_argv(cfg, skip={"nproc"}),
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
    add_train_arguments(train)
    bench = commands.add_parser("bench", help="run a benchmark (`shardkit bench --help` lists them)")
    benches = bench.add_subparsers(dest="bench", metavar="NAME", title="benchmarks", required=True)
    # add_help=False: every flag after `optim`, --help included, belongs to the benchmark's parser.
    benches.add_parser("optim", help="fused optimizers vs torch.optim (`shardkit bench optim --help`)", add_help=False)
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
        from shardkit.bench.optim import main as bench_optim  # lazy: heavy, and owned by bench/

        return int(bench_optim(rest) or 0)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    cfg = config_from_args(args)
    try:
        cfg.validate()
    except ValueError as e:
        parser.error(str(e))
    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
