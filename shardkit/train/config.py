"""The ``shardkit train`` configuration: one dataclass, from which the CLI flags are derived.

Each field's ``metadata`` carries its help text, its argument group and (optionally) its metavar;
its type annotation gives the flag's type and, for a ``Literal``, its choices. So a new option is
one field here: :func:`add_arguments` and :func:`to_argv` pick it up, and ``validate`` checks it.

This module imports neither torch nor the rest of shardkit.

[Note: elastic restarts]
``--nnodes N --min-nnodes M`` starts torchrun as ``--nnodes M:N`` with c10d's rendezvous. When a
machine is lost, the others' collectives fail, their agents restart the workers and meet again;
the lost agent stops answering the rendezvous keep-alive and is dropped, and once M machines are
there the agents wait ``--rdzv-wait`` seconds (c10d's ``last_call_timeout``) for more before the
smaller world starts. ``--global-batch`` keeps the batch per step in that world, ``--resume
auto`` continues from the newest checkpoint. What torchrun (torch 2.13) does not do: outlive the
machine named by ``--rdzv-endpoint`` (its agent hosts the rendezvous store; ``launch`` says so
when torchrun reports ``RendezvousConnectionError``), or add a machine to a world that has started:
one that joins later ends the run. So every machine must start within ``--rdzv-wait`` of the
first; a worker that starts with fewer ranks than ``--nproc × --nnodes`` (the launcher passes that
count in :data:`LAUNCH_WORLD_ENV`) warns on stdout, on the first attempt, that the world started
short.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from shardkit.examples import EXAMPLE_CONFIGS
from shardkit.parallel.strategy_names import DP_STRATEGIES, DpStrategy

__all__ = ["LAUNCH_WORLD_ENV", "STRATEGIES", "TrainConfig", "add_arguments", "from_args", "to_argv"]

#: the environment variable in which ``shardkit train``'s launcher tells its workers the world it
#: asked for (``--nproc × --nnodes``): [Note: elastic restarts]
LAUNCH_WORLD_ENV = "SHARDKIT_LAUNCH_WORLD"

#: strategy names ``--strategy`` accepts (the torch-free list in :mod:`shardkit.parallel.strategy_names`)
STRATEGIES = DP_STRATEGIES
Precision = Literal["fp32", "bf16", "fp16"]

_LAUNCH, _MODEL, _OPTIM, _LOG = "launch", "model", "optimization (FusedAdamW)", "evaluation and logging"
_CKPT = "checkpoints, restarts and timeouts (docs/operations.md)"
_PARALLEL = "tensor, context and pipeline parallelism (composed with --strategy on the dp axis)"
_CONFIG = "DeepSpeed-style config (shardkit.initialize; docs/engine.md)"
Model = Literal["tinygpt", "hf:gpt2", "hf:llama"]

#: flags a DeepSpeed config decides itself (its zero_optimization, fp16/bf16 and batch keys):
#: with --config, any other value than the default is a usage error naming the flag
CONFIG_EXCLUSIVE = {
    "strategy": "none",
    "offload": "none",
    "nvme_dir": None,
    "precision": "fp32",
    "tp": 1,
    "pp": 1,
    "cp": 1,
    "checkpointing": "none",
    "grad_buckets": "copy",
    "fused_ce": False,  # the config's fused_cross_entropy section decides it
}


#: ``--batch-size``'s default (a run that sets ``--global-batch`` leaves it)
_DEFAULT_BATCH = 16
#: ``--rdzv-wait``'s default: torchrun's own ``last_call_timeout``
_DEFAULT_RDZV_WAIT = 30


def _opt(default: Any, help: str, group: str, *, metavar: str | None = None, **extra: Any) -> Any:
    """A dataclass field whose metadata describes its command-line flag."""
    return field(default=default, metadata={"help": help, "group": group, "metavar": metavar, **extra})


@dataclass
class TrainConfig:
    """Everything one training run needs; one field per ``shardkit train`` flag.

    ``batch_size`` is per rank: a data-parallel step consumes ``batch_size * nproc`` sequences.
    Fields whose metadata lists ``strategies`` are options of those strategies only
    (:meth:`strategy_options`).

    Example:
        >>> cfg = TrainConfig(steps=20, d_model=64, n_layers=2)
        >>> cfg.validate()
    """

    nproc: int = _opt(1, "worker processes; > 1 re-launches with torchrun", _LAUNCH, metavar="N")
    nnodes: int = _opt(
        1,
        "machines; run the same command on each (with --rdzv-endpoint): nproc ranks per machine, tp inside a "
        "machine, dp and pp across (docs/operations.md)",
        _LAUNCH,
        metavar="N",
    )
    rdzv_endpoint: str | None = _opt(
        None, "with --nnodes > 1: HOST:PORT of the first machine, where the ranks meet (torchrun's c10d rendezvous)", _LAUNCH
    )
    min_nnodes: int = _opt(
        0,
        "elastic: with --nnodes N and --max-restarts, the run goes on with as few as M machines when one is lost "
        "(torchrun --nnodes M:N); pair it with --global-batch and --resume auto (docs/operations.md); 0: exactly N",
        _LAUNCH,
        metavar="M",
    )
    rdzv_wait: int = _opt(
        _DEFAULT_RDZV_WAIT,
        "with --min-nnodes: seconds a re-formed run waits for more machines once it has M (torchrun's last_call_timeout)",
        _LAUNCH,
        metavar="S",
    )
    config: str | None = _opt(
        None,
        "train through shardkit.initialize with this DeepSpeed JSON config (ZeRO stage, offload, fp16/bf16, "
        "optimizer, scheduler, batch sizes, clipping come from it); --lr, --weight-decay, --warmup, --steps, "
        '--clip, --batch-size fill its "auto" values',
        _CONFIG,
        metavar="DS.JSON",
    )
    auto: tuple[str, ...] = _opt(
        (),
        'with --config: what an "auto" stands for, by load_config\'s keyword (e.g. lr=3e-4, '
        "gradient_accumulation_steps=2); overrides the flags above; repeatable",
        _CONFIG,
        metavar="KEY=VALUE",
        repeat=True,
    )
    model: Model = _opt(
        "tinygpt",
        "tinygpt (built in) or a transformers GPT-2 / Llama built from config with --d-model/--n-layers/--n-heads/"
        "--seq-len (needs the 'test' extra)",
        _MODEL,
    )
    strategy: DpStrategy = _opt("none", "parallel strategy", _LAUNCH)
    bucket_mb: float = _opt(
        25.0,
        "ddp/zero1/zero2/zero3: gradient bucket size in MiB",
        _LAUNCH,
        metavar="MB",
        strategies=("ddp", "zero1", "zero2", "zero3"),
    )
    grad_buckets: Literal["copy", "view"] = _opt(
        "copy",
        "ddp: 'view' makes each grad a view of its bucket (gradients held once, no copy back); 'copy' keeps separate grads",
        _LAUNCH,
        strategies=("ddp",),
    )
    offload: Literal["none", "cpu", "nvme"] = _opt(
        "none",
        "zero1/zero2/zero3: fp32 masters, optimizer state and step on the CPU, or in files under --nvme-dir",
        _LAUNCH,
        strategies=("zero1", "zero2", "zero3"),
    )
    nvme_dir: str | None = _opt(
        None, "zero*: directory for --offload nvme", _LAUNCH, metavar="DIR", strategies=("zero1", "zero2", "zero3")
    )
    hpz: int = _opt(
        1,
        "zero3: keep a 1/N piece of each block's parameters after its forward and gather the backward's copy inside "
        "blocks of N data-parallel ranks (ZeRO++'s hpZ; N = the dp ranks per machine keeps that gather on each "
        "machine: 2 of ZeRO-3's 3 parameter-sized transfers per step cross machines instead of 3); 1: off",
        _LAUNCH,
        metavar="N",
    )
    tp: int = _opt(
        1, "tensor-parallel ranks (TinyGPT's gpt_plan, vocab-parallel loss); nproc = dp x tp x pp", _PARALLEL, metavar="N"
    )
    pp: int = _opt(1, "pipeline stages (embedding, blocks, head split by layer count)", _PARALLEL, metavar="N")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1"] = _opt("1f1b", "pipeline schedule (--pp > 1)", _PARALLEL)
    microbatches: int = _opt(
        4, "micro-batches per step (--pp > 1); must divide the sequences per rank (--batch-size)", _PARALLEL, metavar="M"
    )
    virtual_stages: int = _opt(1, "stages per rank (--schedule interleaved)", _PARALLEL, metavar="V")
    cp: int = _opt(
        1,
        "context-parallel ranks: each holds 1/cp of every sequence's tokens and attention runs over the shards "
        "(docs/context_parallel.md); nproc = dp x cp x tp x pp",
        _PARALLEL,
        metavar="N",
    )
    cp_mode: Literal["ring", "ulysses", "hybrid"] = _opt(
        "ring",
        "with --cp: ring attention (key/value blocks around the ring), Ulysses (all-to-all to head shards) or hybrid "
        "(Ulysses within groups of --cp-ulysses ranks, the ring across them)",
        _PARALLEL,
    )
    cp_ulysses: int = _opt(0, "with --cp-mode hybrid: cp ranks per all-to-all group (a divisor of --cp)", _PARALLEL, metavar="U")
    sequence_parallel: bool = _opt(
        False, "with --tp: activations between the linears as sequence shards (LayerNorm grads summed over tp)", _PARALLEL
    )
    checkpointing: Literal["none", "blocks", "cpu"] = _opt(
        "none", "activation checkpointing per block; cpu also keeps the saved block inputs on the CPU", _PARALLEL
    )
    fused_ce: bool = _opt(
        False,
        "the token cross-entropy from the LM head's input, chunk by chunk: no [tokens, vocab] logits "
        "(parallelize(fused_cross_entropy=True))",
        _PARALLEL,
    )
    device: Literal["auto", "cpu", "cuda"] = _opt(
        "auto", "auto: cuda when available; cpu forces the gloo backend even where CUDA exists", _LAUNCH
    )
    seed: int = _opt(0, "model and data seed, the same on every rank", _LAUNCH, metavar="N")
    d_model: int = _opt(128, "residual width", _MODEL, metavar="D")
    n_layers: int = _opt(4, "blocks", _MODEL, metavar="L")
    n_heads: int = _opt(4, "attention heads", _MODEL, metavar="H")
    dropout: float = _opt(0.0, "dropout probability", _MODEL, metavar="P")
    steps: int = _opt(200, "optimizer steps", _OPTIM, metavar="N")
    batch_size: int = _opt(_DEFAULT_BATCH, "sequences per rank per step", _OPTIM, metavar="B")
    global_batch: int = _opt(
        0,
        "sequences per step over all data-parallel replicas, split evenly at whatever world size the run has "
        "(a restart on fewer machines draws the same batches); replaces --batch-size; 0: --batch-size per rank",
        _OPTIM,
        metavar="G",
    )
    seq_len: int = _opt(128, "tokens per sequence", _OPTIM, metavar="T")
    lr: float = _opt(3e-3, "peak learning rate", _OPTIM)
    warmup: int = _opt(20, "linear warmup steps, then cosine decay", _OPTIM, metavar="N")
    min_lr_ratio: float = _opt(0.1, "final lr / peak lr; 1 = constant after warmup", _OPTIM, metavar="R")
    weight_decay: float = _opt(0.1, "decoupled, on matrices only", _OPTIM, metavar="WD")
    clip: float = _opt(1.0, "max global grad norm, 0 disables", _OPTIM, metavar="NORM")
    precision: Precision = _opt(
        "fp32",
        "",
        _OPTIM,
        flags={"fp32": "full precision (default)", "bf16": "bf16 autocast", "fp16": "fp16 autocast with dynamic loss scaling"},
    )
    ckpt_dir: str | None = _opt(
        None, "save checkpoints under DIR/step-N (sharded, atomic; see --save-every, --keep)", _CKPT, metavar="DIR"
    )
    save_every: int = _opt(
        0, "with --ckpt-dir: save every N steps, and after the last step (0: after the last step only)", _CKPT, metavar="N"
    )
    keep: int = _opt(2, "with --ckpt-dir: complete checkpoints to keep (older ones are deleted)", _CKPT, metavar="K")
    async_save: bool = _opt(
        False, "with --ckpt-dir: write each checkpoint in the background while training goes on (host memory: one copy)", _CKPT
    )
    resume: Literal["none", "auto"] = _opt(
        "none",
        "auto: continue from the newest complete checkpoint in --ckpt-dir (or start fresh when there is none), "
        "at any world size; none: start fresh",
        _CKPT,
    )
    max_restarts: int = _opt(
        0,
        "--nproc > 1: relaunch the workers up to K times after a failure (torchrun --max-restarts); with "
        "--resume auto they continue from the newest checkpoint",
        _CKPT,
        metavar="K",
    )
    timeout: float = _opt(300.0, "seconds a collective may wait for the other ranks before the run fails", _CKPT, metavar="S")
    heartbeat: float = _opt(
        20.0,
        "seconds without a heartbeat after which a rank is declared frozen and killed, ending the run (0: off)",
        _CKPT,
        metavar="S",
    )
    inject_fault: str | None = _opt(
        None,
        "a drill: rank RANK fails at step STEP in the first attempt; KIND is raise, exit, kill, stop or hang "
        "(docs/operations.md)",
        _CKPT,
        metavar="RANK:STEP:KIND",
    )
    eval_every: int = _opt(50, "steps between eval-loss estimates", _LOG, metavar="N")
    eval_iters: int = _opt(8, "fixed validation batches per estimate", _LOG, metavar="N")
    sample: int = _opt(0, "print a generated sample of CHARS characters at the end", _LOG, metavar="CHARS")
    log_json: str | None = _opt(None, "write the config, loss curves and per-rank summaries here", _LOG, metavar="PATH")
    plot: str | None = _opt(
        None,
        "draw the loss curves and per-rank memory vs the planner into this .png/.svg/.pdf (needs matplotlib)",
        _LOG,
        metavar="PATH",
    )

    def validate(self, world_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first invalid field.

        Args:
            world_size: the ranks of the run when they are not ``nproc × nnodes`` (a torchrun
                worker runs with ``nproc=1`` in a world of ``WORLD_SIZE``); default
                ``nproc × nnodes``, and then also every smaller world ``--min-nnodes`` lets the
                run go on with (:meth:`elastic_worlds`), so a layout a lost machine would break
                is refused before the run starts.
        """
        self._validate_world(world_size)
        if world_size is None:
            for world in self.elastic_worlds()[1:]:
                try:
                    self._validate_world(world)
                except ValueError as e:
                    raise ValueError(
                        f"--min-nnodes {self.min_nnodes}: after losing machines the run would go on with "
                        f"{world // self.nproc} machine(s), {world} ranks, and then: {e}"
                    ) from None

    def _validate_world(self, world_size: int | None) -> None:
        for name in ("nproc", "nnodes", "steps", "batch_size", "seq_len", "eval_every", "eval_iters", "bucket_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self._validate_elastic()
        for name in ("lr", "warmup", "weight_decay", "clip", "dropout", "sample"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for f in fields(self):
            choices = _choices(f.name)
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {getattr(self, f.name)!r}")
        if self.config is not None:
            if not os.path.isfile(self.config) and self.config not in EXAMPLE_CONFIGS:
                raise ValueError(f"--config {self.config}: no such file (nor a shipped example: {', '.join(EXAMPLE_CONFIGS)})")
            if self.cp != 1:
                raise ValueError(
                    "--cp with --config: the config decides this (its sequence_parallel_size and context_parallel "
                    "section); drop --cp"
                )
            for name, default in CONFIG_EXCLUSIVE.items():
                if getattr(self, name) != default:
                    flag = f"--{getattr(self, name)}" if name == "precision" else f"--{name.replace('_', '-')}"
                    raise ValueError(
                        f"{flag} with --config: the config decides this (its zero_optimization, fp16/bf16, "
                        "tensor_parallel, pipeline or fused_cross_entropy section); "
                        "edit the config or drop the flag"
                    )
        elif self.auto:
            raise ValueError('--auto fills a DeepSpeed config\'s "auto" values: it needs --config')
        for item in self.auto:
            key, sep, _ = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--auto expects KEY=VALUE, got {item!r}")
        if self.model != "tinygpt":
            if self.pp > 1:
                raise ValueError(f"--pp with --model {self.model}: pipeline splits are defined for TinyGPT only")
            if self.checkpointing != "none":
                raise ValueError(f"--checkpointing with --model {self.model}: defined for TinyGPT blocks only")
            if self.sample:
                raise ValueError(f"--sample with --model {self.model}: generation is TinyGPT's")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        for name in ("tp", "pp", "cp", "microbatches", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.nnodes > 1:
            host, sep, port = (self.rdzv_endpoint or "").rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, got {self.rdzv_endpoint!r}")
        model_ranks = self.model_ranks
        world = self.nproc * self.nnodes if world_size is None else world_size
        if world % model_ranks:
            named = f"cp x tp x pp = {self.cp} x {self.tp} x {self.pp}" if self.cp > 1 else f"tp x pp = {self.tp} x {self.pp}"
            raise ValueError(f"nproc={world} must be a multiple of {named}")
        dp = world // model_ranks
        if self.global_batch and self.global_batch % dp:
            raise ValueError(
                f"global_batch={self.global_batch} must be divisible by the {dp} data-parallel replicas of {world} ranks"
            )
        if dp > 1 and self.strategy == "none" and self.config is None:
            raise ValueError(f"nproc={world} leaves dp={dp} replicas: pass --strategy ddp, zero1 or zero2 (zero3 without --pp)")
        if self.hpz < 1:
            raise ValueError(f"hpz must be positive, got {self.hpz}")
        if self.hpz > 1 and (self.strategy != "zero3" or self.config is not None):
            raise ValueError(f"--hpz {self.hpz} applies to --strategy zero3 (a --config sets zero_hpz_partition_size)")
        if self.hpz > 1 and (dp * self.cp) % self.hpz:
            raise ValueError(
                f"--hpz {self.hpz} must divide the data-parallel ranks dp x cp = {dp * self.cp} of {world} ranks "
                "(e.g. the dp ranks per machine)"
            )
        if self.tp * self.pp > 1:
            if self.strategy == "zero3" and self.pp > 1:
                raise ValueError(
                    "strategy=zero3 with --pp: ZeRO-3's per-unit gathers would have to run per micro-batch inside "
                    "the pipeline schedule; use --strategy zero1 or zero2 (or ddp)"
                )
            if self.precision == "fp16" and not self.strategy.startswith("zero"):
                raise ValueError(
                    "precision=fp16 with --tp/--pp needs --strategy zero1/2/3 (tp only), or use --bf16 (tp only) / --fp32"
                )
            if self.n_heads % self.tp:
                raise ValueError(f"n_heads={self.n_heads} must be divisible by tp={self.tp}")
        if self.sequence_parallel and (self.tp == 1 or self.seq_len % self.tp or self.model != "tinygpt"):
            raise ValueError(
                f"sequence_parallel needs --tp > 1 dividing seq_len={self.seq_len} and the TinyGPT model "
                f"(the HF plans have no sequence-parallel variant yet), got tp={self.tp}, model={self.model}"
            )
        if self.pp > 1:
            if self.precision != "fp32":
                raise ValueError("--pp runs in fp32 for now (autocast is not applied inside pipeline stages)")
            if self.rank_batch(world) % self.microbatches:
                what = (
                    f"--global-batch {self.global_batch} over dp={dp} is {self.rank_batch(world)} per rank, which"
                    if self.global_batch
                    else f"batch_size={self.batch_size}"
                )
                raise ValueError(f"{what} must be divisible by microbatches={self.microbatches}")
            if self.n_layers + 2 < self.pp * self.virtual_stages:
                raise ValueError(
                    f"pp x virtual_stages = {self.pp * self.virtual_stages} stages but TinyGPT has only "
                    f"n_layers + 2 = {self.n_layers + 2} blocks (embedding, layers, head)"
                )
        self._validate_context_parallel()
        self._validate_checkpoints(world)
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"virtual_stages={self.virtual_stages} needs --schedule interleaved")
        for flag, path in (("--log-json", self.log_json), ("--plot", self.plot)):
            if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ValueError(f"{flag} {path!r}: the directory {os.path.dirname(os.path.abspath(path))!r} does not exist")
        if self.plot is not None:
            from shardkit.train.run_plot import check_plot_path

            check_plot_path(self.plot)
        if self.offload == "nvme" and not self.nvme_dir:
            raise ValueError("offload=nvme needs --nvme-dir DIR")
        if self.offload == "nvme":  # missing or read-only: said here, before any worker starts
            from shardkit.parallel.zero.nvme import validate_nvme_dir

            try:
                validate_nvme_dir(self.nvme_dir)
            except ValueError as e:
                raise ValueError(f"--nvme-dir: {e}") from None
        if self.fused_ce and self.pp > 1 and self.schedule == "zb-h1":
            raise ValueError(
                "--fused-ce with --schedule zb-h1: its split backward runs the loss's backward twice, and the fused "
                "loss forms its gradients once; use another --schedule"
            )
        if self.schedule == "interleaved" and self.pp > 1 and self.virtual_stages == 1:
            raise ValueError("--schedule interleaved needs --virtual-stages V >= 2 (stages per rank; with V = 1 it is 1f1b)")
        if self.offload != "none" and not self.strategy.startswith("zero"):
            raise ValueError(f"offload={self.offload} needs --strategy zero1, zero2 or zero3")

    def rank_batch(self, world_size: int) -> int:
        """Sequences per rank per step at ``world_size`` ranks: ``global_batch / dp`` when
        ``global_batch`` is set, else ``batch_size``.

        Example:
            >>> TrainConfig(global_batch=16, tp=2).rank_batch(8)     # dp = 4
            4
        """
        if not self.global_batch:
            return self.batch_size
        return self.global_batch // max(1, world_size // self.model_ranks)

    def _validate_elastic(self) -> None:
        """``--global-batch``, ``--min-nnodes``, ``--rdzv-wait`` (the worlds a lost machine leaves:
        :meth:`elastic_worlds`, checked by :meth:`validate` at launch)."""
        if self.global_batch < 0:
            raise ValueError(f"global_batch must be >= 0 (0: --batch-size per rank), got {self.global_batch}")
        if self.global_batch and self.batch_size != _DEFAULT_BATCH:
            raise ValueError(
                f"--batch-size {self.batch_size} and --global-batch {self.global_batch}: give one (--global-batch sets "
                "the sequences per rank to its share of each step)"
            )
        if self.global_batch and self.config is not None:
            raise ValueError(
                "--global-batch with --config: the batch comes from the config (train_batch_size, or --batch-size "
                'filling its "auto" values); drop --global-batch'
            )
        if self.min_nnodes:
            if self.nnodes == 1:
                raise ValueError(f"--min-nnodes {self.min_nnodes} needs --nnodes N > 1 machines, got --nnodes 1")
            if not 1 <= self.min_nnodes < self.nnodes:
                raise ValueError(
                    f"--min-nnodes {self.min_nnodes} must be at least 1 and below --nnodes {self.nnodes} (the machines "
                    "the run may go on with after losing some)"
                )
            if self.max_restarts < 1:
                raise ValueError(
                    f"--min-nnodes {self.min_nnodes}: a run goes on with fewer machines only by restarting; pass --max-restarts K"
                )
        if self.rdzv_wait < 1:
            raise ValueError(f"rdzv_wait must be at least 1 (whole seconds), got {self.rdzv_wait}")
        if self.rdzv_wait != _DEFAULT_RDZV_WAIT and not self.min_nnodes:
            raise ValueError(f"--rdzv-wait {self.rdzv_wait} applies with --min-nnodes only")

    def elastic_worlds(self) -> list[int]:
        """The world sizes an elastic run may restart with (``--min-nnodes`` to ``--nnodes``
        machines of ``--nproc`` ranks), largest first; ``[nproc × nnodes]`` otherwise.

        Example:
            >>> TrainConfig(nproc=2, nnodes=3, min_nnodes=1, max_restarts=1, rdzv_endpoint="h:1").elastic_worlds()
            [6, 4, 2]
        """
        return [m * self.nproc for m in range(self.nnodes, (self.min_nnodes or self.nnodes) - 1, -1)]

    @property
    def model_ranks(self) -> int:
        """Ranks that hold one replica's model and sequences: ``cp × tp × pp`` (dp = world / this)."""
        return self.cp * self.tp * self.pp

    def _validate_context_parallel(self) -> None:
        """``--cp``: what it composes with ([Note: what a cp plan changes] in shardkit.parallel.context.plan)."""
        if self.cp_ulysses and self.cp_mode != "hybrid":
            raise ValueError(f"--cp-ulysses {self.cp_ulysses} applies to --cp-mode hybrid only")
        if self.cp == 1:
            return
        if self.strategy == "none":
            raise ValueError("--cp needs --strategy ddp, zero1, zero2 or zero3: the cp ranks' gradients are summed")
        if self.dropout and self.cp_mode != "ulysses":
            raise ValueError(
                f"--cp with --dropout {self.dropout}: the model drops attention weights, which --cp-mode "
                f"{self.cp_mode}'s blockwise attention does not do; use --cp-mode ulysses or --dropout 0"
            )
        if self.sample:
            raise ValueError("--sample with --cp: generation runs on whole sequences; use --sample 0")
        chunks = 2 * self.cp
        if self.seq_len % chunks:
            raise ValueError(f"--seq-len {self.seq_len} must be a multiple of 2 x cp = {chunks} (zigzag: two chunks per cp rank)")
        heads = self.n_heads // self.tp
        if self.cp_mode == "ulysses" and heads % self.cp:
            raise ValueError(
                f"--cp-mode ulysses splits each rank's {heads} heads (n_heads / tp) over cp={self.cp}: they must divide; "
                "or use --cp-mode ring"
            )
        if self.cp_mode == "hybrid":
            u = self.cp_ulysses
            if u < 1 or self.cp % u:
                given = "" if u == 0 else f" (got --cp-ulysses {u})"
                raise ValueError(
                    f"--cp-mode hybrid needs --cp-ulysses U, the cp ranks per all-to-all group: a divisor of --cp {self.cp}{given}"
                )
            if heads % u:
                raise ValueError(
                    f"--cp-ulysses {u} splits each rank's {heads} heads (n_heads / tp) over its all-to-all groups: "
                    "they must divide"
                )

    def _validate_checkpoints(self, world_size: int) -> None:
        """The checkpoint, restart and timeout flags (see [Note: resuming a training run])."""
        for name in ("save_every", "max_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive (seconds), got {self.timeout}")
        if self.heartbeat < 0 or 0 < self.heartbeat <= 2:
            raise ValueError(f"heartbeat must be 0 (off) or more than 2 seconds, got {self.heartbeat}")
        from shardkit.train.fault_injection import parse_fault

        parse_fault(self.inject_fault, world_size=world_size)
        if self.ckpt_dir is None:
            for flag, used in (
                ("--save-every", self.save_every > 0),
                ("--resume auto", self.resume == "auto"),
                ("--async-save", self.async_save),
            ):
                if used:
                    raise ValueError(f"{flag} needs --ckpt-dir DIR")
        else:
            if self.config is not None:
                raise ValueError(
                    "--ckpt-dir with --config: the engine loop saves through engine.save_checkpoint in your own "
                    "script (docs/operations.md); shardkit train saves the parallelize path only"
                )
            parent = os.path.dirname(os.path.abspath(self.ckpt_dir))
            if not os.path.isdir(parent):
                raise ValueError(f"--ckpt-dir {self.ckpt_dir!r}: the directory {parent!r} does not exist")
            if os.path.exists(self.ckpt_dir) and not os.path.isdir(self.ckpt_dir):
                raise ValueError(f"--ckpt-dir {self.ckpt_dir!r} is a file, not a directory")

    def strategy_options(self) -> dict[str, Any]:
        """The options of the chosen strategy, for ``make_strategy(cfg.strategy, **options)``.

        Example:
            >>> TrainConfig(strategy="ddp", bucket_mb=4).strategy_options()
            {'bucket_mb': 4, 'grad_buckets': 'copy'}
        """
        return {f.name: getattr(self, f.name) for f in fields(self) if self.strategy in f.metadata.get("strategies", ())}


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _choices(name: str) -> tuple[Any, ...]:
    hint = _hints()[name]
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def _scalar_type(name: str) -> type:
    hint = _hints()[name]
    if typing.get_origin(hint) is Literal:
        return type(typing.get_args(hint)[0])
    args = [a for a in typing.get_args(hint) if a is not type(None)]  # Optional[X] -> X
    return args[0] if args else hint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`TrainConfig` field to ``parser``, in argument groups.

    ``--field-name`` for a field ``field_name``; a field with ``flags`` metadata becomes
    mutually exclusive switches (``--fp32/--bf16/--fp16``).

    Example:
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> from_args(p.parse_args(["--steps", "300", "--bf16"])).precision
        'bf16'
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(TrainConfig):
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        if "flags" in meta:
            exclusive = group.add_mutually_exclusive_group()
            for value, what in meta["flags"].items():
                exclusive.add_argument(f"--{value}", dest=f.name, action="store_const", const=value, help=what)
            parser.set_defaults(**{f.name: f.default})
            continue
        if meta.get("repeat"):  # a repeatable flag: a tuple of its values in the order given
            group.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f.name,
                action="append",
                default=None,
                metavar=meta.get("metavar"),
                help=meta["help"],
            )
            continue
        if _hints()[f.name] is bool:  # a switch: --name sets it, absent keeps the default (False)
            group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, action="store_true", help=meta["help"])
            continue
        choices = _choices(f.name)
        default_note = "" if f.default is None or f.default is MISSING else " (default %(default)s)"
        group.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            type=_scalar_type(f.name),
            default=f.default,
            choices=list(choices) or None,
            metavar=None if choices else meta.get("metavar"),
            help=meta["help"] + default_note,
        )


