"""The ``shardkit`` command line: ``shardkit train ...``, ``shardkit bench optim ...``, ``shardkit plan ...``.

``shardkit train --nproc N`` (N > 1) re-runs ``python -m shardkit.cli train <same flags>`` under
``torch.distributed.run`` (torchrun) with N workers; each worker trains in process, as one rank.

Example:
    $ shardkit train --steps 300                      # one process
    $ shardkit train --nproc 2 --strategy ddp --bf16  # two processes, data parallel
    $ shardkit train --nproc 2 --config ds.json       # a DeepSpeed config, through shardkit.initialize
    $ shardkit bench optim --help
    $ shardkit plan --params 7.5e9 --dp 64 --precision fp16 --device-gb 32   # ZeRO memory plan
    $ shardkit consolidate ckpt/latest export/        # sharded checkpoint -> model.pt, optimizer.pt
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import shardkit
from shardkit.bench import BENCHMARKS
from shardkit.bench import run as run_benchmark
from shardkit.train.config import LAUNCH_WORLD_ENV, TrainConfig, add_arguments, from_args, to_argv
from shardkit.train.process_lifetime import die_with_parent
from shardkit.train.worker_logs import earlier_failures, failure_report, first_failures, rank_stderr

if TYPE_CHECKING:  # the planner imports torch: the CLI loads these for `shardkit plan` only
    from shardkit.parallel.activation_memory import ActivationPlan
    from shardkit.parallel.zero.planner import StageTable

#: more CPU ranks per core than this is refused by ``shardkit train`` (see ``_check_cores``)
MAX_RANKS_PER_CORE = 4

__all__ = ["build_parser", "launch", "main", "run_consolidate", "run_plan"]

_EXAMPLES = """\
examples:
  shardkit train --steps 300                         train on this process
  shardkit train --nproc 2 --strategy ddp --bf16     2 processes, data parallel, bf16 autocast
  shardkit train --steps 50 --log-json run.json      write loss curves and per-rank summaries
  shardkit train --nproc 2 --strategy zero2          2 processes, ZeRO-2 (the `make demo` run)
  shardkit train --nproc 2 --config ds.json          through shardkit.initialize with a DeepSpeed config
  shardkit train --config ds.json --model hf:gpt2    a transformers GPT-2 from config (the `test` extra)
  shardkit config check ds.json --auto lr=3e-4       what a DeepSpeed config resolves to, memory per rank
  shardkit bench optim                               fused AdamW vs torch.optim
  shardkit bench zero                                ZeRO-1/2 vs ZeroRedundancyOptimizer, FSDP2, DeepSpeed
  shardkit plan --params 7.5e9 --dp 64 --precision fp16 --device-gb 32
                                                     per-rank memory of DDP and ZeRO-1/2/3
  shardkit plan --model tinygpt --seq-len 4096 --cp 4
                                                     + activations per rank, cp = 1 and cp = 4
  shardkit consolidate ckpt/latest export/           sharded checkpoint -> plain torch.save files

`shardkit COMMAND --help` lists a command's flags.
"""

_TRAIN_DESCRIPTION = """\
Train TinyGPT (char-level, ~0.8M params by default) on a deterministic generated corpus, or a
transformers GPT-2/Llama built from config (--model hf:gpt2|hf:llama).
--nproc N > 1 re-launches with torchrun (needs --strategy, or --config); rank 0 shows progress and
prints every rank's summary: losses, tokens/s, wall time, bytes of params/grads/optimizer
state per rank, and communication volume. bf16/fp16 are emulated (slow) on most CPUs.
--config ds.json trains through shardkit.initialize: the DeepSpeed config decides ZeRO stage,
offload, precision, optimizer, LR schedule and batch sizes; the flags only fill its "auto"
values (docs/engine.md, "The command line")."""


_PLAN_DESCRIPTION = """\
Predict per-rank device memory (params, grads, optimizer state, transient buffers), host/NVMe
memory with offload, and communication per step for DDP (stage 0) and ZeRO-1/2/3, without
allocating anything (formulas: docs/planner.md). Sizes in GB = 1e9 bytes, the ZeRO paper's unit.
With --model tinygpt, also the activations per rank of one forward + backward of --batch-size
sequences of --seq-len tokens, at cp = 1 and at --cp N (each rank holding 1/N of every sequence),
and model states + activations per rank. With --params, activations are not included: leave
room for them."""

_CONSOLIDATE_DESCRIPTION = """\
Read a checkpoint saved by shardkit.parallel.save_checkpoint (any dp size, ZeRO stage,
DataParallel or one process) in this one process, without torch.distributed, and write
OUT/model.pt (the model's state_dict) and OUT/optimizer.pt (a torch.optim state_dict, params
indexed in model.named_parameters() order): plain tensors and dicts, loadable with torch alone.
Details: docs/checkpoint.md."""

_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_PLAN_MODEL_FLAGS = ("d_model", "n_layers", "n_heads", "seq_len")
_TRAIN_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}
_PLAN_ACTIVATION_FLAGS = {
    "batch_size": "--batch-size",
    "cp": "--cp",
    "cp_mode": "--cp-mode",
    "cp_ulysses": "--cp-ulysses",
    "device": "--device",
}


def _count(text: str) -> int:
    """A parameter count: ``7500000000``, ``7.5e9``, ``7.5B``, ``350M``, ``1T``."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = _SUFFIX.get(t[-1:].lower(), 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 7.5e9, 7.5B, 350M)") from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"a parameter count must be a whole number >= 0, got {text!r}")
    return int(value)


