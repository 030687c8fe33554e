"""The demo training loop: :class:`~shardkit.models.TinyGPT` on the built-in corpus.

:func:`train` runs one rank of a run: ``shardkit train`` (:mod:`shardkit.cli`) calls it in
process for ``--nproc 1``, or starts N torchrun workers that each call it. Rank 0 draws the
progress bar and prints every rank's summary, gathered in rank order.

Parallelism is entirely behind :func:`~shardkit.parallel.parallelize` (TP -> pipeline split ->
activation checkpointing -> DP on one ParallelContext): the loop reads ``loss =
par.forward_backward(x, y); par.clip(...); par.step(opt)`` whatever the parallelism, with no
branch per strategy.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import Heartbeat, ParallelContext
from shardkit.comm.heartbeat import watch_run
from shardkit.data import get_batch, load_corpus
from shardkit.hf_models import LogitsOnly, hf_tp_plan
from shardkit.kernels import FusedAdamW
from shardkit.models import gpt_blocks
from shardkit.parallel import AsyncCheckpointer, DynamicLossScaler, ParallelModel, parallelize
from shardkit.parallel.context import gpt_cp_plan, hf_gpt2_cp_plan, llama_cp_plan
from shardkit.parallel.strategy import get_strategy_class
from shardkit.parallel.tensor import gpt_plan
from shardkit.parallel.zero import plan_memory

from .comm_report import bytes_per_link, fmt_links
from .config import LAUNCH_WORLD_ENV, Precision, TrainConfig
from .device import resolve_device
from .engine_loop import build_model
from .fault_injection import parse_fault
from .progress import ProgressBar, fmt_bytes, fmt_comm, fmt_memory_vs_plan, fmt_rank_summary, fmt_total_throughput
from .run_checkpoints import RunHistory, resume_run, save_run
from .run_plot import plot_run
from .schedule import lr_at

__all__ = ["TrainResult", "make_loss_scaler", "planned_memory", "train"]

_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class TrainResult:
    """What :func:`train` returns on every rank.

    Attributes:
        summary: this rank's final numbers (losses, throughput, bytes per rank, comm stats).
        train_losses: loss of every step (this rank's micro-batch).
        evals: ``(step, eval loss)`` pairs.
        lrs: learning rate of every step.
        ranks: every rank's summary in rank order on rank 0 (``[]`` on the other ranks).
    """

    summary: dict[str, Any]
    train_losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)


def make_loss_scaler(precision: Precision) -> DynamicLossScaler | None:
    """The loss scaler for ``precision``: a DeepSpeed-style dynamic scaler for fp16, else None.

    bf16 and fp32 need no loss scaling (bf16 has fp32's exponent range). Defaults are
    DeepSpeed's (docs/reference.md, "fp16 dynamic loss scaling").

    Example:
        >>> make_loss_scaler("fp16").scale
        65536.0
    """
    if precision != "fp16":
        return None
    return DynamicLossScaler(initial_scale_power=16, loss_scale_window=1000, hysteresis=2)


def planned_memory(cfg: TrainConfig, model: nn.Module, dp: int) -> dict[str, Any] | None:
    """The memory planner's bytes per rank for this run, keyed as the summary's measured figures.

    The plan (:func:`~shardkit.parallel.zero.plan_memory`, docs/planner.md) is made from the
    unwrapped model's parameter shapes and dtype (the loop keeps fp32 parameters; ``--precision``
    only picks the autocast dtype) with the strategy's own options: DDP is stage 0 (its flat
    buckets count as gradient storage, as its report counts them), ZeRO-N stage N with fp32
    gradients (``ShardedDataParallel``'s default). The optimizer is AdamW (K = 8 for fp32
    params); the plan leaves out its 4-byte ``step`` scalars.

    Args:
        cfg: the run configuration (``strategy``, ``bucket_mb``, ``grad_buckets``).
        model: the model before wrapping (any device; only shapes and dtypes are read).
        dp: data-parallel ranks.

    Returns:
        ``{"stage", "param_bytes", "grad_bytes", "optim_state_bytes", "transient_bytes",
        "total_bytes"}`` (``transient_bytes`` None for DDP), or None for a strategy without a
        ZeRO stage (``"none"``, tensor or pipeline parallelism).

    Example:
        >>> planned_memory(TrainConfig(strategy="zero2"), TinyGPT(59, 32, 1, 2, 32), dp=2)["stage"]
        'ZeRO-2'
    """
    cls = get_strategy_class(cfg.strategy)
    stage = getattr(cls, "stage", 0 if cfg.strategy == "ddp" else None)
    if not isinstance(stage, int) or cfg.model_ranks > 1:
        return None
    opts = cfg.strategy_options()
    offload = None if opts.get("offload", "none") == "none" else opts["offload"]
    plan = plan_memory(
        model,
        dp=dp,
        stage=stage,
        precision=_PRECISION[next(model.parameters()).dtype],
        optimizer="adamw",
        bucket_mb=opts.get("bucket_mb", 25.0),
        gradient_as_bucket_view=opts.get("grad_buckets") == "view",
        grad_dtype_bytes=4 if stage else None,
        offload=offload,
        reshard_after_forward=cfg.hpz if cfg.hpz > 1 else True,  # --hpz's pieces ([Note: hierarchical gathers])
    )
    out: dict[str, Any] = {
        "stage": plan.name,
        "param_bytes": plan.params,
        "grad_bytes": plan.grads + (plan.transient if stage == 0 else 0),
        "optim_state_bytes": plan.optimizer_state,  # master shards included, as the ZeRO report
        "transient_bytes": plan.transient if stage else None,
    }
    out["total_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_state_bytes"] + (out["transient_bytes"] or 0)
    return out


def _autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _evaluate(par: ParallelModel, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return sum(par.evaluate(x, y) for x, y in batches) / len(batches)


def train(cfg: TrainConfig) -> TrainResult:
    """Train the ``--model`` as configured, as one rank of a run (or alone).

    With ``cfg.config`` (a DeepSpeed JSON config) the run goes through ``shardkit.initialize``
    instead (:mod:`shardkit.train.engine_loop`); otherwise through ``parallelize``.

    For a strategy that communicates (``needs_context``, e.g. ``"ddp"``) it builds the
    :class:`~shardkit.comm.ParallelContext` from torchrun's environment (a world of one
    without it) and destroys it, and the default process group if it created it, before
    returning. Rank 0 draws the progress bar, prints
    every rank's summary in rank order and writes ``cfg.log_json``.

    Args:
        cfg: the run configuration.

    Returns:
        This rank's :class:`TrainResult`.

    Raises:
        ValueError: invalid config, or more ranks on this machine than CUDA devices.
        FloatingPointError: the eval loss became NaN/inf (fp32/bf16).

    Example:
        >>> res = train(TrainConfig(steps=20, d_model=64, n_layers=2, eval_every=10))
        >>> res.evals[-1][1] < res.evals[0][1]
        True
    """
    t_start = time.perf_counter()
    # torchrun's contract: LOCAL_RANK picks the GPU among LOCAL_WORLD_SIZE ranks on this machine.
    # Read here, at the application entry only.
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", str(cfg.nproc)))
    cfg.validate(world_size=world)
    asked = int(os.environ.get(LAUNCH_WORLD_ENV, str(world)))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if world < asked and first_attempt and os.environ.get("RANK", "0") == "0":  # [Note: elastic restarts]
        print(
            f"shardkit train: warning: the run started with {world} of the {asked} ranks asked for: --min-nnodes let it "
            "start before every machine joined, and a machine that joins later ends the run; start every machine "
            "within --rdzv-wait seconds of the first",
            flush=True,  # stdout: torchrun keeps a worker's stderr in its log file
        )
    if cfg.global_batch:  # this world's share: after an elastic restart on fewer ranks, a larger one
        cfg = replace(cfg, batch_size=cfg.rank_batch(world))
    device = resolve_device(cfg.device, ranks_per_node=ranks_per_node, local_rank=local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.config is not None:  # a DeepSpeed config: shardkit.initialize's engine loop
        from .engine_loop import train_from_config

        return TrainResult(**train_from_config(cfg, device, t_start))
    if not get_strategy_class(cfg.strategy).needs_context and world == 1:
        return _train(cfg, None, device, t_start)
    # The backend follows the device, not CUDA's presence: --device cpu trains over gloo even on
    # a GPU machine (from_env's default would pick NCCL there and then fail on CPU tensors).
    ctx = ParallelContext.from_env(
        backend="gloo" if device.type == "cpu" else "nccl",
        tp=cfg.tp,
        pp=cfg.pp,
        cp=cfg.cp,
        timeout=timedelta(seconds=cfg.timeout),
    )
    with ctx:  # destroyed on exit (the default group too): the ranks meet first unless this one raised
        # a frozen peer is named and ended in seconds, not after --timeout; on a timeout, the
        # rank the others waited for ([Note: heartbeats])
        with watch_run(cfg.heartbeat, world_size=ctx.world_size) as hb:
            return _train(cfg, ctx, device, t_start, hb)


def _train(
    cfg: TrainConfig, ctx: ParallelContext | None, device: torch.device, t_start: float, hb: Heartbeat | None = None
) -> TrainResult:
    rank, world = (ctx.global_rank, ctx.world_size) if ctx is not None else (0, 1)
    # Data sharding follows the data-parallel axis (equal to the world for pure DDP).
    dp_rank, dp_size = (ctx.rank("dp"), ctx.size("dp")) if ctx is not None else (0, 1)
    cfg = replace(cfg, nproc=world)
    corpus = load_corpus()

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    vocab = corpus.tokenizer.vocab_size
    model = build_model(cfg, vocab).to(device)
    n_params = sum(p.numel() for p in model.parameters())  # a tied weight once
    if cfg.model != "tinygpt":  # tokens -> logits, as parallelize's loss expects
        model = LogitsOnly(model)
    plan = planned_memory(cfg, model, dp_size)  # before wrapping: the user's model, as planned
    # [Note: the order of parallelize] in shardkit.parallel.compose: TP -> pipeline -> checkpointing -> DP
    par = parallelize(
        model,
        ctx,
        dp=cfg.strategy,
        tp_plan=(gpt_plan(sequence_parallel=cfg.sequence_parallel) if cfg.model == "tinygpt" else hf_tp_plan(cfg.model, model))
        if cfg.tp > 1
        else None,
        pp={"schedule": cfg.schedule, "microbatches": cfg.microbatches, "virtual_stages": cfg.virtual_stages}
        if cfg.pp > 1
        else None,
        blocks=gpt_blocks if cfg.model == "tinygpt" else None,
        checkpointing={"none": False, "blocks": True, "cpu": "cpu"}[cfg.checkpointing],
        loss_scaler=make_loss_scaler(cfg.precision),
        autocast=None if cfg.pp > 1 else (lambda: _autocast(cfg.precision, device)),
        # --hpz: ZeRO-3's backward gathers inside blocks of dp ranks ([Note: hierarchical gathers])
        dp_options=cfg.strategy_options() | ({"reshard_after_forward": cfg.hpz} if cfg.hpz > 1 else {}),
        fused_cross_entropy=cfg.fused_ce,
        cp={"plan": _cp_plan(cfg, model), "mode": cfg.cp_mode, "ulysses_size": cfg.cp_ulysses or None} if cfg.cp > 1 else None,
    )
    if hb is not None:  # what the heartbeat publishes as this rank's progress
        hb.track(*par.comm_stats())
    # Dropout: one stream per data-parallel replica and pipeline stage, the SAME on every tp rank
    # (replicated activations must drop the same elements; tp-sharded regions derive their own
    # per-rank streams from it, parallel/tensor/rng.py).
    pp_rank = ctx.rank("pp") if ctx is not None else 0
    dropout_seed = cfg.seed + 1 + dp_rank + 100_003 * pp_rank
    torch.manual_seed(dropout_seed)
    decay = [p for p in par.parameters() if p.dim() >= 2]  # no decay on biases / LayerNorm
    no_decay = [p for p in par.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = par.make_optimizer(FusedAdamW, groups, lr=cfg.lr, betas=(0.9, 0.95))  # ZeRO: on the shard

    data_gen = torch.Generator().manual_seed(cfg.seed)  # same stream on every rank: see data.py
    # Every rank evaluates the same fixed validation batches of global-batch size: eval losses
    # are comparable between runs of equal global batch whatever the strategy, and equal
    # across ranks exactly when the replicas are in sync.
    eval_gen = torch.Generator().manual_seed(cfg.seed + 12345)
    eval_rows = cfg.batch_size * dp_size
    eval_batches = [
        get_batch("val", eval_rows, cfg.seq_len, eval_gen, corpus=corpus, device=device) for _ in range(cfg.eval_iters)
    ]

    history = RunHistory()
    if cfg.resume == "auto":  # [Note: resuming a training run] in shardkit/train/run_checkpoints.py
        assert cfg.ckpt_dir is not None  # TrainConfig.validate
        resumed = resume_run(
            cfg.ckpt_dir,
            par,
            optimizer,
            data_generator=data_gen,
            device=device,
            reseed=dropout_seed * 1_000_003,
            global_batch=cfg.batch_size * dp_size,
        )
        history = resumed or history
        if resumed is None and rank == 0:
            print(f"no checkpoint in {cfg.ckpt_dir}: starting at step 0", flush=True)
    start = history.step

    bar = ProgressBar(cfg.steps, enabled=rank == 0, start=start)
    options = "".join(
        f" {name}={value}" for name, value in (("checkpointing", cfg.checkpointing), ("offload", cfg.offload)) if value != "none"
    )
    scaler = par.loss_scaler
    scale = f" (dynamic loss scale from {scaler.scale:g})" if scaler is not None else ""
    bar.write(
        f"{cfg.model} {n_params / 1e6:.2f}M params | strategy={cfg.strategy}{_layout(cfg, dp_size)}{options} world={world} "
        f"{cfg.precision}{scale} {device.type} | {cfg.steps} steps x {cfg.batch_size * dp_size} seqs x {cfg.seq_len} tokens"
    )
    losses: list[torch.Tensor] = []  # this attempt's losses, kept on device (no sync); earlier ones in history
    lrs, evals = history.lrs, history.evals
    train_time = 0.0
    tokens_per_step = cfg.batch_size * cfg.seq_len
    save_every = cfg.save_every or cfg.steps
    fault = parse_fault(cfg.inject_fault)
    note = hb.note if hb is not None else (lambda what: None)
    saver = AsyncCheckpointer() if cfg.async_save else None
    save_time = 0.0  # seconds the step loop spent in saves (with --async-save: copying, waiting)
    for step in range(start + 1, cfg.steps + 1):
        note(f"step {step}")  # what a heartbeat verdict about this rank says it was doing
        if fault is not None and fault.due(rank, step):
            fault.fire()
        t0 = time.perf_counter()
        lr = lr_at(step - 1, lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps, min_ratio=cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(
            "train",
            cfg.batch_size,
            cfg.seq_len,
            data_gen,
            rank=dp_rank,
            world_size=dp_size,
            corpus=corpus,
            device=device,
        )
        optimizer.zero_grad(set_to_none=True)
        loss = par.forward_backward(x, y)  # autocast, loss scaling, micro-batches, dp reduction
        par.clip(cfg.clip if cfg.clip > 0 else None)
        par.step(optimizer)
        losses.append(loss.detach())
        lrs.append(lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time += time.perf_counter() - t0
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evals.append((step, _evaluate(par, eval_batches)))
            if not math.isfinite(evals[-1][1]) and cfg.precision != "fp16":
                raise FloatingPointError(f"rank {rank}: eval loss is {evals[-1][1]} at step {step}")
            width = len(str(cfg.steps))
            now = f" | loss scale {scaler.scale:g}, {par.skipped_steps} skipped" if scaler is not None else ""
            bar.write(f"step {step:>{width}}: train loss {float(losses[-1]):.4f} | eval loss {evals[-1][1]:.4f}{now}")
        if cfg.ckpt_dir is not None and (step % save_every == 0 or step == cfg.steps):
            history.train_loss += [float(v) for v in losses[len(history.train_loss) - start :]]
            history.step, history.skipped_steps = step, par.skipped_steps
            note(f"step {step}: saving a checkpoint")
            t_save = time.perf_counter()
            path = save_run(
                cfg.ckpt_dir,
                par,
                optimizer,
                history,
                data_generator=data_gen,
                device=device,
                keep=cfg.keep,
                saver=saver,
                global_batch=cfg.batch_size * dp_size,
            )
            save_time += time.perf_counter() - t_save
            how = "saving in the background:" if saver is not None else "saved"
            bar.write(f"step {step:>{len(str(cfg.steps))}}: {how} {path} ({time.perf_counter() - t_save:.1f} s)")
        bar.update(step, loss=losses[-1], tokens_per_s=(step - start) * tokens_per_step / train_time, elapsed=train_time)
    bar.close()
    if saver is not None:  # the last checkpoint is complete before the run reports success
        t_save = time.perf_counter()
        saver.close()
        save_time += time.perf_counter() - t_save
    if not evals:  # resumed at the last step: nothing left to train, evaluate the loaded model once
        evals.append((cfg.steps, _evaluate(par, eval_batches)))

    train_losses = history.train_loss[:start] + [float(v) for v in losses]
    tail = train_losses[-min(10, len(train_losses)) :]
    report = par.report(optimizer)
    summary: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "final_train_loss": train_losses[-1],  # this rank's last step
        "mean_train_loss": sum(tail) / len(tail),  # and its mean over the last <= 10 steps
        "tail_steps": len(tail),
        "final_eval_loss": evals[-1][1],
        # this rank's tokens over train time only, of this attempt (a resumed run: since the resume)
        "tokens_per_s": (cfg.steps - start) * tokens_per_step / train_time if train_time > 0 else 0.0,
        "resumed_from_step": start if history.resumed_from is not None else None,
        "train_time_s": train_time,
        "save_time_s": save_time,  # outside train_time: the loop's time in checkpoint saves
        "wall_time_s": time.perf_counter() - t_start,
        "param_bytes": report.memory["params"],
        # the last step's grads plus any flat gradient buckets, shared storage counted once
        "grad_bytes": report.memory["grads"],
        "optim_state_bytes": report.memory["optimizer_state"],
        # the ZeRO strategies' peak of transient buffers (buckets in flight, all-gather inputs)
        "transient_bytes": report.memory.get("peak_transient"),
        "offloaded_bytes": report.memory.get("offloaded"),  # --offload: masters + optimizer state off the device
        "plan": plan,  # the planner's figures for the same config, or None
        "skipped_steps": report.skipped_steps,
        "loss_scale": report.loss_scale,
        "comm": report.comm,
        # payload bytes by link when the world spans machines (CommStats.bytes_per_link)
        "comm_links": bytes_per_link(par.comm_stats(), world),
    }
    result = TrainResult(summary, train_losses, evals, lrs, ranks=[summary])
    if rank == 0 and cfg.sample > 0 and cfg.model_ranks == 1:  # TP/PP hold parts of the model
        model = par.module
        prompt = corpus.tokenizer.encode("\n").view(1, 1).to(device)
        gen = torch.Generator(device).manual_seed(cfg.seed)
        out = getattr(model, "module", model).generate(prompt, cfg.sample, temperature=0.8, generator=gen)
        print("sample:\n" + corpus.tokenizer.decode(out[0, 1:]).rstrip(), flush=True)
    if world > 1:  # one gather, so rank 0 prints all summaries in rank order, uninterleaved
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(summary, gathered, dst=0)
        result.ranks = gathered or []
    if rank == 0:
        _print_summary(cfg, result.ranks, n_params)
        if cfg.plot:
            title = f"{cfg.model} {n_params / 1e6:.2f}M params, strategy={cfg.strategy}{_layout(cfg, dp_size)}, {cfg.steps} steps"
            plot_run(cfg.plot, title=title, train_loss=train_losses, evals=evals, ranks=result.ranks)
            print(f"plot: {cfg.plot}")
        if cfg.log_json:
            log = {"config": asdict(cfg), "params": n_params, "train_loss": train_losses, "lr": lrs, "eval": evals}
            with open(cfg.log_json, "w") as f:
                json.dump({**log, "ranks": result.ranks}, f, indent=1)
    return result


def _cp_plan(cfg: TrainConfig, model: nn.Module) -> dict[str, str]:
    """The cp plan of ``--model`` (an HF model is wrapped in LogitsOnly: its paths under ``hf.``)."""
    if cfg.model == "tinygpt":
        return gpt_cp_plan()
    plan = hf_gpt2_cp_plan() if cfg.model == "hf:gpt2" else llama_cp_plan()
    return {f"hf.{k}": v for k, v in plan.items()}


def _layout(cfg: TrainConfig, dp: int) -> str:
    """`` dp=2 x tp=2 x pp=2 (1f1b, m=4)`` when tensor, context or pipeline parallelism is on, else ``""``."""
    if cfg.model_ranks == 1:
        return ""
    pipe = f" ({cfg.schedule}, m={cfg.microbatches})" if cfg.pp > 1 else ""
    mode = f"{cfg.cp_mode} {cfg.cp_ulysses}x{cfg.cp // max(cfg.cp_ulysses, 1)}" if cfg.cp_mode == "hybrid" else cfg.cp_mode
    cp = f" x cp={cfg.cp} ({mode})" if cfg.cp > 1 else ""
    return f" dp={dp}{cp} x tp={cfg.tp} x pp={cfg.pp}{pipe}"


def _print_summary(cfg: TrainConfig, ranks: list[dict[str, Any]], n_params: int) -> None:
    print(
        f"== summary: {cfg.model} {n_params / 1e6:.2f}M params, strategy={cfg.strategy}{_layout(cfg, len(ranks) // cfg.model_ranks)}, world={len(ranks)}, "
        f"{cfg.precision}, {cfg.steps} steps =="
    )
    for s in ranks:
        print(
            fmt_rank_summary(s)
            + (f" (+ {fmt_bytes(s['offloaded_bytes'])} offloaded)" if s.get("offloaded_bytes") else "")
            + (f" | loss scale {s['loss_scale']:g}, {s['skipped_steps']} skipped" if s["loss_scale"] is not None else "")
            + f" | comm {fmt_comm(s['comm'])}{fmt_links(s.get('comm_links'))}"
        )
        if s.get("plan"):
            print(f"       | {fmt_memory_vs_plan(s, s['plan'])}")
    if len(ranks) > 1:
        print(fmt_total_throughput(ranks, cfg.model_ranks))
    sys.stdout.flush()
