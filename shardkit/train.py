"""Demo trainer: :class:`~shardkit.models.TinyGPT` on the built-in corpus, one process or DDP.

:func:`train` runs one rank of a run: ``shardkit train`` (:mod:`shardkit.cli`) calls it in
process for ``--nproc 1``, or starts N torchrun workers that each call it. Rank 0 draws the
progress bar and prints every rank's summary, gathered in rank order.

The strategy-specific parts are :func:`wrap_model`, :func:`make_loss_scaler` and
:func:`backward_and_step`; everything else is strategy-agnostic.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, TextIO

import torch
import torch.distributed as dist
from torch import nn

from shardkit.data import get_batch, load_corpus
from shardkit.kernels import FusedAdamW
from shardkit.models import TinyGPT, lm_loss

__all__ = [
    "TrainConfig", "TrainResult", "ProgressBar", "lr_at", "wrap_model", "make_loss_scaler",
    "backward_and_step", "train",
]  # fmt: skip

Strategy = Literal["none", "ddp"]
Precision = Literal["fp32", "bf16", "fp16"]


@dataclass
class TrainConfig:
    """Everything one training run needs; one field per ``shardkit train`` flag.

    ``batch_size`` is per rank: a DDP step consumes ``batch_size * nproc`` sequences.

    Example:
        >>> result = train(TrainConfig(steps=20, d_model=64, n_layers=2))
        >>> result.summary["final_eval_loss"] < 3.5
        True
    """

    nproc: int = 1
    strategy: Strategy = "none"
    bucket_mb: float = 25.0
    grad_buckets: Literal["copy", "view"] = "copy"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    precision: Precision = "fp32"
    seed: int = 0
    eval_every: int = 50
    eval_iters: int = 8
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    sample: int = 0
    log_json: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        for name in ("nproc", "steps", "batch_size", "seq_len", "eval_every", "eval_iters", "bucket_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("lr", "warmup", "weight_decay", "clip", "dropout", "sample"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_buckets not in ("copy", "view"):
            raise ValueError(f"grad_buckets must be 'copy' or 'view', got {self.grad_buckets!r}")
        if self.strategy not in ("none", "ddp"):
            raise ValueError(f"strategy must be 'none' or 'ddp', got {self.strategy!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.nproc > 1 and self.strategy == "none":
            raise ValueError(f"nproc={self.nproc} needs a parallel strategy: pass --strategy ddp")


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


# ---- schedule -----------------------------------------------------------------------------------
def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate for 0-based ``step``: linear warmup to ``lr``, then cosine to ``lr * min_ratio``.

    Example:
        >>> [round(lr_at(s, lr=1.0, warmup=2, total=6, min_ratio=0.0), 3) for s in range(6)]
        [0.5, 1.0, 1.0, 0.75, 0.25, 0.0]
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    decay_steps = total - warmup - 1
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup) / decay_steps)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ---- strategy hooks (the lead plugs DataParallel / DynamicLossScaler in here) -------------------
def wrap_model(
    model: nn.Module,
    strategy: Strategy,
    ctx: Any | None,
    *,
    bucket_mb: float = 25.0,
    grad_buckets: Literal["copy", "view"] = "copy",
) -> nn.Module:
    """Wrap the freshly built, identically seeded model for ``strategy``.

    Args:
        model: the model, already on its device.
        strategy: ``"none"`` (returned as is) or ``"ddp"``.
        ctx: the ``shardkit.comm.ParallelContext`` (None for ``"none"``).

    Returns:
        The module to train. It may expose ``.comm_stats`` (a CommStats with ``.summary()``),
        which the run summary reports, and ``.module`` (the unwrapped model).

    Example:
        >>> model = wrap_model(TinyGPT(59), "none", None)
    """
    if strategy == "none":
        return model
    if strategy == "ddp":
        from shardkit.parallel import DataParallel  # lazy: only the ddp branch needs parallel/

        return DataParallel(model, ctx, bucket_mb=bucket_mb, gradient_as_bucket_view=grad_buckets == "view")
    raise ValueError(f"unknown strategy {strategy!r}")


def make_loss_scaler(precision: Precision, device: torch.device) -> Any | None:
    """The loss scaler for ``precision``: a DeepSpeed-style dynamic scaler for fp16, else None.

    bf16 and fp32 need no loss scaling (bf16 has fp32's exponent range).

    Example:
        >>> make_loss_scaler("fp16", torch.device("cpu")).scale
        65536.0
    """
    if precision != "fp16":
        return None
    from shardkit.parallel import DynamicLossScaler

    return DynamicLossScaler(initial_scale_power=16, loss_scale_window=1000, hysteresis=2)


def backward_and_step(
    loss: torch.Tensor,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    clip: float,
    scaler: Any | None = None,
    ctx: Any | None = None,
) -> torch.Tensor | None:
    """Backward, (DDP gradient sync), optional global-norm clipping, optimizer step.

    Gradients are left in place (the loop zeroes them before the next forward), so they can be
    inspected or measured after the step.

    Args:
        loss: the 0-d fp32 loss of this rank's micro-batch.
        model: the (possibly wrapped) model; its ``parameters()`` are clipped.
        optimizer: the optimizer.
        clip: max global grad norm; 0 disables clipping.
        scaler: loss scaler from :func:`make_loss_scaler` (fp16 only).
        ctx: the ``ParallelContext`` (None without a strategy), for steps that communicate
            themselves, e.g. agreeing on an fp16 overflow over ``ctx.group("dp")``.

    Returns:
        The pre-clip global grad norm (0-d tensor) when clipping, else None.

    Example:
        >>> opt.zero_grad(set_to_none=True)
        >>> loss = lm_loss(model(x), y)
        >>> backward_and_step(loss, model, opt, clip=1.0)
    """
    from shardkit.parallel import clip_grad_norm_

    grad_norm = None
    if scaler is None:
        loss.backward()
        # DataParallel's hooks have averaged p.grad over dp when backward() returns; a strategy
        # that reduces later (e.g. a sharded optimizer) finishes its reduction here.
        if clip > 0:
            grad_norm = clip_grad_norm_(model.parameters(), clip)  # fused: 2 launches, no sync
        optimizer.step()
    else:
        # fp16: unscale + inf/nan check + norm in one fused pass, the overflow agreed over dp (with
        # DDP an inf already reaches every rank through the all-reduce; agreeing costs 4 bytes).
        scaler.scale_loss(loss).backward()
        report = scaler.unscale_(
            list(model.named_parameters()), group=ctx.group("dp") if ctx is not None else None,
            max_norm=clip if clip > 0 else None,
        )  # fmt: skip
        if not report.overflow:
            optimizer.step()
        scaler.update(report.overflow)
        grad_norm = torch.tensor(report.grad_norm)
    return grad_norm


# ---- progress bar ---------------------------------------------------------------------------------
def _fmt_time(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds // 60 % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GB"


class ProgressBar:
    """One-line ``\\r`` progress bar (step, loss, tokens/s, ETA); plain periodic lines off a TTY.

    Args:
        total: number of steps.
        stream: where to write (default ``sys.stdout``).
        enabled: False makes every method a no-op (non-zero ranks).
        min_interval: seconds between redraws on a TTY.
        every: steps between lines when ``stream`` is not a TTY (default ``total // 10``).

    Example:
        >>> bar = ProgressBar(100)
        >>> for step in range(1, 101):
        ...     bar.update(step, loss=2.0, tokens_per_s=1e4, elapsed=step * 0.1)
        >>> bar.close()
    """

    def __init__(
        self, total: int, *, stream: TextIO | None = None, enabled: bool = True,
        min_interval: float = 0.1, every: int | None = None,
    ) -> None:  # fmt: skip
        self.total, self.enabled, self.min_interval = total, enabled, min_interval
        self.stream = stream or sys.stdout
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every or max(1, total // 10)
        self._last_draw = -math.inf
        self._width = 0  # length of the bar line on screen, to blank it

    def update(self, step: int, *, loss: float | torch.Tensor, tokens_per_s: float, elapsed: float) -> None:
        """Report that ``step`` (1-based) finished; ``elapsed`` = training seconds so far.

        A tensor ``loss`` is read (a device sync) only when a line is actually drawn.
        """
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw < self.min_interval and step != self.total:
                return
        elif step % self.every and step not in (1, self.total):
            return
        self._last_draw = now
        eta = elapsed / step * (self.total - step)
        stats = f"loss {float(loss):.3f} | {tokens_per_s / 1e3:.1f}k tok/s | {_fmt_time(elapsed)} < {_fmt_time(eta)}"
        width = len(str(self.total))
        if not self.tty:
            print(f"step {step:>{width}}/{self.total} | {stats}", file=self.stream, flush=True)
            return
        filled = round(24 * step / self.total)
        line = f"step {step:>{width}}/{self.total} [{'#' * filled}{'.' * (24 - filled)}] {stats}"
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def write(self, line: str) -> None:
        """Print a persistent line (e.g. an eval result) without garbling the bar."""
        if not self.enabled:
            return
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width, self._last_draw = 0, -math.inf  # redraw on the next update
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar line."""
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


# ---- training --------------------------------------------------------------------------------------
def _tensor_bytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view into a bucket counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _select_device(choice: str, local_rank: int) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


@torch.no_grad()
def _evaluate(
    model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], precision: Precision, device: torch.device
) -> float:
    model.eval()
    with _autocast(precision, device):
        losses = [lm_loss(model(x), y) for x, y in batches]
    model.train()
    return float(torch.stack(losses).mean())


def train(cfg: TrainConfig) -> TrainResult:
    """Train TinyGPT as configured, as one rank of a run (or alone).

    With ``strategy="ddp"`` it builds the :class:`~shardkit.comm.ParallelContext` from
    torchrun's environment (a world of one without it) and destroys it, and the default
    process group if it created it, before returning. Rank 0 draws the progress bar, prints
    every rank's summary in rank order and writes ``cfg.log_json``.

    Args:
        cfg: the run configuration.

    Returns:
        This rank's :class:`TrainResult`.

    Raises:
        ValueError: invalid config.
        FloatingPointError: the eval loss became NaN/inf (fp32/bf16).

    Example:
        >>> res = train(TrainConfig(steps=20, d_model=64, n_layers=2, eval_every=10))
        >>> res.evals[-1][1] < res.evals[0][1]
        True
    """
    cfg.validate()
    t_start = time.perf_counter()
    # torchrun's contract: LOCAL_RANK picks the GPU. Read here, at the application entry only.
    device = _select_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
    if cfg.strategy == "none":
        return _train(cfg, None, device, t_start)
    from shardkit.comm import ParallelContext  # lazy: only the ddp branch needs comm/

    owns_world = not dist.is_initialized()
    # gloo for CPU training even where CUDA exists (from_env would pick nccl there)
    ctx = ParallelContext.from_env(backend="gloo" if device.type == "cpu" else None)
    try:
        return _train(cfg, ctx, device, t_start)
    finally:
        ctx.destroy()
        if owns_world:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, ctx: Any | None, device: torch.device, t_start: float) -> TrainResult:
    rank, world = (dist.get_rank(), dist.get_world_size()) if ctx is not None else (0, 1)
    # Data sharding follows the data-parallel axis (equal to the world for pure DDP).
    dp_rank, dp_size = (ctx.rank("dp"), ctx.size("dp")) if ctx is not None else (0, 1)
    cfg = replace(cfg, nproc=world)
    corpus = load_corpus()

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    vocab = corpus.tokenizer.vocab_size
    model = TinyGPT(vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.dropout).to(device)
    n_params = model.num_parameters()
    model = wrap_model(model, cfg.strategy, ctx, bucket_mb=cfg.bucket_mb, grad_buckets=cfg.grad_buckets)
    torch.manual_seed(cfg.seed + 1 + rank)  # independent dropout streams per rank
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no decay on biases / LayerNorm
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = FusedAdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    scaler = make_loss_scaler(cfg.precision, device)

    data_gen = torch.Generator().manual_seed(cfg.seed)  # same stream on every rank: see data.py
    # Every rank evaluates the same fixed validation batches of global-batch size: eval losses
    # are comparable between runs of equal global batch whatever the strategy, and equal
    # across ranks exactly when the replicas are in sync.
    eval_gen = torch.Generator().manual_seed(cfg.seed + 12345)
    eval_rows = cfg.batch_size * dp_size
    eval_batches = [
        get_batch("val", eval_rows, cfg.seq_len, eval_gen, corpus=corpus, device=device) for _ in range(cfg.eval_iters)
    ]

    bar = ProgressBar(cfg.steps, enabled=rank == 0)
    bar.write(
        f"TinyGPT {n_params / 1e6:.2f}M params | strategy={cfg.strategy} world={world} {cfg.precision} "
        f"{device.type} | {cfg.steps} steps x {cfg.batch_size * dp_size} seqs x {cfg.seq_len} tokens"
    )
    losses: list[torch.Tensor] = []  # this rank's micro-batch losses, kept on device (no sync)
    lrs: list[float] = []
    evals: list[tuple[int, float]] = []
    train_time = 0.0
    tokens_per_step = cfg.batch_size * cfg.seq_len
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step - 1, lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps, min_ratio=cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(
            "train", cfg.batch_size, cfg.seq_len, data_gen,
            rank=dp_rank, world_size=dp_size, corpus=corpus, device=device,
        )  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        with _autocast(cfg.precision, device):
            loss = lm_loss(model(x), y)
        backward_and_step(loss, model, optimizer, clip=cfg.clip, scaler=scaler, ctx=ctx)
        losses.append(loss.detach())
        lrs.append(lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time += time.perf_counter() - t0
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evals.append((step, _evaluate(model, eval_batches, cfg.precision, device)))
            if not math.isfinite(evals[-1][1]) and cfg.precision != "fp16":
                raise FloatingPointError(f"rank {rank}: eval loss is {evals[-1][1]} at step {step}")
            width = len(str(cfg.steps))
            bar.write(f"step {step:>{width}}: train loss {float(losses[-1]):.4f} | eval loss {evals[-1][1]:.4f}")
        bar.update(step, loss=losses[-1], tokens_per_s=step * tokens_per_step / train_time, elapsed=train_time)
    bar.close()

    train_losses = torch.stack(losses).float().tolist()
    tail = train_losses[-min(10, len(train_losses)) :]
    comm_stats = getattr(model, "comm_stats", None)
    summary: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "final_train_loss": sum(tail) / len(tail),  # this rank's mean over the last <= 10 steps
        "final_eval_loss": evals[-1][1],
        "tokens_per_s": cfg.steps * tokens_per_step / train_time,  # this rank's tokens, train time only
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "param_bytes": _tensor_bytes(model.parameters()),
        # the last step's grads plus any flat gradient buckets (DataParallel), shared storage once
        "grad_bytes": _storage_bytes(
            [p.grad for p in model.parameters()] + [b.buffer for b in getattr(model, "buckets", [])]
        ),
        "optim_state_bytes": _tensor_bytes(v for s in optimizer.state.values() for v in s.values()),
        "comm": comm_stats.summary() if comm_stats is not None else None,
    }
    result = TrainResult(summary, train_losses, evals, lrs, ranks=[summary])
    if rank == 0 and cfg.sample > 0:
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
        if cfg.log_json:
            log = {"config": asdict(cfg), "params": n_params, "train_loss": train_losses, "lr": lrs, "eval": evals}
            with open(cfg.log_json, "w") as f:
                json.dump({**log, "ranks": result.ranks}, f, indent=1)
    return result