def _add_plan_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan",
        help="predict per-rank memory and communication of DDP and ZeRO-1/2/3 (nothing is allocated)",
        description=_PLAN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_count, metavar="N", help="parameter count Ψ: 7.5e9, 7.5B, 350M")
    what.add_argument("--model", choices=["tinygpt"], help="count the demo's TinyGPT (built on the meta device)")
    plan.add_argument("--dp", type=int, default=1, metavar="N", help="data-parallel ranks (default %(default)s)")
    plan.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="also print this stage's breakdown")
    plan.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="bf16/fp16: 2-byte params and grads + fp32 master and moments (default %(default)s)",
    )
    plan.add_argument(
        "--optimizer",
        default="adamw",
        metavar="NAME|K",
        help="adamw, adam, lamb, lion, sgd_momentum, sgd, adagrad, or K bytes/param (default %(default)s)",
    )
    plan.add_argument("--offload", choices=["cpu", "nvme"], help="optimizer state off the device (stages 1-3)")
    plan.add_argument("--offload-params", action="store_true", help="stage 3: parameter shard off the device too")
    plan.add_argument(
        "--hpz",
        type=int,
        default=1,
        metavar="B",
        help="stage 3: hierarchical gathers (ZeRO++'s hpZ) in blocks of B of the dp x cp ranks: each keeps a 1/B piece "
        "of every block's parameters from its forward to its backward (default 1: off)",
    )
    plan.add_argument("--device-gb", type=float, metavar="GB", help="device memory (1e9 bytes) to check fits against")
    plan.add_argument("--bucket-mb", type=float, default=25.0, metavar="MB", help="gradient bucket MiB (default %(default)s)")
    plan.add_argument(
        "--unit-params",
        type=_count,
        metavar="N",
        help="largest ZeRO-3 unit (default: the whole model; --model tinygpt: its largest block)",
    )
    model = plan.add_argument_group("--model tinygpt (the demo's flags and defaults)")
    for f in fields(TrainConfig):
        if f.name in _PLAN_MODEL_FLAGS:
            model.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f.name,
                type=int,
                default=f.default,
                metavar=f.metadata["metavar"],
                help=f"{f.metadata['help']} (default %(default)s)",
            )
    # default None: given with --params they are a usage error; with --model, `shardkit train`'s defaults
    acts = plan.add_argument_group('activations (--model tinygpt; docs/planner.md, "Activations")')
    acts.add_argument("--batch-size", type=int, metavar="B", help=f"sequences per rank (default {_TRAIN_DEFAULTS['batch_size']})")
    acts.add_argument("--cp", type=int, metavar="N", help="context-parallel ranks: each holds 1/N of every sequence (default 1)")
    acts.add_argument("--cp-mode", choices=["ring", "ulysses", "hybrid"], help="attention over the cp ranks (default ring)")
    acts.add_argument("--cp-ulysses", type=int, metavar="U", help="with --cp-mode hybrid: cp ranks per all-to-all group")
    acts.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        help="whose attention kernels' working buffers to count; cpu: torch's CPU path, ring attention's per-run CPU kernel buffers (default cuda)",
    )


