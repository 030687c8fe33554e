"""``shardkit.initialize``: ``deepspeed.initialize``'s signature and return value, on shardkit.

Every layout is built by :func:`~shardkit.parallel.parallelize` (:func:`build_parallel`), and
the engine steps the :class:`~shardkit.parallel.ParallelModel` it returns. From the resolved
config (:func:`shardkit.engine.load_config`):

* ZeRO stage 0 → ``dp="ddp"`` (:class:`~shardkit.parallel.DataParallel`, bucket size from
  ``reduce_bucket_size``); stages 1-3 → ``dp="zero1"``..``"zero3"``
  (:class:`~shardkit.parallel.ShardedDataParallel`: the same bucket size in elements,
  ``offload_optimizer`` → ``offload="cpu"|"nvme"``, ``nvme_path`` → ``nvme_dir``,
  ``offload_param`` → ``offload_params=True``) and a :class:`~shardkit.parallel.ZeroOptimizer`.
* precision: fp16 → the module in fp16 and a :class:`~shardkit.parallel.DynamicLossScaler`
  with the config's arguments; bf16 → the module in bf16. Both keep fp32 masters: ZeRO always,
  stage 0 through the fused optimizers' ``master_weights=True``.
* the optimizer from ``optimizer`` (shardkit's fused classes) unless ``optimizer=`` is given;
  the LR scheduler from ``scheduler`` unless ``lr_scheduler=`` is given.
* ``tensor_parallel.size`` > 1: the context gets a tp axis (dp = world / (tp × pp)), the plan the
  section names (:mod:`shardkit.engine.model_layout`) is ``parallelize``'s ``tp_plan``, and the dp
  strategy runs on the dp axis (ZeRO × TP: the epilogue agrees the norm and overflow over tp).
* ``sequence_parallel_size`` > 1 (DeepSpeed's key): the context gets a cp axis (dp = world /
  (tp × pp × cp)), the model's cp plan (built in for TinyGPT, GPT-2 and Llama, or ``cp_plan=``)
  is ``parallelize``'s ``cp`` with the ``context_parallel`` section's mode and layout, and the
  engine's forward takes whole sequences and runs this rank's tokens
  (:mod:`shardkit.engine.sequence_split`).
* ``pipeline.stages`` > 1: ``parallelize``'s ``pp`` (TP → stages → dp) behind a
  :class:`~shardkit.engine.pipeline_engine.PipelineEngine` (``train_batch``/``eval_batch``).
* a :class:`shardkit.deepspeed.pipe.PipelineModule` (DeepSpeed's): the same pipeline, its
  ``num_stages`` as ``pipeline.stages``, its layers as the blocks, its ``loss_fn`` and its stage
  cut (:func:`_pipeline_module_layout`).

Every check runs before the first collective (the model check of the wrapper): a bad config,
unknown parameter groups, an nvme path that does not exist, a built optimizer for ZeRO.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import logging
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.parallel import (
    DataParallel,
    DynamicLossScaler,
    ParallelModel,
    PipelineOptions,
    ShardedDataParallel,
    ZeroOptimizer,
    parallelize,
)
from shardkit.parallel.param_groups import resolve_param_groups
from shardkit.parallel.pipeline.split import as_block_list, split_blocks
from shardkit.parallel.strategy_names import dp_strategy_of_zero_stage
from shardkit.parallel.context import check_ulysses_heads
from shardkit.parallel.context.plan import plan_modules as cp_plan_modules
from shardkit.parallel.tensor import plan_modules

from .config_reader import load_config, load_raw
from .engine import Engine
from .model_layout import (
    BlocksFn,
    axis_sizes,
    default_blocks,
    gather_head_logits,
    groups_by_name,
    regroup,
    cp_plan_for,
    tp_plan_for,
    vocab_sizes,
)
from .resolved import EngineConfig
from .sequence_split import SequenceSplitForward

__all__ = ["build_parallel", "initialize"]

logger = logging.getLogger("shardkit.engine")

#: ``deepspeed.initialize`` arguments that have no meaning here: accepted at their defaults.
_DEEPSPEED_DEFAULTS = {"distributed_port": None, "dist_init_required": None, "mpu": None, "mesh_param": None}


def initialize(
    model: nn.Module | None = None,
    config: str | Path | Mapping[str, Any] | None = None,
    *,
    ctx: ParallelContext | None = None,
    model_parameters: Iterable[Any] | None = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    collate_fn: Callable[..., Any] | None = None,
    args: Any = None,
    config_params: str | Path | Mapping[str, Any] | None = None,
    strict: bool = True,
    tp_plan: Mapping[str, Any] | None = None,
    cp_plan: Mapping[str, str] | None = None,
    blocks: Callable[[nn.Module], Any] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    **auto_values: Any,
) -> tuple[Engine, Any, Any, Any]:
    """Build a training engine from a DeepSpeed-style config, as ``deepspeed.initialize`` does.

    Args:
        model: the ``nn.Module`` (built identically, same seed, on every rank).
        config: a JSON path or a dict (DeepSpeed's keys, docs/engine.md); also read from
            ``args.deepspeed_config`` or ``config_params`` (DeepSpeed's other spellings).
        ctx: the parallel context; default ``ParallelContext.from_env()`` (gloo without CUDA).
        model_parameters: what to optimize: parameters, or param-group dicts whose ``"params"``
            are the model's parameters or their names (e.g. Trainer-style no-decay groups);
            default every trainable parameter.
        optimizer: None (the config's ``optimizer``), an optimizer class or a callable
            ``params -> torch.optim.Optimizer`` (called with the groups: ZeRO calls it with
            this rank's shard parameters, so it must be elementwise — AdamW, SGD, Lion), or,
            for stage 0 in fp32 only, a built optimizer over the model's parameters.
        lr_scheduler: None (the config's ``scheduler``), a callable ``optimizer -> scheduler``
            (given the torch optimizer that steps, as DeepSpeed gives its basic optimizer), or a
            scheduler built on the optimizer passed as ``optimizer=``.
        training_data: a ``torch.utils.data.Dataset``: a DataLoader over this rank's
            ``DistributedSampler`` share, micro-batch size per rank, is returned third; shuffled
            (seed 0) without a pipeline, in order with one, where ``train_batch()`` reads it
            repeating (both as DeepSpeed's engines).
        collate_fn: the DataLoader's ``collate_fn``.
        args: DeepSpeed's ``args`` (its ``deepspeed_config`` is the config when ``config`` is None).
        config_params: DeepSpeed's old name of ``config``.
        strict: unknown config keys raise (True) or warn (False).
        tp_plan: with ``tensor_parallel.size`` > 1, a TP plan ``{module pattern: style}`` of
            :mod:`shardkit.parallel.tensor` instead of the one ``tensor_parallel.plan`` names.
        cp_plan: with ``sequence_parallel_size`` > 1, a context-parallel plan ``{module pattern:
            "attention" | "positions"}`` (:func:`shardkit.parallel.context.context_parallelize`)
            for a model without a built-in one (TinyGPT, Hugging Face GPT-2 and Llama have one).
        blocks: with ``pipeline.stages`` > 1, ``blocks(model) -> [first, ..., last]``, modules
            whose composition is the model's forward (the pipeline's cut points). Not needed for
            an ``nn.Sequential``/``nn.ModuleList`` (its children), shardkit's TinyGPT or a
            ``PipelineModule`` (its layers; it takes no ``blocks=``/``loss_fn=``).
        loss_fn: with ``pipeline.stages`` > 1, ``loss_fn(outputs, labels) -> 0-d mean loss``
            run on the last stage (DeepSpeed's ``PipelineModule(loss_fn=...)``); default token
            cross-entropy (outputs ``[..., C]``, integer labels ``[...]``), vocab-parallel when
            the TP plan splits the head.
        **auto_values: what ``"auto"`` config values stand for (``lr``, ``weight_decay``,
            ``warmup_num_steps``, ``total_num_steps``, ``train_micro_batch_size_per_gpu``,
            ``gradient_clipping``, ...; see :func:`shardkit.engine.load_config`).
            ``hidden_size`` defaults to ``model.config.hidden_size`` (Hugging Face models), for
            the bucket-size "auto" rules.

    Returns:
        ``(engine, engine.optimizer, dataloader or None, engine.lr_scheduler)`` — DeepSpeed's
        4-tuple. The process groups initialize makes (``ctx=None``), and the world, are destroyed
        at interpreter exit, as DeepSpeed scripts never do it themselves ([Note: the groups
        initialize made end at exit]).

    Raises:
        ValueError / TypeError: naming the key or argument, before any collective.
        NotImplementedError: DeepSpeed's ``mpu=``/``mesh_param=`` (shardkit takes ``ctx=``).

    Example:
        >>> engine, optimizer, _, scheduler = shardkit.initialize(
        ...     model=model, model_parameters=model.parameters(), config="ds_config.json",
        ...     lr=3e-4, weight_decay=0.01, warmup_num_steps=100, total_num_steps=1000,
        ...     gradient_clipping=1.0, train_micro_batch_size_per_gpu=8)
        >>> loss = engine(input_ids=x, labels=x).loss
        >>> engine.backward(loss); engine.step()
    """
    for key, default in _DEEPSPEED_DEFAULTS.items():
        if key in auto_values and auto_values.pop(key) is not default:
            raise NotImplementedError(f"initialize({key}=...) is DeepSpeed's; shardkit takes ctx= (a ParallelContext) instead")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, (Engine, DataParallel, ShardedDataParallel)):
        raise TypeError(f"model is already wrapped ({type(model).__name__}); pass the unwrapped model")
    config = _the_config(config, config_params, args)
    if ctx is not None and not isinstance(ctx, ParallelContext):
        raise TypeError(f"ctx must be a ParallelContext or None, got {type(ctx).__name__}")
    split = None  # a PipelineModule's stage cut (block counts), replacing pipeline.partition
    if _is_pipeline_module(model):
        config, blocks, loss_fn, split = _pipeline_module_layout(model, config, blocks, loss_fn, ctx)
    if ctx is None and not dist.is_initialized():
        # torchrun's environment, or a one-process world: the rendezvous, no collective yet. NCCL
        # when CUDA is available (the model then moves to the rank's GPU, as DeepSpeed moves it),
        # else gloo. The axis sizes are checked against WORLD_SIZE before any group exists.
        try:
            ctx = made = _context_from_env(*axis_sizes(config, auto_values))
        except ValueError as e:
            if split is None:
                raise
            raise ValueError(f"PipelineModule(num_stages={model.num_stages}): {e}") from e
    else:
        made = None
    try:
        world = ctx.world_size if ctx is not None else dist.get_world_size()
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        if hidden is not None and "hidden_size" not in auto_values:
            auto_values["hidden_size"] = hidden
        cfg = load_config(config, world_size=world, strict=strict, **auto_values)
        if split is not None:
            cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, partition=split))
        _check_supported(cfg)
        tp, pp, cp = cfg.tensor_parallel.size, cfg.pipeline.stages, cfg.context_parallel.size
        plan = _check_layout(model, cfg, tp_plan, blocks, loss_fn)
        sequence_plan = _check_sequence_split(model, cfg, cp_plan, loss_fn)
        blocks = default_blocks(model, blocks) if pp > 1 else None
        if isinstance(optimizer, torch.optim.Optimizer):  # its own groups, with their options
            owned = set(model.parameters())
            if any(p not in owned for g in optimizer.param_groups for p in g["params"]):
                raise ValueError("optimizer: the built optimizer holds tensors that are not parameters of the model")
            groups = [
                {**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])} for g in optimizer.param_groups
            ]
        else:
            groups = resolve_param_groups(model, model_parameters, arg="model_parameters")
        if pp > 1:
            _check_stages_train(model, blocks, cfg, groups)
        make_optimizer = _optimizer_factory(cfg, optimizer, model)
        _check_scheduler(lr_scheduler, optimizer)
        if ctx is None:
            ctx = made = ParallelContext.from_world(tp=tp, pp=pp, cp=cp)  # the default group exists
        want = {"pp": pp, "dp": cfg.dp_size, "cp": cp, "tp": tp}
        if ctx.sizes != want:
            raise ValueError(
                f"ctx: axes {ctx.sizes} but the config asks for {want} (tensor_parallel.size, pipeline.stages, "
                "sequence_parallel_size, dp = world / (tp × pp × cp)); build the context with those sizes or pass ctx=None"
            )

        model = _to_device_and_dtype(model, ctx, cfg)
        scaler = cfg.precision.loss_scaler.make() if cfg.precision.dtype == "fp16" else None
        parallel, opt = build_parallel(
            model,
            ctx,
            cfg,
            scaler=scaler,
            groups=groups,
            make=make_optimizer,
            tp_plan=plan,
            blocks=blocks,
            loss_fn=loss_fn,
            cp_plan=sequence_plan,
        )
        if pp > 1:
            model = parallel.module  # this rank's stages
        basic = opt.optimizer if isinstance(opt, ZeroOptimizer) else opt  # the torch optimizer that steps
        if lr_scheduler is None:
            sched = cfg.scheduler.build(basic) if cfg.scheduler is not None else None
        elif _is_scheduler(lr_scheduler):
            sched = lr_scheduler
            if basic is not optimizer:  # the user's optimizer was rebuilt: the scheduler drives the new one
                _rebind_scheduler(sched, basic)
        else:
            sched = lr_scheduler(basic)
            if cfg.scheduler is not None:
                logger.warning(
                    "initialize: lr_scheduler= given; the config's scheduler section (%s) is not used", cfg.scheduler.type
                )
        common = dict(
            module=model,
            parallel=parallel,
            optimizer=opt,
            lr_scheduler=sched,
            config=cfg,
            ctx=ctx,
            loss_scaler=scaler,
            client_optimizer=optimizer,
        )
        if pp > 1:
            from .pipeline_engine import PipelineEngine

            engine: Engine = PipelineEngine(**common)
        else:
            tp_state = (plan, vocab_sizes(model)) if plan is not None else None
            sequence_split = (
                SequenceSplitForward(ctx, cfg.context_parallel.layout, parallel.stats, fused_heads=parallel.fused_heads)
                if cp > 1
                else None
            )
            engine = Engine(tp_state=tp_state, sequence_split=sequence_split, **common)
        loader = None
        if training_data is not None:  # DeepSpeed's pipeline engine reads its data in order
            loader = _dataloader(training_data, collate_fn, cfg, ctx, shuffle=pp == 1)
        if loader is not None and pp > 1:
            engine.training_dataloader = loader
            engine.set_dataiter(_repeat(loader))
    except BaseException:
        if made is not None:  # the groups this call created go with it: nothing left to abort at exit
            made.destroy(wait_for_peers=False)
        raise
    if made is not None:  # see [Note: the groups initialize made end at exit]
        atexit.register(_destroy_at_exit, made)
    return engine, engine.optimizer, loader, engine.lr_scheduler


# [Note: the groups initialize made end at exit]
# DeepSpeed scripts end without destroying anything: the engine's process groups and the world
# (whether the script or initialize made it) are left to interpreter shutdown. A gloo group torn
# down there can abort the process ("terminate called without an active exception": its threads
# still exist when C++ statics are destroyed): 1 run in 14-30 of notebooks/scripts/train_deepspeed.py
# on two CPU ranks. Destroying only the engine's own groups at exit left the abort as frequent
# (1 in 30); destroying the world as well gave 0 in 60. So initialize registers an atexit hook,
# which runs before that teardown, destroying the context it built and then the world if it is
# still there. After a clean exit the ranks first meet when initialize made the world
# (ParallelContext.destroy, at most TEARDOWN_WAIT per group), so none tears down a group a peer's
# last collective still uses; after an unhandled exception (sys.last_value is set before atexit
# hooks run) no peer is waited for. A context passed as ctx= is the caller's, and so is its
# teardown. A script that destroys the world itself is fine: destroy skips what is gone. Hooks a
# script registered before initialize run after this one and find no world.


def _destroy_at_exit(ctx: ParallelContext) -> None:
    """Destroy ``ctx`` at interpreter exit, meeting the peers first unless this rank failed."""
    try:
        ctx.destroy(wait_for_peers=getattr(sys, "last_value", None) is None)
        if dist.is_initialized():  # the script's own world, which DeepSpeed scripts leave too
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - exit goes on; a teardown error must not mask the run's result
        logger.warning("initialize: destroying the process groups at exit failed: %s", e)


# ---- checks (no collective) --------------------------------------------------------------------
def _the_config(config: Any, config_params: Any, args: Any) -> Any:
    given = [c for c in (config, config_params) if c is not None]
    if len(given) == 2:
        raise ValueError("config and config_params are the same argument (config_params is DeepSpeed's old name); give one")
    if given:
        return given[0]
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is None:
        raise ValueError("config is required: a JSON path or a dict (or args.deepspeed_config, as DeepSpeed)")
    return from_args


def _context_from_env(tp: int, pp: int, cp: int) -> ParallelContext:
    try:
        return ParallelContext.from_env(tp=tp, pp=pp, cp=cp)
    except ValueError as e:  # raised from WORLD_SIZE alone, before any process group
        raise ValueError(f"tensor_parallel.size={tp} × pipeline.stages={pp} × sequence_parallel_size={cp}: {e}") from e


def _is_pipeline_module(model: nn.Module) -> bool:
    from shardkit.deepspeed.pipe import PipelineModule  # the facade's class; imported on use

    return isinstance(model, PipelineModule)


def _pipeline_module_layout(
    module: Any, config: Any, blocks: Any, loss_fn: Any, ctx: ParallelContext | None
) -> tuple[dict[str, Any], BlocksFn, Callable[..., Any], tuple[int, ...]]:
    """A DeepSpeed ``PipelineModule`` as shardkit's pipeline inputs, checked before any collective:
    ``(config with pipeline.stages = num_stages, blocks fn, loss_fn, stage sizes)``.

    The config's ``pipeline`` section may hold DeepSpeed's keys: ``stages`` ("auto" or equal to
    ``num_stages``), ``activation_checkpoint_interval`` (> 0 replaces the module's, as DeepSpeed's
    engine does); ``partition`` ("best", unused by DeepSpeed, or shardkit's name of the module's
    ``partition_method``), ``seed_layers``, ``pipe_partitioned``, ``grad_partitioned`` and
    ``use_reentrant`` have no effect here and are dropped. shardkit's ``schedule`` and
    ``microbatches`` apply.

    Raises:
        ValueError: ``blocks=``/``loss_fn=`` given, a ``pipeline.stages`` or ``pipeline.partition``
            that disagrees with the module (naming both), ``pipeline.virtual_stages`` > 1, or a
            ``num_stages`` that does not divide the world size.

    Example:
        >>> cfg, blocks_fn, loss, sizes = _pipeline_module_layout(net, {"train_batch_size": 8}, None, None, ctx)
        >>> cfg["pipeline"]["stages"], sizes
        (2, (5, 4))
    """
    from shardkit.deepspeed.pipe import PARTITION_METHODS

    n = module.num_stages
    for name, value in (("blocks", blocks), ("loss_fn", loss_fn)):
        if value is not None:
            raise ValueError(
                f"{name}: model is a PipelineModule, which carries its own (its layers and loss_fn); drop initialize({name}=...)"
            )
    raw = load_raw(config)
    section = raw.setdefault("pipeline", {})
    if not isinstance(section, dict):
        raise ValueError(f"pipeline: must be a section (a JSON object), got {section!r}")
    stages = section.get("stages", "auto")
    if stages != "auto" and (isinstance(stages, bool) or stages != n):
        raise ValueError(
            f"pipeline.stages={stages!r} in the config but PipelineModule(num_stages={n}): give one of them, or the same "
            "number (DeepSpeed's default 'auto' takes num_stages)"
        )
    section["stages"] = n
    interval = section.pop("activation_checkpoint_interval", 0)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(f"pipeline.activation_checkpoint_interval must be an int >= 0, got {interval!r}")
    for key in ("seed_layers", "pipe_partitioned", "grad_partitioned", "use_reentrant"):
        section.pop(key, None)  # DeepSpeed's own implementation choices (its engine never reads seed_layers)
    partition = section.pop("partition", "best")
    method = module.partition_method
    if partition != "best" and partition != PARTITION_METHODS.get(method.lower()):
        raise ValueError(
            f"pipeline.partition={partition!r} in the config but PipelineModule(partition_method={method!r}) cuts the "
            "stages: drop pipeline.partition"
        )
    if section.get("virtual_stages", 1) != 1:
        raise ValueError(
            f"pipeline.virtual_stages={section['virtual_stages']!r} with a PipelineModule: it has one stage per rank "
            "(DeepSpeed's); drop virtual_stages or pass the layers as an nn.Sequential"
        )
    if n == 1:
        raise ValueError(
            "PipelineModule(num_stages=1): shardkit's pipeline engine needs >= 2 stages; train a one-stage model as an "
            "nn.Sequential (engine(x), engine.backward, engine.step) or use more stages"
        )
    world = ctx.world_size if ctx is not None else dist.get_world_size() if dist.is_initialized() else None
    if world is not None and world % n:
        raise ValueError(f"PipelineModule(num_stages={n}) must divide the world size {world}")
    block_list, sizes = module.pipeline_blocks(interval if interval > 0 else None)
    return raw, lambda model: block_list, module.loss_fn or _output_is_the_loss, tuple(sizes)


def _output_is_the_loss(outputs: torch.Tensor, labels: Any) -> torch.Tensor:
    """DeepSpeed's pipeline without a ``loss_fn``: the last layer's output is the loss."""
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 0:
        raise ValueError(
            "PipelineModule(loss_fn=None): the last layer's output is the loss and must be a 0-d tensor, got "
            f"{tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__}"
        )
    return outputs


def _repeat(loader: Any) -> Any:
    while True:  # DeepSpeed's RepeatingLoader: train_batch never runs out
        yield from loader


def _check_layout(model: nn.Module, cfg: EngineConfig, tp_plan: Any, blocks: Any, loss_fn: Any) -> dict[str, Any] | None:
    """The TP plan to apply (None without TP), and the tp/pp arguments checked against the config."""
    tp, pp = cfg.tensor_parallel.size, cfg.pipeline.stages
    if tp == 1 and tp_plan is not None:
        raise ValueError("tp_plan: given, but the config's tensor_parallel.size is 1 (set it to the tp group size)")
    if pp == 1:
        for name, value in (("blocks", blocks), ("loss_fn", loss_fn)):
            if value is not None:
                raise ValueError(f"{name}: applies with pipeline.stages > 1 only; the config has pipeline.stages=1")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (outputs, labels) -> loss, got {type(loss_fn).__name__}")
    if tp == 1:
        return None
    plan = tp_plan_for(model, cfg.tensor_parallel, tp_plan)
    plan_modules(model, plan, tp)  # every pattern, style and divisibility, before any collective
    return plan


def _check_sequence_split(model: nn.Module, cfg: EngineConfig, cp_plan: Any, loss_fn: Any = None) -> dict[str, str] | None:
    """The context-parallel plan to apply (None with ``sequence_parallel_size`` 1), checked
    against the model and the rest of the config before any collective."""
    cp = cfg.context_parallel.size
    if cp == 1:
        if cp_plan is not None:
            raise ValueError("cp_plan: given, but the config's sequence_parallel_size is 1 (set it to the cp group size)")
        return None
    if cfg.pipeline.stages > 1 and loss_fn is not None:
        raise ValueError(
            f"sequence_parallel_size={cp} with pipeline.stages={cfg.pipeline.stages} and a loss_fn (a PipelineModule's "
            "loss_fn, or initialize(loss_fn=...)): the pipeline's loss over sequence shards is the token cross-entropy, "
            "whose sum and count add up over the shards; a custom loss cannot be split that way. Leave loss_fn=None"
        )
    plan = cp_plan_for(model, cp_plan)
    cp_plan_modules(model, plan)  # every pattern and style, before any collective
    _check_sequence_split_model(model, cfg)
    return plan


def _check_sequence_split_model(model: nn.Module, cfg: EngineConfig) -> None:
    """What the model's config says about the split, named by the config's keys before any
    collective (the attention would refuse the same at its first forward): heads an all-to-all
    cannot split, attention dropout outside Ulysses."""
    conf, cpc = getattr(model, "config", None), cfg.context_parallel
    where = f"sequence_parallel_size={cpc.size} with context_parallel.mode={cpc.mode!r}"
    heads = getattr(conf, "num_attention_heads", getattr(conf, "n_heads", None))
    if isinstance(heads, int) and cpc.mode in ("ulysses", "hybrid"):
        kv = getattr(conf, "num_key_value_heads", None) or heads
        tp = cfg.tensor_parallel.size
        group = cpc.size if cpc.mode == "ulysses" else cpc.ulysses_size
        assert group is not None  # the config reader requires ulysses_size for hybrid
        try:
            check_ulysses_heads(heads // tp, max(1, kv // tp), group, mode=cpc.mode)
        except ValueError as e:
            raise ValueError(f"{where}: the model's {heads // tp} heads per tp rank: {e}") from None
    for key in ("attn_pdrop", "attention_dropout", "dropout"):
        p = getattr(conf, key, None)
        if isinstance(p, (int, float)) and p > 0 and model.training and cpc.mode != "ulysses":
            raise ValueError(
                f"{where}: the model's config.{key}={p} drops attention weights, which the {cpc.mode} mode's "
                f"blockwise attention does not do; use context_parallel.mode 'ulysses' or set it to 0 (or build "
                f"the model with {key}=0.0)"
            )


def _check_stages_train(model: nn.Module, blocks: Any, cfg: EngineConfig, groups: list[dict[str, Any]]) -> None:
    """Every pipeline stage must hold a parameter the optimizer trains: a rank without one would
    fail alone, after the pipeline's collectives began (the split is a pure function of the blocks,
    so this is checked on every rank before any)."""
    mods = as_block_list(blocks(model) if blocks is not None else model)
    trained = {id(p) for g in groups for p in g["params"]}
    num_stages = cfg.pipeline.stages * cfg.pipeline.virtual_stages
    for s, (idx, stage) in enumerate(split_blocks(mods, num_stages, cfg.pipeline.partition)):
        if not any(id(p) in trained for p in stage.parameters()):
            raise ValueError(
                f"pipeline.stages={cfg.pipeline.stages}: stage {s} (blocks {idx.start}-{idx.stop - 1} of {len(mods)}) has "
                "no parameter to train (frozen, or left out of model_parameters); every stage's rank steps an "
                "optimizer. Move the cut (pipeline.partition, or initialize(blocks=...) grouping the frozen blocks "
                "with trained ones) or use fewer stages"
            )


def _check_supported(cfg: EngineConfig) -> None:
    tp, pp, stage = cfg.tensor_parallel.size, cfg.pipeline.stages, cfg.zero.stage
    fp16 = cfg.precision.dtype == "fp16"
    if tp > 1 and fp16 and stage == 0:
        raise ValueError(
            "fp16.enabled with tensor_parallel.size > 1 needs zero_optimization.stage >= 1 (ZeRO's epilogue agrees "
            "the overflow over dp and tp); use stage 1-3, or bf16/fp32 at stage 0"
        )
    if pp > 1:
        if stage == 3:
            raise ValueError(
                f"zero_optimization.stage=3 with pipeline.stages={pp}: not supported (as in DeepSpeed, whose pipeline "
                "engine takes ZeRO 0-2); use stage 0-2"
            )
        if cfg.zero.offload_optimizer.enabled and stage == 0:
            raise ValueError("zero_optimization.offload_optimizer needs zero_optimization.stage >= 1")
    off = cfg.zero.offload_optimizer
    if off.device == "nvme":
        path = Path(off.nvme_path)
        if not path.is_dir():
            raise ValueError(f"zero_optimization.offload_optimizer.nvme_path {str(path)!r} is not an existing directory")
    param_off = cfg.zero.offload_param
    if param_off.enabled and not off.enabled:
        # the host copy of a parameter shard is the optimizer's host master: both go off the device
        raise ValueError(
            f"zero_optimization.offload_param.device={param_off.device!r} needs zero_optimization.offload_optimizer."
            "device 'cpu' or 'nvme' too (shardkit keeps the parameter shards next to the offloaded fp32 masters)"
        )
    if param_off.device == "nvme":
        warnings.warn(
            "zero_optimization.offload_param.device='nvme': the parameter shards are kept in host memory, not in "
            "files (offload_param.nvme_path is not used); offload_optimizer's nvme applies to the optimizer state",
            UserWarning,
            stacklevel=3,
        )


def _is_scheduler(obj: Any) -> bool:
    return hasattr(obj, "step") and hasattr(obj, "state_dict") and not isinstance(obj, type)


def _check_scheduler(lr_scheduler: Any, optimizer: Any) -> None:
    if lr_scheduler is None:
        return
    if _is_scheduler(lr_scheduler):
        if not isinstance(optimizer, torch.optim.Optimizer) or getattr(lr_scheduler, "optimizer", None) is not optimizer:
            raise TypeError(
                "lr_scheduler: a built scheduler must be over the optimizer passed as optimizer= (the engine builds "
                "its own otherwise); pass a callable optimizer -> scheduler instead"
            )
    elif not callable(lr_scheduler):
        raise TypeError(f"lr_scheduler must be None, a scheduler or a callable optimizer -> scheduler, got {lr_scheduler!r}")


# ---- the optimizer -----------------------------------------------------------------------------
# [Note: a built optimizer, rebuilt]
# DeepSpeed scripts build their optimizer (``AdamW(model.parameters(), lr=...)``, DeepSpeed's
# ``FusedAdam``) and pass it to ``initialize``, which wraps it. Where the config asks for a layout
# the built object cannot step as it is (ZeRO >= 1: the optimizer must hold this rank's flat
# shards; fp16/bf16: fp32 masters; tensor/pipeline parallelism: other parameters), shardkit
# rebuilds it: the same class, its ``defaults`` as keyword arguments (those its constructor
# takes), and its ``param_groups`` with their options (per-group lr, weight decay) as the groups.
# The returned optimizer is the one that steps; a built LR scheduler over the original is pointed
# at it. An optimizer that has already stepped is refused: its state has no place on the shards.
def _optimizer_factory(cfg: EngineConfig, optimizer: Any, model: nn.Module) -> Callable[..., Any]:
    """``make(groups, zero: bool) -> (class, kwargs)`` for ZeroOptimizer, or a built optimizer."""
    low = cfg.precision.dtype != "fp32"
    if isinstance(optimizer, torch.optim.Optimizer):  # its params were checked with its groups (initialize)
        if cfg.tensor_parallel.size == 1 and cfg.pipeline.stages == 1 and cfg.zero.stage == 0 and not low:
            return lambda groups: (None, optimizer)  # it steps the model's own parameters as built
        # [Note: a built optimizer, rebuilt]
        if any(optimizer.state.values()):
            raise TypeError(
                f"optimizer: the built {type(optimizer).__name__} has already stepped; its state cannot be moved onto "
                f"the layout the config asks for (zero_optimization.stage={cfg.zero.stage}, {cfg.precision.dtype}, "
                f"tensor_parallel.size={cfg.tensor_parallel.size}, pipeline.stages={cfg.pipeline.stages}): pass it "
                "before its first step, or its class"
            )
        cls = type(optimizer)
        accepted = inspect.signature(cls).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
        if low and cls.__module__.startswith("torch.optim") and cfg.zero.stage == 0:
            raise TypeError(
                f"optimizer: a built {cls.__name__} with {cfg.precision.dtype} at zero_optimization.stage 0 keeps no "
                "fp32 master weights; use ZeRO >= 1 (which keeps them), a shardkit fused optimizer, or fp32"
            )
        if low and cfg.zero.stage == 0 and "master_weights" in accepted:
            kwargs["master_weights"] = True  # replicated low precision: the optimizer keeps the fp32 masters
        logger.info(
            "initialize: the built %s is rebuilt from its class, defaults and param groups on the layout the "
            "config asks for; step the optimizer initialize returns",
            cls.__name__,
        )
        return lambda groups: (cls, kwargs)
    if optimizer is None:
        if cfg.optimizer is None:
            raise ValueError("optimizer: the config has no 'optimizer' section and initialize got no optimizer=")
        cls, kwargs = cfg.optimizer.optimizer_class(), dict(cfg.optimizer.params)
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        cls, kwargs = optimizer, {}
    elif isinstance(optimizer, functools.partial) and isinstance(optimizer.func, type) and not optimizer.args:
        cls, kwargs = optimizer.func, dict(optimizer.keywords)
    elif callable(optimizer):
        cls, kwargs = _from_callable(optimizer), {}
    else:
        raise TypeError(f"optimizer must be None, an optimizer class or a callable params -> optimizer, got {optimizer!r}")
    if optimizer is not None and cfg.optimizer is not None:
        logger.warning("initialize: optimizer= given; the config's optimizer section (%s) is not used", cfg.optimizer.type)
    if low and cfg.zero.stage == 0:
        # ZeRO keeps fp32 masters itself; replicated training needs the optimizer's own
        if "master_weights" in inspect.signature(cls).parameters:
            kwargs.setdefault("master_weights", True)
        else:
            warnings.warn(
                f"{cls.__name__} has no master_weights: with {cfg.precision.dtype} at zero_optimization.stage 0 it "
                "updates the low-precision parameters directly (use a shardkit fused optimizer or ZeRO >= 1)",
                UserWarning,
                stacklevel=4,
            )
    return lambda groups: (cls, kwargs)


def _rebind_scheduler(sched: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point a built LR scheduler at the optimizer that replaced the one it was built over (see
    [Note: a built optimizer, rebuilt]): its groups carry the same ``lr``/``initial_lr``, and its
    ``step`` is marked as torch's schedulers mark the optimizer they are built over (else the
    scheduler's first step warns that ``optimizer.step`` was overridden)."""
    sched.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def marked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    marked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked  # type: ignore[method-assign]


def _from_callable(fn: Callable[..., Any]) -> type:
    """A class whose construction is ``fn(params)``: ZeroOptimizer builds its optimizer from a
    class, over this rank's shard parameters."""

    class ClientOptimizer(torch.optim.Optimizer):
        def __new__(cls, params: Any, **kwargs: Any) -> Any:  # noqa: ARG004 - ZeroOptimizer passes no kwargs
            opt = fn(params)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizer: the callable returned {type(opt).__name__}, not a torch.optim.Optimizer")
            return opt

    ClientOptimizer.__qualname__ = ClientOptimizer.__name__ = getattr(fn, "__name__", "ClientOptimizer")
    return ClientOptimizer


# ---- building ----------------------------------------------------------------------------------
def _to_device_and_dtype(model: nn.Module, ctx: ParallelContext, cfg: EngineConfig) -> nn.Module:
    if ctx.device.type != "cpu":
        model.to(ctx.device)
    if cfg.precision.dtype == "fp16":
        model.half()  # as DeepSpeed: the whole module, buffers included
    elif cfg.precision.dtype == "bf16":
        model.bfloat16()
    return model


def build_parallel(
    model: nn.Module,
    ctx: ParallelContext,
    cfg: EngineConfig,
    *,
    scaler: DynamicLossScaler | None,
    groups: list[dict[str, Any]],
    make: Callable[..., Any],
    tp_plan: dict[str, Any] | None,
    blocks: BlocksFn | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    cp_plan: dict[str, str] | None = None,
) -> tuple[ParallelModel, Any]:
    """The config's layout through :func:`~shardkit.parallel.parallelize` (its TP plan, cp plan,
    pipeline and ZeRO stage on the dp axis), and the optimizer over this rank's parameters, the user's param
    groups kept by name across TP and the pipeline split.

    Returns:
        ``(parallel model, optimizer)``: a :class:`~shardkit.parallel.zero.ZeroOptimizer` for
        stages 1-3.
    """
    pipe, zero = cfg.pipeline, cfg.zero
    named = groups_by_name(model, groups) if tp_plan is not None or pipe.stages > 1 else None
    if zero.stage == 0:
        options: dict[str, Any] = {"bucket_mb": zero.bucket_mb(cfg.precision.grad_bytes)}
    else:
        # ZeRO reduces and keeps gradients in fp32 whatever the params' dtype: reduce_bucket_size
        # elements are 4 bytes each
        options = {"bucket_mb": zero.bucket_mb(4), "offload": zero.offload}
        if zero.offload == "nvme":
            options["nvme_dir"] = zero.offload_optimizer.nvme_path
        if zero.stage == 3:
            options["offload_params"] = zero.offload_param.enabled  # the config reader checks stage 3
            # DeepSpeed prefetches stage-3 parameters ahead of use while stage3_prefetch_bucket_size > 0
            options["forward_prefetch"] = zero.prefetch_bucket_size > 0
            if zero.hpz_partition_size > 1:  # ZeRO++'s hpZ: [Note: hierarchical gathers]
                options["reshard_after_forward"] = zero.hpz_partition_size
    pp = None
    if pipe.stages > 1:
        pp = PipelineOptions(
            microbatches=pipe.microbatches, schedule=pipe.schedule, virtual_stages=pipe.virtual_stages, split=pipe.partition
        )
    par = parallelize(
        model,
        ctx,
        loss_fn=loss_fn,
        tp_plan=tp_plan,
        pp=pp,
        dp=dp_strategy_of_zero_stage(zero.stage),
        blocks=blocks,
        loss_scaler=scaler,
        dp_options=options,
        fused_cross_entropy=cfg.fused_cross_entropy.enabled,
        cp=None
        if cp_plan is None
        else {
            "plan": cp_plan,
            "mode": cfg.context_parallel.mode,
            "layout": cfg.context_parallel.layout,
            "ulysses_size": cfg.context_parallel.ulysses_size,
        },
    )
    for head in par.fused_heads:
        head.chunk_tokens = cfg.fused_cross_entropy.chunk_tokens
    if tp_plan is not None and pp is None and cfg.tensor_parallel.gather_logits:
        gather_head_logits(model, ctx)
    if named is not None:  # TP replaced the dense Parameters, the pipeline kept this rank's stages
        groups = regroup(model, named, keep=par.parameters() if pp is not None else None)
    cls, kwargs = make(groups)
    if cls is None:  # a built optimizer (stage 0, no tp/pp: its params are the model's own)
        return par, kwargs
    return par, par.make_optimizer(cls, groups, **kwargs)


def _dataloader(dataset: Any, collate_fn: Any, cfg: EngineConfig, ctx: ParallelContext, *, shuffle: bool = True) -> Any:
    """DeepSpeed's DeepSpeedDataLoader: a DistributedSampler share per dp rank, micro-batches.
    Shuffled (the sampler's seed 0, epoch never advanced) as DeepSpeed's ``deepspeed_io``, or in
    order (``shuffle=False``) as its pipeline engine's ``_build_data_iter``."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=ctx.size("dp"), rank=ctx.rank("dp"), shuffle=shuffle)
    return DataLoader(dataset, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler, collate_fn=collate_fn)
