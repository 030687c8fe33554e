"""``shardkit config check ds.json``: validate a DeepSpeed-style config and print what it resolves to.

Prints the ZeRO stage, offload, precision, batch sizes, optimizer, scheduler and the keys
accepted but ignored, then the planner's memory per rank
(:func:`shardkit.parallel.zero.plan_memory`) for ``--params N`` parameters. Every ``"auto"``
nothing fills is listed in one run; a config that ``shardkit.initialize`` refuses whatever the
training script is invalid here too, and one line names what only the script's objects decide.
Nothing is allocated and no process group is created.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ._reader import TO_CALLER
from .config_reader import UnfilledAutoError, describe_ignored, load_config, load_raw
from .resolved import EngineConfig

__all__ = ["build_config_check_parser", "config_check_main", "describe"]

_PLANNER_OPTIMIZER = {"FusedAdamW": "adamw", "FusedAdam": "adam", "FusedLion": "lion", "FusedLAMB": "lamb"}


def _count(text: str) -> int:
    """A parameter count: 124e6, 124M, 1.5B."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 124e6, 124M, 1.5B)") from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"a parameter count must be a whole number >= 0, got {text!r}")
    return int(value)


def _assignment(text: str) -> tuple[str, Any]:
    """``key=value``; the value is read as JSON (numbers, true/false, lists), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _set_dotted(config: dict[str, Any], dotted: str, value: Any) -> None:
    node = config
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {dotted}: {part!r} is not a section of the config")
        node = child
    node[leaf] = value


def build_config_check_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The arguments of ``shardkit config check`` (added to ``parser`` when given)."""
    p = parser or argparse.ArgumentParser(prog="shardkit config check", description=__doc__.splitlines()[0])
    p.add_argument("config", metavar="CONFIG", help="a DeepSpeed-style JSON config (ds_config.json)")
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks in the job (default %(default)s)")
    p.add_argument(
        "--set",
        type=_assignment,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key by its dotted path, e.g. optimizer.params.lr=3e-4 (repeatable)",
    )
    p.add_argument(
        "--auto",
        type=_assignment,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help='what "auto" stands for, e.g. lr=3e-4, hidden_size=768 (repeatable; a run lists every one missing)',
    )
    p.add_argument("--params", type=_count, metavar="N", help="parameter count for the memory plan: 124e6, 124M, 1.5B")
    p.add_argument("--lenient", action="store_true", help="warn about unknown keys instead of failing")
    return p