def _fmt_comm(comm: dict[str, Any] | None) -> str:
    if not comm:
        return "-"
    parts = []
    for op, v in comm.items():  # CommStats.summary(): {op: {"calls", "bytes", "groups"}}
        if isinstance(v, dict) and "bytes" in v:
            calls = v.get("calls", "?")
            parts.append(f"{op} {_fmt_bytes(v['bytes'])} in {calls} call{'' if calls == 1 else 's'}")
        else:
            parts.append(f"{op}={v}")
    return ", ".join(parts)


def _print_summary(cfg: TrainConfig, ranks: list[dict[str, Any]], n_params: int) -> None:
    print(
        f"== summary: TinyGPT {n_params / 1e6:.2f}M params, strategy={cfg.strategy}, world={len(ranks)}, "
        f"{cfg.precision}, {cfg.steps} steps =="
    )
    for s in ranks:
        print(
            f"rank {s['rank']} | train loss {s['final_train_loss']:.4f} | eval loss {s['final_eval_loss']:.4f} | "
            f"{s['tokens_per_s'] / 1e3:.1f}k tok/s | wall {s['wall_time_s']:.1f} s | "
            f"params {_fmt_bytes(s['param_bytes'])} | grads {_fmt_bytes(s['grad_bytes'])} | "
            f"optim state {_fmt_bytes(s['optim_state_bytes'])} | comm {_fmt_comm(s['comm'])}"
        )
    if len(ranks) > 1:
        print(f"total  | {sum(s['tokens_per_s'] for s in ranks) / 1e3:.1f}k tok/s over {len(ranks)} ranks")
    sys.stdout.flush()


if __name__ == "__main__":  # `python -m shardkit.train [flags]` = `shardkit train [flags]`
    from shardkit.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