def from_args(ns: argparse.Namespace) -> TrainConfig:
    """Build a :class:`TrainConfig` from parsed flags (attributes that are not fields are ignored)."""
    values = {f.name: getattr(ns, f.name) for f in fields(TrainConfig) if hasattr(ns, f.name)}
    for f in fields(TrainConfig):
        if f.metadata.get("repeat") and f.name in values:
            values[f.name] = tuple(values[f.name] or ())
    return TrainConfig(**values)


def to_argv(cfg: TrainConfig, *, skip: Iterable[str] = ()) -> list[str]:
    """The flags that parse back into ``cfg`` (inverse of :func:`from_args`).

    Args:
        cfg: the config.
        skip: field names to leave out.

    Example:
        >>> to_argv(TrainConfig(steps=7, precision="bf16"))[:4]
        ['--nproc', '1', '--strategy', 'none']
    """
    skip = set(skip)
    argv: list[str] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in skip or value is None:
            continue
        if f.metadata.get("repeat"):
            argv += [a for item in value for a in (f"--{f.name.replace('_', '-')}", str(item))]
            continue
        if isinstance(value, bool):
            argv += [f"--{f.name.replace('_', '-')}"] if value else []
            continue
        argv += [f"--{value}"] if "flags" in f.metadata else [f"--{f.name.replace('_', '-')}", str(value)]
    return argv