def describe(cfg: EngineConfig) -> str:
    """The resolved config as the lines ``shardkit config check`` prints.

    Example:
        >>> print(describe(load_config({"train_batch_size": 8}, world_size=2)))  # doctest: +SKIP
    """
    z, prec = cfg.zero, cfg.precision
    off_opt = z.offload_optimizer.device + (f" ({z.offload_optimizer.nvme_path})" if z.offload_optimizer.nvme_path else "")
    off_par = z.offload_param.device + (f" ({z.offload_param.nvme_path})" if z.offload_param.nvme_path else "")
    if prec.loss_scaler is None:
        precision = prec.dtype
    elif prec.loss_scaler.loss_scale:
        precision = f"fp16, static loss scale {prec.loss_scaler.loss_scale:g}"
    else:
        ls = prec.loss_scaler
        precision = (
            f"fp16, dynamic loss scale from 2^{ls.initial_scale_power} (window {ls.loss_scale_window}, "
            f"hysteresis {ls.hysteresis}, min {ls.min_loss_scale:g})"
        )
    if prec.autocast is not None:
        precision += f"; forward under torch.autocast({prec.autocast}) (torch_autocast)"
    tp, pp = cfg.tensor_parallel, cfg.pipeline
    lines = [
        f"world size {cfg.world_size} = dp {cfg.dp_size} × tensor_parallel {tp.size} × pipeline {pp.stages}",
    ]
    if tp.size > 1:
        logits = "gathered to the full vocabulary" if tp.gather_logits else "vocabulary-parallel shards"
        lines.append(f"tensor parallel: {tp.size} ranks per group, plan {tp.plan!r}; LM-head logits {logits}")
    if pp.stages > 1:
        virtual = f", {pp.virtual_stages} virtual stages per rank" if pp.virtual_stages > 1 else ""
        lines.append(
            f"pipeline: {pp.stages} stages split by {pp.partition}, schedule {pp.schedule}{virtual}; train_batch runs "
            f"{cfg.gradient_accumulation_steps} micro-batches as {pp.microbatches} pipeline micro-batches of "
            f"{cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps // pp.microbatches} rows"
        )
    lines += [
        f"ZeRO stage {z.stage}; offload optimizer: {off_opt}; offload params: {off_par}",
        f"precision: {precision}",
        f"batch: train_batch_size {cfg.train_batch_size} = micro {cfg.train_micro_batch_size_per_gpu} × "
        f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} × dp {cfg.dp_size}",
        f"gradient clipping: {cfg.gradient_clipping:g}" if cfg.gradient_clipping else "gradient clipping: off",
        f"buckets: reduce {z.reduce_bucket_size:,} elements ({z.bucket_mb(prec.grad_bytes):.1f} MiB), "
        f"allgather {z.allgather_bucket_size:,}; overlap_comm {z.overlap_comm}",
    ]
    if z.stage == 3:
        lines.append(
            f"stage 3: prefetch {z.prefetch_bucket_size:,}, persistence threshold {z.param_persistence_threshold:,}, "
            f"max live {z.max_live_parameters:,}, max reuse distance {z.max_reuse_distance:,}"
            + (f"; hpZ: backward gathers inside blocks of {z.hpz_partition_size} dp ranks" if z.hpz_partition_size > 1 else "")
        )
    if cfg.optimizer is None:
        lines.append("optimizer: none in the config (the training script brings one)")
    else:
        args = ", ".join(f"{k}={v!r}" for k, v in cfg.optimizer.params.items())
        lines.append(f"optimizer: {cfg.optimizer.type} -> shardkit.kernels.{cfg.optimizer.class_name}({args})")
    if cfg.scheduler is None:
        lines.append("scheduler: none in the config")
    else:
        args = ", ".join(f"{k}={v!r}" for k, v in cfg.scheduler.params.items())
        lines.append(f"scheduler: {cfg.scheduler.type}({args})")
    lines.append("ignored keys: " + (describe_ignored(cfg.ignored) if cfg.ignored else "none"))
    return "\n".join(lines)


def _plan(cfg: EngineConfig, num_params: int) -> str:
    from shardkit.parallel.zero import plan_memory  # the planner is pure; imported only when asked

    opt = cfg.optimizer
    if opt is None:
        name, note = "adamw", " (no optimizer in the config: AdamW assumed)"
    elif opt.class_name == "FusedSGD":
        name, note = ("sgd_momentum" if opt.params.get("momentum") else "sgd"), ""
    else:
        name, note = _PLANNER_OPTIMIZER[opt.class_name], ""
    model_parallel = cfg.tensor_parallel.size * cfg.pipeline.stages
    if model_parallel > 1:  # each rank holds ~1/(tp·pp) of the model; the planner shards that over dp
        note += f" (Ψ/{model_parallel} per tensor/pipeline shard: an estimate)"
    plan = plan_memory(
        num_params // model_parallel,
        dp=cfg.dp_size * cfg.context_parallel.size,  # ZeRO shards over dp x cp (the dp_cp group)
        stage=cfg.zero.stage,
        precision=cfg.precision.dtype,
        optimizer=name,
        offload=cfg.zero.offload if cfg.zero.stage > 0 else None,
        offload_params=cfg.zero.offload_param.enabled,
        bucket_mb=cfg.zero.bucket_mb(cfg.precision.grad_bytes),
        nvme_subgroup_params=cfg.zero.sub_group_size,
        reshard_after_forward=cfg.zero.hpz_partition_size if cfg.zero.hpz_partition_size > 1 else True,
    )
    return f"memory per rank (shardkit.parallel.zero.plan_memory){note}:\n{plan.table()}"