def run_plan(args: argparse.Namespace) -> int:
    """``shardkit plan``: print the stage table (and one stage's breakdown with ``--stage``); with
    ``--model tinygpt`` also the activations per rank at cp = 1 and ``--cp N``, and model states +
    activations per stage (docs/planner.md, "Activations").

    Raises:
        ValueError: an invalid combination (e.g. ``--offload-params`` without ``--offload``, ``--cp``
            without ``--model tinygpt``) or value (``--cp 0``, a ``--seq-len`` that does not split
            into ``2 * cp`` chunks); the message names the flag.
    """
    from shardkit.parallel.zero.planner import plan_table  # imports torch
    from shardkit.parallel.zero.planner import plan_memory, unit_sizes

    given = [flag for name, flag in _PLAN_ACTIVATION_FLAGS.items() if getattr(args, name) is not None]
    if args.model != "tinygpt" and given:
        raise ValueError(f"{given[0]} needs --model tinygpt: activations are counted from the model's shape")
    cp = 1 if args.cp is None else args.cp
    if cp < 1:
        raise ValueError(f"--cp must be >= 1, got {cp}")
    if args.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {args.dp}")
    if args.model == "tinygpt":
        for name in _PLAN_MODEL_FLAGS:
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    what: object = args.params
    unit = args.unit_params
    if args.model == "tinygpt":
        import torch

        from shardkit.data import ALPHABET
        from shardkit.models import Block, TinyGPT

        with torch.device("meta"):  # counted from shapes only: any size plans without memory
            what = TinyGPT(len(ALPHABET), args.d_model, args.n_layers, args.n_heads, args.seq_len)
        unit = unit if unit is not None else max(unit_sizes(what, {Block}))
    optimizer: str | int = int(args.optimizer) if args.optimizer.isdigit() else args.optimizer
    kw = dict(
        dp=args.dp * cp,  # parameters are replicated over dp x cp; ZeRO shards over that (dp_cp) group
        precision=args.precision,
        optimizer=optimizer,
        offload=args.offload,
        offload_params=args.offload_params,
        bucket_mb=args.bucket_mb,
        largest_unit_params=unit,
        device_bytes=None if args.device_gb is None else int(args.device_gb * 1e9),
    )
    if args.stage is not None and args.stage != 3 and args.offload_params:
        raise ValueError("--offload-params needs --stage 3 (or no --stage)")
    if args.hpz != 1:
        if args.hpz < 1 or (args.dp * cp) % args.hpz or (args.stage is not None and args.stage != 3):
            raise ValueError(f"--hpz {args.hpz}: a divisor of dp x cp = {args.dp * cp}, with --stage 3 (or no --stage)")
        if args.hpz < args.dp * cp:
            kw["reshard_after_forward"] = args.hpz
    activations = _plan_activations(args, cp) if args.model == "tinygpt" else None  # its flag errors first
    table = plan_table(what, **kw)  # type: ignore[arg-type]
    if cp > 1:
        print(
            f"cp = {cp}: parameters are replicated over dp x cp = {args.dp} x {cp} = {args.dp * cp} ranks (the dp_cp group), "
            "over which DDP reduces and ZeRO shards: the table's dp is that group's size"
        )
    print(table.render())
    if unit is None and args.stage in (None, 3):
        print(
            "note: ZeRO-3's transient assumes the whole model is gathered at once (no unit size given); "
            "pass --unit-params N (the largest block's parameters) for the per-block gathers it really does, "
            "or --model tinygpt to count them"
        )
    if activations is not None:
        print()
        print(_render_activations(args, activations, table))
    if args.stage is not None:
        if args.stage == 0:
            kw.pop("offload"), kw.pop("offload_params")
        print()
        print(plan_memory(what, stage=args.stage, **kw).table())  # type: ignore[arg-type]
    return 0


