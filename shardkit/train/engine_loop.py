"""``shardkit train --config ds.json``: the demo trained through :func:`shardkit.initialize`.

The loop is a DeepSpeed training loop, written as a DeepSpeed user writes it::

    engine, _, _, _ = shardkit.initialize(model=model, model_parameters=groups, config=path, **auto)
    for step in range(steps):                       # optimizer steps
        for micro in range(gradient_accumulation_steps):
            loss = engine(input_ids=x, labels=x).loss   # Hugging Face models (TinyGPT: lm_loss(engine(x), y))
            engine.backward(loss)
            engine.step()                           # steps the optimizer at the boundary only

Everything the config holds decides the run: the ZeRO stage and offload, fp16/bf16 (with the
dynamic loss scaler), the optimizer, the LR schedule, clipping and the batch sizes
(``train_micro_batch_size_per_gpu`` rows per micro-step, ``gradient_accumulation_steps``
micro-steps per step). The ``TrainConfig`` flags only fill the config's ``"auto"`` values
(:func:`auto_values`); ``--min-lr-ratio`` and ``--bucket-mb`` are not used (a printed note
says so).

[Note: one global batch whatever the layout]
Each optimizer step draws one global batch of ``micro × gas × dp`` rows with the same generator
on every rank; dp rank r takes its ``micro × gas`` rows (``get_batch``'s sharding) and feeds them
as ``gas`` micro-batches of ``micro``. Every micro-batch has the same size, so the engine's
average (loss / gas per micro-batch, gradients averaged over dp) is the mean over the global
batch: ``--nproc 2`` with micro 4 and ``--nproc 1`` with micro 8 (or micro 4 and gas 2) train on
the same data and reach the same losses (fp32).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import Heartbeat, ParallelContext
from shardkit.comm.heartbeat import watch_run
from shardkit.data import get_batch, load_corpus
from shardkit.models import TinyGPT, lm_loss
from shardkit.parallel.zero import plan_memory

from .comm_report import bytes_per_link, fmt_links
from .config import TrainConfig
from .fault_injection import parse_fault
from .progress import ProgressBar, fmt_comm, fmt_memory_vs_plan, fmt_rank_summary, fmt_total_throughput
from .run_plot import plot_run

__all__ = ["auto_values", "build_model", "train_from_config"]

# the planner's names of the config's optimizers (shardkit.engine's fused classes)
_PLANNER_OPTIMIZER = {"FusedAdamW": "adamw", "FusedAdam": "adam", "FusedLion": "lion", "FusedLAMB": "lamb"}


def build_model(cfg: TrainConfig, vocab_size: int, *, cp: int | None = None) -> nn.Module:
    """The ``--model``: TinyGPT, or a ``transformers`` GPT-2 / Llama built from config (same size flags).
    ``cp``: the sequence split when a config sets it (default ``cfg.cp``); above 1, Hugging Face
    models get SDPA attention, which the cp plan routes over the shards.

    Example:
        >>> build_model(TrainConfig(d_model=64, n_layers=2), 59).num_parameters() > 0
        True
    """
    if cfg.model == "tinygpt":
        return TinyGPT(vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.dropout)
    from shardkit.hf_models import build_hf_model

    return build_hf_model(
        cfg.model,
        vocab_size=vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        seq_len=cfg.seq_len,
        dropout=cfg.dropout,
        attention="sdpa" if (cfg.cp if cp is None else cp) > 1 else "eager",  # cp routes SDPA calls over the shards
    )


def _parse_value(text: str) -> Any:
    """``--auto`` values as JSON (numbers, true/false, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def auto_values(cfg: TrainConfig) -> dict[str, Any]:
    """What the config's ``"auto"`` values stand for (``shardkit.initialize``'s keywords).

    From the flags: ``lr``, ``weight_decay``, ``warmup_num_steps`` (``--warmup``),
    ``total_num_steps`` (``--steps``), ``gradient_clipping`` (``--clip``),
    ``train_micro_batch_size_per_gpu`` (``--batch-size``) and ``hidden_size`` (``--d-model``, for
    the bucket-size rules); then every ``--auto KEY=VALUE``, which overrides them. A key the
    config holds as a number keeps the config's number (only ``"auto"`` is filled).

    Example:
        >>> auto_values(TrainConfig(lr=1e-3, auto=("gradient_accumulation_steps=2",)))["gradient_accumulation_steps"]
        2
    """
    values: dict[str, Any] = {
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "warmup_num_steps": cfg.warmup,
        "total_num_steps": cfg.steps,
        "gradient_clipping": cfg.clip,
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "hidden_size": cfg.d_model,
    }
    for item in cfg.auto:
        key, _, value = item.partition("=")
        values[key] = _parse_value(value)
    return values


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Trainer-style groups by name: no weight decay on biases and norms (tensors of < 2 dims);
    the decay group keeps the config's ``weight_decay``."""
    decay = [n for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [n for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _loss(engine: nn.Module, hf: bool, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if hf:  # HF's labels= path: it shifts the labels itself (T - 1 predicted tokens per row)
        return engine(input_ids=x, labels=x).loss
    return lm_loss(engine(x), y)


def _plan(model: nn.Module | int, ecfg: Any) -> dict[str, Any]:
    """The planner's bytes per rank for the engine's layout, keyed as the summary (see
    loop.planned_memory). ``model``: the whole model, or with tp/pp the number of parameters
    this rank holds."""
    z, stage = ecfg.zero, ecfg.zero.stage
    opt = ecfg.optimizer
    name = (
        "adamw"
        if opt is None
        else _PLANNER_OPTIMIZER.get(opt.class_name, "sgd_momentum" if opt.params.get("momentum") else "sgd")
    )
    plan = plan_memory(
        model,
        dp=ecfg.dp_size * ecfg.context_parallel.size,  # the dp_cp group: parameters replicated, ZeRO shards over it
        stage=stage,
        precision=ecfg.precision.dtype,
        optimizer=name,
        # as initialize builds them: DataParallel buckets in the gradient dtype, ZeRO's in fp32
        bucket_mb=z.bucket_mb(4 if stage else ecfg.precision.grad_bytes),
        grad_dtype_bytes=4 if stage else None,
        offload=z.offload if stage else None,
        offload_params=z.offload_param.enabled,  # stage 3 with offload (initialize checks)
        reshard_after_forward=z.hpz_partition_size if z.hpz_partition_size > 1 else True,  # hpZ's pieces
    )
    out: dict[str, Any] = {
        "stage": plan.name,
        "param_bytes": plan.params,
        "grad_bytes": plan.grads + (plan.transient if stage == 0 else 0),  # DDP's buckets are gradient storage
        "optim_state_bytes": plan.optimizer_state,  # fp32 masters included, as the engine's report below
        "transient_bytes": plan.transient if stage else None,
    }
    out["total_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_state_bytes"] + (out["transient_bytes"] or 0)
    return out


def train_from_config(cfg: TrainConfig, device: torch.device, t_start: float) -> dict[str, Any]:
    """One rank of ``shardkit train --config``: build the context, train, tear it down.

    Called by :func:`shardkit.train.train` when ``cfg.config`` is set (``device`` resolved there),
    which returns ``TrainResult(**result)`` (this module does not import the loop's module).

    Args:
        cfg: the run configuration (validated).
        device: this rank's device (gloo on CPU, NCCL on CUDA).
        t_start: ``time.perf_counter()`` at the start of the run (for the wall time).

    Returns:
        This rank's :class:`~shardkit.train.TrainResult` fields: ``summary``, ``train_losses``
        (mean micro-batch loss per step), ``evals``, ``lrs`` (per step) and ``ranks`` (every
        rank's summary on rank 0).

    Raises:
        ValueError: a bad config (naming the key), before any collective of the training.
        FloatingPointError: the eval loss became NaN/inf (fp32/bf16).

    Example:
        >>> train(TrainConfig(config="zero2_config_accelerate.json", steps=10))
    """
    from shardkit.engine.model_layout import axis_sizes

    tp, pp, cp = axis_sizes(cfg.config, auto_values(cfg))  # the config's tensor_parallel / pipeline / sequence axes
    ctx = ParallelContext.from_env(
        backend="gloo" if device.type == "cpu" else "nccl", tp=tp, pp=pp, cp=cp, timeout=timedelta(seconds=cfg.timeout)
    )
    with ctx:  # destroyed on exit (the default group too): the ranks meet first unless this one raised
        # a frozen peer is named and ended in seconds, not after --timeout; on a timeout, the
        # rank the others waited for ([Note: heartbeats])
        with watch_run(cfg.heartbeat, world_size=ctx.world_size) as hb:
            return _train(cfg, ctx, device, t_start, hb)


def _train(
    cfg: TrainConfig, ctx: ParallelContext, device: torch.device, t_start: float, hb: Heartbeat | None = None
) -> dict[str, Any]:
    import shardkit
    from shardkit.engine import load_config

    rank, world = ctx.global_rank, ctx.world_size
    dp_rank, dp = ctx.rank("dp"), ctx.size("dp")
    cfg = replace(cfg, nproc=world)
    auto = auto_values(cfg)
    engine_logger = logging.getLogger("shardkit.engine")
    level = engine_logger.level
    engine_logger.setLevel(logging.ERROR)  # initialize logs the ignored keys: once, not twice
    try:
        ecfg = load_config(cfg.config, world_size=world, **auto)  # every config error here, before any collective
    finally:
        engine_logger.setLevel(level)
    micro, gas = ecfg.train_micro_batch_size_per_gpu, ecfg.gradient_accumulation_steps
    corpus = load_corpus()
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg, corpus.tokenizer.vocab_size, cp=ctx.size("cp")).to(device)
    hf = cfg.model != "tinygpt"
    n_params = sum(p.numel() for p in model.parameters())  # a tied weight once
    engine, _, _, _ = shardkit.initialize(model=model, model_parameters=_param_groups(model), config=cfg.config, ctx=ctx, **auto)
    if hb is not None:  # what the heartbeat publishes as this rank's progress
        hb.track(*engine.parallel.comm_stats())
    pipelined = ecfg.pipeline.stages > 1
    if ecfg.tensor_parallel.size * ecfg.pipeline.stages > 1:
        # this rank's part: its TP slices (the model was converted in place), of its stages
        held = {id(p): p for p in (engine.parallel.parameters() if pipelined else model.parameters())}
        plan = _plan(sum(p.numel() for p in held.values()), ecfg)
    else:
        plan = _plan(model, ecfg)
    # Dropout: one stream per data-parallel replica and pipeline stage, the SAME on every tp rank
    # (replicated activations must drop the same elements; tp-sharded regions derive their own
    # per-rank streams from it, parallel/tensor/rng.py).
    torch.manual_seed(cfg.seed + 1 + ctx.rank("dp") + 100_003 * ctx.rank("pp"))

    data_gen = torch.Generator().manual_seed(cfg.seed)  # [Note: one global batch whatever the layout]
    eval_gen = torch.Generator().manual_seed(cfg.seed + 12345)
    global_rows = micro * gas * dp
    # the same fixed validation batches (global-batch rows) on every rank and layout
    eval_batches = [
        get_batch("val", global_rows, cfg.seq_len, eval_gen, corpus=corpus, device=device) for _ in range(cfg.eval_iters)
    ]
    stage, dtype = ecfg.zero.stage, ecfg.precision.dtype
    bar = ProgressBar(cfg.steps, enabled=rank == 0)
    bar.write(
        f"{cfg.model} {n_params / 1e6:.2f}M params | {cfg.config}: ZeRO-{stage}"
        f"{f' tp {ecfg.tensor_parallel.size}' if ecfg.tensor_parallel.size > 1 else ''}"
        f"{f' pp {ecfg.pipeline.stages} ({ecfg.pipeline.schedule})' if pipelined else ''}"
        f"{' offload ' + ecfg.zero.offload if ecfg.zero.offload else ''} {dtype} "
        f"{ecfg.optimizer.type if ecfg.optimizer else '-'} {ecfg.scheduler.type if ecfg.scheduler else 'constant lr'} "
        f"world={world} {device.type} | {cfg.steps} steps x {global_rows} seqs "
        f"(micro {micro} x gas {gas} x dp {dp}) x {cfg.seq_len} tokens"
    )
    bar.write(
        "note: the config's scheduler sets the lr; --lr, --weight-decay, --warmup, --steps, --clip and "
        '--batch-size only fill its "auto" values; --min-lr-ratio and --bucket-mb are not used'
    )
    losses: list[torch.Tensor] = []  # this rank's mean micro-batch loss per step, on device
    lrs: list[float] = []
    scales: list[float | None] = []
    evals: list[tuple[int, float]] = []
    train_time = 0.0
    tokens_per_step = micro * gas * cfg.seq_len
    fault = parse_fault(cfg.inject_fault)
    for step in range(1, cfg.steps + 1):
        if hb is not None:
            hb.note(f"step {step}")
        if fault is not None and fault.due(ctx.global_rank, step):
            fault.fire()
        t0 = time.perf_counter()
        lrs.append(engine.get_lr()[0])
        x_all, y_all = get_batch(
            "train", micro * gas, cfg.seq_len, data_gen, rank=dp_rank, world_size=dp, corpus=corpus, device=device
        )
        step_loss = torch.zeros((), device=device)
        if pipelined:  # one call: the gas micro-batches through the schedule, then the step
            step_loss += engine.train_batch(iter(zip(x_all.split(micro), y_all.split(micro), strict=True))).to(device)
        for k in range(0 if pipelined else gas):
            x, y = x_all[k * micro : (k + 1) * micro], y_all[k * micro : (k + 1) * micro]
            loss = _loss(engine, hf, x, y)
            engine.backward(loss)
            engine.step()  # the optimizer steps at the accumulation boundary only
            step_loss += loss.detach().float() / gas
        losses.append(step_loss)
        scales.append(engine.get_loss_scale())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time += time.perf_counter() - t0
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evals.append((step, _evaluate(engine, hf, eval_batches, gas if pipelined else 0)))
            if not math.isfinite(evals[-1][1]) and dtype != "fp16":
                raise FloatingPointError(f"rank {rank}: eval loss is {evals[-1][1]} at step {step}")
            scale = f" | loss scale {scales[-1]:g}" if scales[-1] is not None else ""
            bar.write(
                f"step {step:>{len(str(cfg.steps))}}: train loss {float(losses[-1]):.4f} | eval loss {evals[-1][1]:.4f}{scale}"
            )
        bar.update(step, loss=losses[-1], tokens_per_s=step * tokens_per_step / train_time, elapsed=train_time)
    bar.close()

    train_losses = torch.stack(losses).tolist()
    tail = train_losses[-min(10, len(train_losses)) :]
    mem = engine.memory_report()
    summary: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "final_train_loss": train_losses[-1],  # this rank's last step
        "mean_train_loss": sum(tail) / len(tail),  # and its mean over the last <= 10 steps
        "tail_steps": len(tail),
        "final_eval_loss": evals[-1][1],
        "tokens_per_s": cfg.steps * tokens_per_step / train_time,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "param_bytes": mem["params"],
        "grad_bytes": mem["grads"],
        "optim_state_bytes": mem["optimizer_state"] + mem["master_params"],
        "transient_bytes": mem["peak_transient"] if stage else None,
        "offloaded": mem.get("offloaded") or {},
        "plan": plan,
        "skipped_steps": engine.skipped_steps,
        "loss_scale": engine.get_loss_scale(),
        "global_steps": engine.global_steps,
        "comm": engine.parallel.report(engine.optimizer).comm,  # as the flag path's summary
        # payload bytes by link when the world spans machines (CommStats.bytes_per_link)
        "comm_links": bytes_per_link(engine.parallel.comm_stats(), world),
    }
    result = {"summary": summary, "train_losses": train_losses, "evals": evals, "lrs": lrs, "ranks": [summary]}
    if world > 1:  # one gather, so rank 0 prints all summaries in rank order
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(summary, gathered, dst=0)
        result["ranks"] = gathered or []
    if rank == 0:
        _print_summary(cfg, ecfg, result["ranks"], n_params)
        if cfg.plot:
            title = f"{cfg.model} {n_params / 1e6:.2f}M params, {cfg.config} (ZeRO-{stage}, {dtype}), {cfg.steps} steps"
            plot_run(cfg.plot, title=title, train_loss=train_losses, evals=evals, ranks=result["ranks"])
            print(f"plot: {cfg.plot}")
        if cfg.log_json:
            log = {
                "config": asdict(cfg),
                "engine": {"stage": stage, "precision": dtype, "micro": micro, "gas": gas, "dp": dp},
                "params": n_params,
                "train_loss": train_losses,
                "lr": lrs,
                "loss_scale": scales,
                "eval": evals,
            }
            with open(cfg.log_json, "w") as f:
                json.dump({**log, "ranks": result["ranks"]}, f, indent=1)
    return result


@torch.no_grad()
def _evaluate(engine: nn.Module, hf: bool, batches: list[tuple[torch.Tensor, torch.Tensor]], pipeline_gas: int = 0) -> float:
    """Mean loss of ``batches``; under a pipeline (``pipeline_gas`` > 0) each through ``eval_batch``
    as ``pipeline_gas`` micro-batches."""
    if pipeline_gas:
        return sum(
            float(engine.eval_batch(iter(zip(x.chunk(pipeline_gas), y.chunk(pipeline_gas), strict=True)))) for x, y in batches
        ) / len(batches)
    engine.eval()
    try:
        return sum(float(_loss(engine, hf, x, y)) for x, y in batches) / len(batches)
    finally:
        engine.train()


def _print_summary(cfg: TrainConfig, ecfg: Any, ranks: list[dict[str, Any]], n_params: int) -> None:
    print(
        f"== summary: {cfg.model} {n_params / 1e6:.2f}M params, {cfg.config} (ZeRO-{ecfg.zero.stage}, "
        f"{ecfg.precision.dtype}), world={len(ranks)}, {cfg.steps} steps =="
    )
    for s in ranks:
        scale = f" | loss scale {s['loss_scale']:g}, {s['skipped_steps']} skipped" if s["loss_scale"] is not None else ""
        print(fmt_rank_summary(s) + scale + f" | comm {fmt_comm(s['comm'])}{fmt_links(s.get('comm_links'))}")
        print(f"       | {fmt_memory_vs_plan(s, s['plan'])}")  # engine.memory_report() vs plan_memory
    if len(ranks) > 1:
        print(fmt_total_throughput(ranks, ecfg.context_parallel.size * ecfg.tensor_parallel.size * ecfg.pipeline.stages))
    sys.stdout.flush()