def config_check_main(argv: Sequence[str] | None = None) -> int:
    """Run ``shardkit config check``; returns the exit code (0 valid, 1 invalid config, 2 usage).

    Args:
        argv: the arguments after ``config check`` (default ``sys.argv[1:]``).

    Example:
        >>> config_check_main(["ds.json", "--world-size", "2", "--auto", "lr=3e-4", "--params", "124e6"])
        0
    """
    parser = build_config_check_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on usage errors and --help; report its code instead
        return int(e.code or 0)
    return run_config_check(args)


def _cli_words(message: str) -> str:
    """A load_config error in the CLI's words: its Python keywords as this command's flags."""
    return message.replace("(strict=False warns instead)", "(--lenient warns instead)").replace(
        f" {TO_CALLER}", " with --auto NAME=VALUE"
    )


def _initialize_refusals(cfg: EngineConfig) -> tuple[str | None, list[str]]:
    """What ``initialize`` refuses (the message, or None) and warns about for this config alone,
    whatever the training script's model and optimizer: its own check, run here."""
    from .entry import _check_supported  # imports shardkit.parallel: only once the config has parsed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _check_supported(cfg)
        except ValueError as e:
            return str(e), [str(w.message) for w in caught]
    return None, [str(w.message) for w in caught]


def _not_checked(cfg: EngineConfig) -> str:
    """The one line saying what ``initialize`` may still refuse: what depends on the script's objects."""
    low, stage = cfg.precision.dtype != "fp32", cfg.zero.stage
    parts = []
    if cfg.optimizer is None:
        parts.append("that the script passes optimizer= (the config has none)")
    if low or stage > 0 or cfg.tensor_parallel.size > 1 or cfg.pipeline.stages > 1:
        parts.append("a built optimizer= that has already stepped (it is rebuilt on this layout)")
    if low and stage == 0:
        parts.append(f"a built torch.optim optimizer (no fp32 masters with {cfg.precision.dtype} at stage 0)")
    parts += ["a built lr_scheduler= over another optimizer", "model_parameters= against the model"]
    if cfg.tensor_parallel.size > 1:
        parts.append("the model against the tensor_parallel plan")
    if cfg.pipeline.stages > 1:
        parts.append("the model's blocks against the pipeline stages")
    return "not checked here (they need the training script's objects): " + "; ".join(parts)


def run_config_check(args: argparse.Namespace) -> int:
    """The body of ``shardkit config check`` for already-parsed ``args`` (see :func:`config_check_main`).

    Every ``"auto"`` that ``--auto`` does not fill is listed in one run, each with the flag that
    fills it; errors name the CLI's flags, not ``load_config``'s keywords. A config ``initialize``
    would refuse whatever the script (e.g. fp16 with tensor parallelism at ZeRO stage 0) is
    invalid here too; what only the script's objects decide is named in one line.

    Example:
        >>> run_config_check(build_config_check_parser().parse_args(["ds.json", "--auto", "lr=3e-4"]))
        0
    """
    try:
        config = load_raw(args.config)
        for key, value in args.set:
            _set_dotted(config, key, value)
        # the ignored keys are printed below, not logged as well
        cfg = load_config(config, world_size=args.world_size, strict=not args.lenient, log_ignored=False, **dict(args.auto))
    except UnfilledAutoError as e:
        lines = [f'shardkit config check: error: {len(e.missing)} "auto" value(s) nothing fills; pass them with --auto:']
        for key, names in e.missing:
            lines.append(f"  {key}: " + " or ".join(f"--auto {n}=VALUE" for n in names))
        if e.after is not None:
            lines.append(f"  (reading stopped after them at another error, which may follow from them: {_cli_words(e.after)})")
        print("\n".join(lines), file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"shardkit config check: error: {_cli_words(str(e))}", file=sys.stderr)
        return 1
    refusal, notes = _initialize_refusals(cfg)
    for note in notes:
        print(f"shardkit config check: warning: {note}", file=sys.stderr)
    if refusal is not None:
        print(f"shardkit config check: error: {refusal} (shardkit.initialize refuses this config)", file=sys.stderr)
        return 1
    print(f"{args.config}: valid")
    print(describe(cfg))
    print(_not_checked(cfg))
    if args.params is not None:
        try:
            print(_plan(cfg, args.params))
        except ValueError as e:
            print(f"shardkit config check: error: {e}", file=sys.stderr)
            return 1
    return 0