def _plan_activations(args: argparse.Namespace, cp: int) -> list[ActivationPlan]:
    """The activation plans of ``--model tinygpt`` at cp = 1 and (with ``--cp N``) cp = N."""
    from shardkit.data import ALPHABET
    from shardkit.parallel.activation_memory import activation_bytes

    batch = _TRAIN_DEFAULTS["batch_size"] if args.batch_size is None else args.batch_size
    mode = args.cp_mode or "ring"
    if batch < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch}")
    if cp > 1 and args.seq_len % (2 * cp):
        raise ValueError(f"--seq-len {args.seq_len} must be a multiple of 2 x cp = {2 * cp} (zigzag: two chunks per cp rank)")
    if cp > 1 and mode == "ulysses" and args.n_heads % cp:
        raise ValueError(f"--cp-mode ulysses splits the {args.n_heads} heads (--n-heads) over --cp {cp}: they must divide")
    if args.cp_ulysses is not None and mode != "hybrid":
        raise ValueError(f"--cp-ulysses {args.cp_ulysses} applies to --cp-mode hybrid only")
    if mode == "hybrid" and cp == 1:
        raise ValueError("--cp-mode hybrid needs --cp N > 1 (the cp ranks it splits into all-to-all groups)")
    if mode == "hybrid" and (args.cp_ulysses is None or args.cp_ulysses < 1 or cp % args.cp_ulysses):
        raise ValueError(f"--cp-mode hybrid needs --cp-ulysses U, a divisor of --cp {cp}; got {args.cp_ulysses}")
    if mode == "hybrid" and args.n_heads % args.cp_ulysses:
        raise ValueError(
            f"--cp-mode hybrid splits the {args.n_heads} heads (--n-heads) over --cp-ulysses {args.cp_ulysses}: they must divide"
        )
    kw = dict(
        seq_len=args.seq_len,
        batch=batch,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        vocab_size=len(ALPHABET),
        dtype_bytes=4 if args.precision == "fp32" else 2,
        device=args.device or "cuda",
    )
    plans = [activation_bytes(**kw, cp=1)]
    if cp > 1:
        plans.append(activation_bytes(**kw, cp=cp, mode=mode, ulysses_size=args.cp_ulysses if mode == "hybrid" else None))
    return plans


def _cp_mode_text(args: argparse.Namespace) -> str:
    mode = args.cp_mode or "ring"
    return f"hybrid {args.cp_ulysses}x{(args.cp or 1) // args.cp_ulysses}" if mode == "hybrid" else mode


def _render_activations(args: argparse.Namespace, plans: list[ActivationPlan], table: StageTable) -> str:
    """The activations table, then model states + activations per rank for each stage."""
    from shardkit.parallel.activation_memory import activation_table
    from shardkit.parallel.zero.planner import format_gb

    last = plans[-1]
    stage_plans = table.plans
    scale, name = (10**9, "GB") if max(p.device_total for p in stage_plans) + last.per_rank >= 10**9 else (10**6, "MB")
    a = "fp32" if last.dtype_bytes == 4 else "2-byte"
    head = (
        f"activations per rank in {name} (1e{9 if name == 'GB' else 6}) of one forward + backward: TinyGPT "
        f"d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads; batch {last.batch} x {last.seq_len} tokens, "
        f"{a} activations, cp-mode {_cp_mode_text(args)}, {last.device} attention kernels; "
        'peak = saved + working buffers (docs/planner.md, "Activations")'
    )
    totals = []
    for p in stage_plans:
        both = p.device_total + last.per_rank
        fits = "" if p.device_bytes is None else (" fits" if both <= p.device_bytes else " does NOT fit")
        totals.append(
            f"{p.name} {format_gb(p.device_total, scale)} + {format_gb(last.per_rank, scale)} = {format_gb(both, scale)}{fits}"
        )
    foot = f"model states (total above) + activations peak per rank at cp = {last.cp}, {name}: " + " | ".join(totals)
    return "\n".join([head, activation_table(plans, unit=scale), foot])


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def launch(cfg: TrainConfig) -> int:
    """Run ``cfg`` with ``cfg.nproc`` processes; returns the exit code (0 on success).

    ``nproc == 1`` trains in this process (``ddp`` then runs as a world of one; inside a torchrun
    worker, as that worker's rank). ``nproc > 1`` (or ``max_restarts > 0``) runs ``python -m
    torch.distributed.run --standalone --nproc-per-node N --max-restarts K -m shardkit.cli train
    <flags>`` with ``OMP_NUM_THREADS = cores // N`` unless already set, so CPU workers do not
    oversubscribe the cores; torchrun and its workers end when this process does
    (:func:`~shardkit.train.process_lifetime.die_with_parent`). A failure in this process
    raises; a failed worker gives torchrun's non-zero exit code and a report naming the rank that
    failed first (:mod:`shardkit.train.worker_logs`), and each restarted attempt's failure is
    reported the same way.

    Example:
        >>> launch(TrainConfig(nproc=2, strategy="ddp", steps=100))
        0
    """
    from shardkit.train.device import check_device  # no torch for --device cpu

    if cfg.nproc > 1 or cfg.nnodes > 1:  # a worker (nproc == 1) validates against torchrun's world in train()
        cfg.validate()
    # Before starting any worker: local rank r would take cuda:r, so N ranks need N GPUs here.
    device = check_device(cfg.device, ranks_per_node=cfg.nproc)
    if _check_cores(cfg, device):
        print(f"shardkit train: warning: {cfg.nproc} ranks share {_cpu_count()} CPU cores: steps will be slow", file=sys.stderr)
    if cfg.nproc == 1 and cfg.max_restarts == 0 and cfg.nnodes == 1:
        from shardkit.train import train

        if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: end with torchrun, never orphaned
            die_with_parent()
        train(cfg)
        return 0
    if cfg.max_restarts > 0 and cfg.resume != "auto":
        print(
            f"shardkit train: warning: --max-restarts {cfg.max_restarts} without --ckpt-dir/--resume auto: "
            "a restarted run begins again at step 0",
            file=sys.stderr,
        )
    if cfg.min_nnodes and not cfg.global_batch:
        print(
            f"shardkit train: warning: --min-nnodes {cfg.min_nnodes} without --global-batch: --batch-size is per rank, "
            "so a run that goes on with fewer machines takes smaller steps",
            file=sys.stderr,
        )
    env = {**os.environ, LAUNCH_WORLD_ENV: str(cfg.nproc * cfg.nnodes)}  # the workers warn if they start short
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cpu_count() // cfg.nproc)))
    log_dir = Path(tempfile.mkdtemp(prefix="shardkit-train-"))
    if cfg.nnodes == 1:
        rendezvous = ["--standalone"]
    else:  # every machine runs the same command; the ranks meet at the first one's endpoint
        rendezvous = [
            f"--nnodes={cfg.min_nnodes}:{cfg.nnodes}" if cfg.min_nnodes else f"--nnodes={cfg.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint}",
            f"--rdzv-id=shardkit-{cfg.rdzv_endpoint}",
        ]
        if cfg.min_nnodes:  # elastic: a lost machine is dropped from the next round ([Note: elastic restarts])
            rendezvous.append(f"--rdzv-conf=last_call_timeout={cfg.rdzv_wait}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        f"--nproc-per-node={cfg.nproc}",
        # every worker's stderr to its own file, read once below: one copy of a warning, one line
        # per failed rank instead of N interleaved tracebacks (shardkit/train/worker_logs.py)
        "--redirects=2",
        f"--log-dir={log_dir}",
        # after a worker fails, torchrun stops the others and starts them all again, K times at
        # most; with --resume auto they continue from the newest checkpoint (docs/operations.md)
        f"--max-restarts={cfg.max_restarts}",
        # Workers get no --nproc (so each trains in process); torchrun's parser also scans the
        # script's flags and would reject --nproc as an ambiguous prefix of --nproc-per-node.
        "-m",
        "shardkit.cli",
        "train",
        *to_argv(cfg, skip={"nproc", "max_restarts", "nnodes", "rdzv_endpoint", "min_nnodes", "rdzv_wait"}),
    ]
    # torchrun (and through it the workers) ends when this process does, however it ends
    run = subprocess.run(cmd, env=env, check=False, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    for attempt, report in earlier_failures(log_dir, cfg.nproc, run.stderr):
        print(f"shardkit train: attempt {attempt} failed and the workers were restarted: {report}", file=sys.stderr)
    if run.returncode == 0:
        sys.stderr.write(rank_stderr(log_dir, 0))  # warnings once (rank 0's), not once per rank
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        if cfg.nnodes > 1 and "RendezvousConnectionError" in run.stderr:  # [Note: elastic restarts]
            print(
                f"shardkit train: lost the rendezvous store at --rdzv-endpoint {cfg.rdzv_endpoint}: the machine that "
                "hosts it (the one started first there) ended, and no run outlives it, elastic or not",
                file=sys.stderr,
            )
        failures = first_failures(run.stderr)
        report = failure_report(
            log_dir,
            cfg.nproc,
            launcher_tail=_tail(run.stderr, 8),
            first_failed=failures[-1] if len(failures) > cfg.max_restarts else None,
        )
        print(f"shardkit train: {report}", file=sys.stderr)
    return run.returncode


def _tail(text: str, n: int) -> str:
    """The last ``n`` non-empty lines of ``text``, joined with `` / ``."""
    return " / ".join([line.strip() for line in text.splitlines() if line.strip()][-n:])


def _check_cores(cfg: TrainConfig, device: str) -> bool:
    """Whether CPU ranks oversubscribe the cores (more ranks than cores: slow, warned about by
    :func:`launch`); more than :data:`MAX_RANKS_PER_CORE` per core is an error before anything
    starts (each rank would get a sliver of a core: minutes per step).

    Args:
        cfg: the run.
        device: ``check_device``'s answer, ``"cpu"`` or ``"cuda"``.
    """
    cores = _cpu_count()
    if device != "cpu" or cfg.nproc <= cores:
        return False
    if cfg.nproc > MAX_RANKS_PER_CORE * cores:
        raise ValueError(
            f"--nproc {cfg.nproc} on {cores} CPU cores: at most {MAX_RANKS_PER_CORE * cores} ranks "
            f"({MAX_RANKS_PER_CORE} per core) train at a usable speed here"
        )
    return True


def build_parser() -> argparse.ArgumentParser:
    """The ``shardkit`` argument parser (sub-commands ``train``, ``bench`` and ``plan``).

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
    _add_plan_parser(commands)
    config = commands.add_parser("config", help="check a DeepSpeed-style JSON config (`shardkit config check --help`)")
    config_actions = config.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    config_actions.add_parser("check", help="validate ds.json; print what it resolves to and the memory per rank", add_help=False)
    consolidate = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint into plain torch.save files (model.pt, optimizer.pt)",
        description=_CONSOLIDATE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    consolidate.add_argument("dir", metavar="DIR", help="a checkpoint written by shardkit.parallel.save_checkpoint")
    consolidate.add_argument("out", metavar="OUT", help="output directory for model.pt and optimizer.pt")
    bench = commands.add_parser("bench", help="run a benchmark (`shardkit bench --help` lists them)")
    benches = bench.add_subparsers(dest="bench", metavar="NAME", title="benchmarks", required=True)
    for name, entry in BENCHMARKS.items():
        # add_help=False: every flag after NAME, --help included, belongs to the benchmark's parser.
        benches.add_parser(name, help=f"{entry.help} (`shardkit bench {name} --help`)", add_help=False)
    return parser


def run_consolidate(args: argparse.Namespace) -> int:
    """``shardkit consolidate DIR OUT``: exit 0 with the two paths printed, 1 on a bad checkpoint."""
    from shardkit.consolidate import consolidate  # imports torch: only for this command

    try:
        paths = consolidate(args.dir, args.out)
    except ValueError as e:
        print(f"shardkit consolidate: error: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


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
        try:
            return run_benchmark(args.bench, rest)
        except FileNotFoundError as exc:  # an installed wheel: the programs are in the source tree
            print(f"shardkit bench: {exc}", file=sys.stderr)
            return 2
    if args.command == "config":
        from shardkit.engine.config_check import config_check_main  # imports torch: only for this command

        return config_check_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "consolidate":
        return run_consolidate(args)
    if args.command == "plan":
        try:
            return run_plan(args)
        except ValueError as e:  # bad combinations name the argument: a usage error
            parser.error(str(e))
    cfg = from_args(args)
    from shardkit.train.device import check_device  # imports torch only to look for CUDA

    try:
        # a torchrun worker runs with nproc=1 (see launch) in a world of WORLD_SIZE ranks
        launching = cfg.nproc > 1 or cfg.nnodes > 1
        world = cfg.nproc * cfg.nnodes if launching else int(os.environ.get("WORLD_SIZE", "1"))
        cfg.validate(world_size=None if launching else world)  # launching: every elastic world too
        device = check_device(cfg.device, ranks_per_node=cfg.nproc)  # more ranks than GPUs: a usage error
        _check_cores(cfg, device)  # far more ranks than CPU cores: likewise
        if cfg.config:  # the config's own errors (unknown key, unfilled "auto") before any worker starts
            from shardkit.engine import load_config
            from shardkit.train.engine_loop import auto_values

            # the run itself loads the config again and reports its ignored keys once
            load_config(cfg.config, world_size=world, log_ignored=False, **auto_values(cfg))
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
