"""DeepSpeed-style JSON configs -> :class:`~shardkit.engine.resolved.EngineConfig`.

``load_config`` reads the keys of DeepSpeed's config (docs/engine.md has the full table: what
each key means here, which are ignored, which are errors), fills ``"auto"`` values from its
keyword arguments the way Hugging Face's Trainer/Accelerate do, and checks DeepSpeed's batch-size
rule (docs/reference.md, "DeepSpeed LR schedules": any two of the batch triple determine the
third). Every failure is a ``ValueError`` naming the dotted key, raised before anything touches
``torch.distributed`` (this module never imports it). The tables of keys accepted without effect
are in :mod:`~shardkit.engine.deepspeed_keys`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardkit.examples import EXAMPLE_CONFIGS, config_path

from ._reader import BATCH_PAIR, MISSING, Reader, UnfilledAutoError, to_bool, to_float, to_int
from .deepspeed_keys import (
    DATA_EFFICIENCY_SWITCHES,
    IGNORED_KEYS,
    IGNORED_REASONS,
    ONE_BIT_OPTIMIZERS,
    TORCH_AUTOCAST_DTYPES,
    UNSUPPORTED_KEYS,
)
from .resolved import (
    CP_MODES,
    ContextParallelConfig,
    EngineConfig,
    LossScaleConfig,
    OffloadConfig,
    OptimizerConfig,
    FusedCrossEntropyConfig,
    PipelineConfig,
    PrecisionConfig,
    TP_PLANS,
    SchedulerConfig,
    TensorParallelConfig,
    ZeroConfig,
    _frozen,
)
from .schedulers import SCHEDULERS

__all__ = ["IGNORED_KEYS", "UnfilledAutoError", "describe_ignored", "load_config", "load_raw"]

logger = logging.getLogger("shardkit.engine")

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # shardkit.parallel.pipeline.SCHEDULES

_INT_SCHED = {"warmup_num_steps", "total_num_steps", "cycle_first_step_size", "cycle_second_step_size",
              "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "last_batch_iteration",
              "lr_range_test_step_size"}  # fmt: skip
_BOOL_SCHED = {"cycle_momentum", "lr_range_test_staircase"}
_FLOAT_SCHED = {"lr_range_test_step_rate"}
#: scheduler params an "auto" may take from another keyword, as HF's Trainer/Accelerate fill them
_SCHED_AUTO = {"warmup_max_lr": ("warmup_max_lr", "lr"), "cycle_max_lr": ("cycle_max_lr", "lr")}


def _positive(v: Any) -> bool:
    return v > 0


def _nonneg(v: Any) -> bool:
    return v >= 0


def _lr_value(key: str, value: Any) -> float | list[float]:
    """A scheduler bound: a number, or one per param group."""
    if isinstance(value, (list, tuple)):
        return [to_float(f"{key}[{i}]", v) for i, v in enumerate(value)]
    return to_float(key, value)


def _betas(key: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{key}: expected [beta1, beta2], got {value!r}")
    return (to_float(f"{key}[0]", value[0]), to_float(f"{key}[1]", value[1]))


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected a string, got {value!r}")
    return value


def load_raw(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The config as a fresh dict: a JSON file read (duplicate keys refused) or a dict deep-copied."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))  # a deep, JSON-clean copy: the caller's dict is never changed

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:  # json would keep the last silently; DeepSpeed refuses too
            raise ValueError(f"config: duplicate key(s) {dup}")
        return dict(pairs)

    path = Path(config)
    if not path.is_file() and path.name == str(config) and path.name in EXAMPLE_CONFIGS:
        path = config_path(path.name)  # a shipped example, named without a directory
    if not path.is_file():
        raise ValueError(
            f"config: {str(config)!r} is not a file (pass a path to a JSON file, a dict, or the name of a "
            f"shipped example: {', '.join(EXAMPLE_CONFIGS)})"
        )
    try:
        return json.loads(path.read_text(), object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"config: {path} is not valid JSON: {e}") from None


def _batch(r: Reader, dp: int) -> tuple[int, int, int]:
    """DeepSpeed's ``_set_batch_related_parameters`` + ``_batch_assertion``, with named errors.

    An "auto" batch key is taken from the keyword of the same name, else derived from the other
    two like an absent key (HF's Trainer computes it the same way).
    """
    given = {k: r.get(k, to_int, None, auto_fallback=None, check=_positive, must="be > 0") for k in BATCH_KEYS}
    train, micro, gas = (given[k] for k in BATCH_KEYS)
    if train is None and micro is None and (r.is_auto("train_batch_size") or r.is_auto("train_micro_batch_size_per_gpu")):
        # recorded with the other unfilled "auto"s; read on with one row per rank
        r.report.add_missing(BATCH_PAIR, ["train_micro_batch_size_per_gpu", "train_batch_size"])
        micro = 1
        gas = gas if gas is not None else 1
        train = micro * gas * dp
    if train is not None and micro is not None and gas is None:
        gas = train // micro // dp
    elif train is not None and gas is not None and micro is None:
        micro = train // dp // gas
    elif micro is not None and gas is not None and train is None:
        train = micro * gas * dp
    elif train is not None and micro is None and gas is None:
        gas, micro = 1, train // dp
    elif micro is not None and train is None and gas is None:
        gas, train = 1, micro * dp
    elif train is None and micro is None:
        raise ValueError(
            'train_batch_size or train_micro_batch_size_per_gpu must be given (a number, or "auto" with '
            "train_batch_size=... / train_micro_batch_size_per_gpu=... passed to load_config)"
        )
    if micro < 1 or gas < 1 or train != micro * gas * dp:
        shown = ", ".join(
            f"{k}={v}{'' if given[k] is not None else ' (derived)'}" for k, v in zip(BATCH_KEYS, (train, micro, gas))
        )
        raise ValueError(
            f"batch sizes are inconsistent: {shown}; DeepSpeed requires train_batch_size = "
            f"train_micro_batch_size_per_gpu × gradient_accumulation_steps × data-parallel size ({dp})"
        )
    return train, micro, gas


def _unsupported(r: Reader, group: str) -> None:
    for key, default in UNSUPPORTED_KEYS[group].items():
        r.unsupported(key, default, to_bool if isinstance(default, bool) else to_float if isinstance(default, float) else to_int)


def _autocast_dtype(key: str, value: Any) -> str:
    """A ``torch_autocast.dtype`` as DeepSpeed spells it -> "fp16", "fp32", "int8" or "bf16"."""
    text = value.strip().lower() if isinstance(value, str) else value
    for name, spellings in TORCH_AUTOCAST_DTYPES.items():
        if text in spellings:
            return name
    names = [s for spellings in TORCH_AUTOCAST_DTYPES.values() for s in spellings]
    raise ValueError(f"{key} must be one of {names}, got {value!r}")


def _module_names(key: str, value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f'{key}: expected a list of module class names ("torch.nn.Linear", ...), got {value!r}')
    return list(value)


def _torch_autocast(r: Reader, stages: int) -> str | None:
    """``torch_autocast``: DeepSpeed's ``torch.autocast`` around the engine's forward.

    Enabled, it needs ``dtype`` bfloat16: DeepSpeed pairs fp16 autocast with a
    ``torch.amp.GradScaler`` the engine does not apply to fp32 parameters, and no dtype means the
    device's default (fp16 on CUDA). The ``fp16``/``bf16`` sections combine with it as in DeepSpeed
    (the parameters in that dtype, the forward autocast on top).
    """
    if not r.has("torch_autocast"):
        return None
    t = r.section("torch_autocast")
    enabled = t.get("enabled", to_bool, False)
    dtype = t.get("dtype", _autocast_dtype, None)  # DeepSpeed checks both even when disabled
    t.get("lower_precision_safe_modules", _module_names, None)
    if not enabled:
        t.ignore("dtype", "lower_precision_safe_modules", report=False)
        r.report.add_ignored("torch_autocast")
        return None
    if dtype is None:
        raise ValueError(
            'torch_autocast.dtype is required with torch_autocast.enabled=true: give "bfloat16" (DeepSpeed falls back '
            "to the device's autocast default, float16 on CUDA, which needs a gradient scaler)"
        )
    if dtype == "fp16":
        raise ValueError(
            f"torch_autocast.dtype={t.raw('dtype')!r}: float16 autocast needs a gradient scaler (DeepSpeed adds a "
            'torch.amp.GradScaler), which shardkit\'s engine does not apply to fp32 parameters; use "bfloat16", or the '
            '"fp16" section instead (fp16 parameters with dynamic loss scaling)'
        )
    if dtype != "bf16":
        raise ValueError(f'torch_autocast.dtype={t.raw("dtype")!r} is no lower precision to autocast to; use "bfloat16"')
    if stages > 1:
        raise ValueError(
            f"torch_autocast.enabled with pipeline.stages={stages}: the pipeline runs its stages without autocast; use "
            'the "bf16" section (bf16 parameters) instead, or pipeline.stages=1'
        )
    t.ignore("lower_precision_safe_modules")  # reported: the gradients of those modules are reduced in fp32 here
    return "bf16"


def _hybrid_engine(r: Reader) -> None:
    """``hybrid_engine`` (DeepSpeed-Chat's train/generate engine): accepted only disabled."""
    if not r.has("hybrid_engine"):
        return
    h = r.section("hybrid_engine")
    if h.get("enabled", to_bool, False):
        raise ValueError(
            "hybrid_engine.enabled=true: DeepSpeed's hybrid engine (RLHF: the training model switched into an "
            "inference engine to generate) is not offered by shardkit; generate with the model itself (engine.module, "
            "or a copy loaded from engine.full_state_dict() at ZeRO stage 3) and set hybrid_engine.enabled false"
        )
    h.ignore(*IGNORED_KEYS["hybrid_engine"], report=False)
    r.report.add_ignored("hybrid_engine")


def _data_efficiency(r: Reader) -> None:
    """``data_efficiency`` (curriculum learning, dynamic batching, random-LTD): accepted only with
    every on-switch false; its other keys are then unused (DeepSpeed reads them as they are)."""
    if not r.has("data_efficiency"):
        return
    section = r.raw("data_efficiency")
    for path in DATA_EFFICIENCY_SWITCHES:
        *parents, leaf = path.split(".")
        node, dotted = section, "data_efficiency"
        for part in parents:
            if not isinstance(node, Mapping):
                break
            node, dotted = node.get(part), f"{dotted}.{part}"
        if node is None:
            continue
        if not isinstance(node, Mapping):
            raise ValueError(f"{dotted}: expected an object, got {type(node).__name__}")
        if to_bool(f"{dotted}.{leaf}", node.get(leaf, False)):
            raise ValueError(
                f"{dotted}.{leaf}=true: DeepSpeed's data efficiency library (curriculum learning, dynamic batching, "
                "random-LTD token dropping) is not offered by shardkit; order or size the batches in your own "
                f"DataLoader, and set {dotted}.{leaf} false"
            )
    r.report.add_ignored("data_efficiency")


def _precision(r: Reader) -> PrecisionConfig:
    fp16 = r.section("fp16")
    if r.has("bf16") and r.has("bfloat16"):
        raise ValueError("bf16 and bfloat16: give one of the two (bfloat16 is DeepSpeed's old name)")
    bf16 = r.section("bfloat16" if r.has("bfloat16") else "bf16")
    fp16_on = fp16.get("enabled", to_bool, False, auto=["fp16"])
    bf16_on = bf16.get("enabled", to_bool, False, auto=["bf16"])
    if fp16_on and bf16_on:
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable one of them")
    scaler = LossScaleConfig(
        loss_scale=fp16.get("loss_scale", to_float, 0.0, check=_nonneg, must="be >= 0 (0 = dynamic)"),
        initial_scale_power=fp16.get("initial_scale_power", to_int, 16),
        loss_scale_window=fp16.get("loss_scale_window", to_int, 1000, check=_positive, must="be >= 1"),
        hysteresis=fp16.get("hysteresis", to_int, 2, check=_positive, must="be >= 1"),
        consecutive_hysteresis=fp16.get("consecutive_hysteresis", to_bool, False),
        min_loss_scale=fp16.get("min_loss_scale", to_float, 1.0, check=_positive, must="be > 0"),
    )
    _unsupported(fp16, "fp16")
    bf16.ignore(*IGNORED_KEYS["bf16"])
    _unsupported(bf16, "bf16")
    if fp16_on:
        return PrecisionConfig("fp16", scaler)
    return PrecisionConfig("bf16" if bf16_on else "fp32")


def _optimizer(r: Reader) -> OptimizerConfig | None:
    if not r.has("optimizer"):
        return None
    o = r.section("optimizer")
    kind = o.get("type", _string, None)
    if kind is None:
        raise ValueError("optimizer.type is missing (one of Adam, AdamW, SGD, Lion, LAMB)")
    p = o.section("params")
    name = kind.lower()

    def common(lr: float = 1e-3, wd: float = 0.0) -> dict[str, Any]:
        return {
            "lr": p.get("lr", to_float, lr, check=_nonneg, must="be >= 0"),
            "weight_decay": p.get("weight_decay", to_float, wd, check=_nonneg, must="be >= 0"),
        }

    if name in ("adam", "adamw"):
        # DeepSpeed: "AdamW" always decouples weight decay; "Adam" does too unless adam_w_mode is false
        w_mode = p.get("adam_w_mode", to_bool, True) or name == "adamw"
        # torch_adam: DeepSpeed builds torch.optim.AdamW / Adam from the params as given, so an
        # absent weight_decay is torch's default (AdamW 0.01, Adam 0); its own Adams default to 0
        torch_adam = p.get("torch_adam", to_bool, False)
        kw = common(wd=0.01 if torch_adam and w_mode else 0.0)
        kw["betas"] = p.get("betas", _betas, (0.9, 0.999))
        kw["eps"] = p.get("eps", to_float, 1e-8, check=_nonneg, must="be >= 0")
        kw["amsgrad"] = p.get("amsgrad", to_bool, False)
        if not p.get("bias_correction", to_bool, True):
            raise ValueError("optimizer.params.bias_correction=false is not supported (shardkit's Adam always corrects)")
        p.ignore(*IGNORED_KEYS["adam"])
        return OptimizerConfig(kind, "FusedAdamW" if w_mode else "FusedAdam", _frozen(kw))
    if name == "sgd":
        kw = common()
        kw["momentum"] = p.get("momentum", to_float, 0.0, check=_nonneg, must="be >= 0")
        kw["dampening"] = p.get("dampening", to_float, 0.0)
        kw["nesterov"] = p.get("nesterov", to_bool, False)
        return OptimizerConfig(kind, "FusedSGD", _frozen(kw))
    if name == "lion":
        kw = common()
        kw["betas"] = p.get("betas", _betas, (0.9, 0.999))  # DeepSpeed's FusedLion default, not (0.9, 0.99)
        return OptimizerConfig(kind, "FusedLion", _frozen(kw))
    if name == "lamb":
        kw = common()
        kw["betas"] = p.get("betas", _betas, (0.9, 0.999))
        kw["eps"] = p.get("eps", to_float, 1e-8, check=_nonneg, must="be >= 0")
        kw["bias_correction"] = p.get("bias_correction", to_bool, True)
        # DeepSpeed clamps the trust ratio to [min_coeff, max_coeff]; shardkit bounds it above only
        kw["max_trust_ratio"] = p.get("max_coeff", to_float, 10.0, check=_positive, must="be > 0")
        kw["weight_norm_clip"] = (0.0, float("inf"))  # DeepSpeed (like Apex) does not clamp ||w||
        p.ignore("min_coeff")
        _unsupported(p, "lamb")
        return OptimizerConfig(kind, "FusedLAMB", _frozen(kw))
    if name in ONE_BIT_OPTIMIZERS:
        instead, only, differs = ONE_BIT_OPTIMIZERS[name]
        raise ValueError(
            f"optimizer.type={kind!r}: DeepSpeed's 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) compress the "
            "gradient communication after their warm-up (freeze_step), which shardkit does not implement (DeepSpeed "
            f'0.19.8 no longer ships them either); use "type": "{instead}", the update of their warm-up, with '
            f"uncompressed communication throughout, and drop {', '.join(only)} from optimizer.params"
            + (f" ({differs}, so the first steps' numbers differ)" if differs else "")
        )
    raise ValueError(f"optimizer.type must be one of Adam, AdamW, SGD, Lion, LAMB (any case), got {kind!r}")


def _scheduler(r: Reader) -> SchedulerConfig | None:
    if not r.has("scheduler"):
        return None
    s = r.section("scheduler")
    kind = s.get("type", _string, None)
    if kind not in SCHEDULERS:
        raise ValueError(f"scheduler.type must be one of {sorted(SCHEDULERS)}, got {kind!r}")
    p = s.section("params")
    names = [n for n in inspect.signature(SCHEDULERS[kind]).parameters if n != "optimizer"]
    kw: dict[str, Any] = {}
    for n in names:
        convert = (
            to_int
            if n in _INT_SCHED
            else to_bool
            if n in _BOOL_SCHED
            else to_float
            if n in _FLOAT_SCHED
            else _string
            if n == "warmup_type"
            else _lr_value
        )
        # HF's Trainer and Accelerate fill warmup_min_lr "auto" with 0 (it is no training argument)
        fallback = 0.0 if n == "warmup_min_lr" else MISSING
        value = p.get(n, convert, MISSING, auto=_SCHED_AUTO.get(n, (n,)), auto_fallback=fallback)
        if value is not MISSING:
            kw[n] = value
    for n in ("warmup_num_steps", "total_num_steps", "cycle_first_step_size", "lr_range_test_step_size"):
        if n in kw and kw[n] <= 0:
            raise ValueError(f"scheduler.params.{n} must be > 0, got {kw[n]}")
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in kw:
        raise ValueError(f"scheduler.params.total_num_steps is required by {kind}")
    if kind == "OneCycle" and not {"cycle_min_lr", "cycle_max_lr"} <= set(kw):
        raise ValueError("scheduler.params.cycle_min_lr and cycle_max_lr are required by OneCycle")
    if kw.get("warmup_type", "log") not in ("log", "linear"):
        raise ValueError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {kw['warmup_type']!r}")
    return SchedulerConfig(kind, _frozen(kw))


def _offload(z: Reader, key: str, stage: int) -> OffloadConfig:
    o = z.section(key)
    device = o.choice("device", ("none", "cpu", "nvme"), "none")
    nvme_path = o.get("nvme_path", _string, None)
    if device == "nvme" and not nvme_path:
        raise ValueError(f"zero_optimization.{key}.nvme_path is required with device 'nvme'")
    cfg = OffloadConfig(device, nvme_path, o.get("pin_memory", to_bool, True), o.get("buffer_count", to_int, None))
    o.ignore(*IGNORED_KEYS["offload"])
    if key == "offload_optimizer":
        _unsupported(o, "offload_optimizer")
    need = 3 if key == "offload_param" else 1
    if cfg.enabled and stage < need:
        raise ValueError(f"zero_optimization.{key}.device={device!r} needs zero_optimization.stage >= {need}, got {stage}")
    return cfg


def _aliased(z: Reader, names: tuple[str, ...]) -> str:
    """The one of DeepSpeed's alias names the config uses (the first when none)."""
    used = [n for n in names if z.has(n)]
    if len(used) > 1:
        raise ValueError(f"zero_optimization: {' and '.join(used)} name the same setting; give one")
    return used[0] if used else names[0]


def _zero(r: Reader, dp_cp: int) -> ZeroConfig:
    z = r.section("zero_optimization")
    stage = z.get("stage", to_int, 0, check=lambda v: 0 <= v <= 3, must="be 0, 1, 2 or 3")
    hidden = z.auto_values.get("hidden_size")
    h = to_int("hidden_size", hidden) if hidden is not None else None

    def sized(names: tuple[str, ...], default: int, from_hidden: Any = None) -> int:
        key = _aliased(z, names)
        # HF transformers' trainer_config_finalize (integrations/deepspeed.py): reduce_bucket_size =
        # hidden², stage3_prefetch_bucket_size = int(0.9·hidden²), stage3_param_persistence_threshold =
        # 10·hidden (HF fills the last two for stage 3 only; below it they are unused here)
        fallback = from_hidden(h) if (from_hidden is not None and h is not None) else MISSING
        hint = "hidden_size" if from_hidden is not None else ""
        return z.get(key, to_int, default, auto=names, auto_fallback=fallback, auto_hint=hint, check=_nonneg, must="be >= 0")

    cfg = ZeroConfig(
        stage=stage,
        offload_optimizer=_offload(z, "offload_optimizer", stage),
        offload_param=_offload(z, "offload_param", stage),
        reduce_bucket_size=sized(("reduce_bucket_size",), 500_000_000, lambda h: h * h),
        allgather_bucket_size=sized(("allgather_bucket_size",), 500_000_000),
        overlap_comm=z.get("overlap_comm", to_bool, stage == 3),  # DeepSpeed: on by default for stage 3 only
        contiguous_gradients=z.get("contiguous_gradients", to_bool, True),
        sub_group_size=sized(("sub_group_size",), 1_000_000_000),
        prefetch_bucket_size=sized(
            ("stage3_prefetch_bucket_size", "prefetch_bucket_size"), 50_000_000, lambda h: int(0.9 * h * h)
        ),
        param_persistence_threshold=sized(
            ("stage3_param_persistence_threshold", "param_persistence_threshold"), 100_000, lambda h: 10 * h
        ),
        max_live_parameters=sized(("stage3_max_live_parameters", "max_live_parameters"), 1_000_000_000),
        max_reuse_distance=sized(("stage3_max_reuse_distance", "max_reuse_distance"), 1_000_000_000),
        gather_16bit_weights_on_model_save=z.get(
            _aliased(
                z,
                (
                    "stage3_gather_16bit_weights_on_model_save",
                    "gather_16bit_weights_on_model_save",
                    "stage3_gather_fp16_weights_on_model_save",
                ),
            ),
            to_bool,
            False,
        ),
    )
    if cfg.reduce_bucket_size == 0:
        raise ValueError("zero_optimization.reduce_bucket_size must be > 0")
    # ZeRO++'s hpZ: the backward's gathers inside blocks of this many dp ranks (ShardedDataParallel's
    # reshard_after_forward=int); 1 (DeepSpeed's default) is off
    hpz = z.get("zero_hpz_partition_size", to_int, 1, check=_positive, must="be >= 1")
    if hpz > 1 and stage != 3:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size={hpz} needs zero_optimization.stage 3, got {stage}")
    if dp_cp % hpz:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size={hpz} must divide the data-parallel size {dp_cp} "
            "(e.g. the data-parallel ranks per machine)"
        )
    cfg = dataclasses.replace(cfg, hpz_partition_size=hpz)
    z.ignore(*IGNORED_KEYS["zero_optimization"])
    _unsupported(z, "zero_optimization")
    return cfg


def load_config(
    config: str | Path | Mapping[str, Any],
    *,
    world_size: int,
    strict: bool = True,
    log_ignored: bool = True,
    **auto_values: Any,
) -> EngineConfig:
    """Parse and validate a DeepSpeed-style config; fill its "auto" values.

    Args:
        config: a path to a JSON file, or the dict itself (never modified).
        world_size: ranks in the job; the data-parallel size is ``world_size / (tensor_parallel.size
            × pipeline.stages × sequence_parallel_size)``.
        strict: unknown keys raise (True) or warn, one warning per key (False).
        log_ignored: log the keys accepted without effect (False: a caller that reports
            ``.ignored`` itself, or only validates before the run that will log them).
        **auto_values: what ``"auto"`` stands for, by the key's own name (``lr``, ``weight_decay``,
            ``betas``, ``eps``, ``warmup_num_steps``, ``total_num_steps``, ``train_batch_size``,
            ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
            ``gradient_clipping``, ``fp16``, ``bf16``, ...) plus ``hidden_size`` for the bucket sizes.

    Returns:
        The resolved :class:`EngineConfig`. Keys accepted without effect are in ``.ignored`` and
        logged once, in one line.

    Raises:
        UnfilledAutoError: (a ValueError) naming every ``"auto"`` nothing fills, each with the
            keywords that would fill it, in one message.
        ValueError: naming the dotted key: an unknown key (strict), an inconsistent batch
            triple, nvme offload without ``nvme_path``, a feature not offered (e.g.
            ``hybrid_engine.enabled``), a bad value.

    Example:
        >>> cfg = load_config("ds_config.json", world_size=2, lr=2e-5, weight_decay=0.0,
        ...                   warmup_num_steps=100, total_num_steps=1000, gradient_clipping=1.0,
        ...                   train_micro_batch_size_per_gpu=8)
        >>> cfg.zero.stage, cfg.precision.dtype, cfg.train_batch_size
        (2, 'fp16', 16)
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    data = load_raw(config)
    r = Reader(data, auto_values)
    try:
        cfg = _read(r, world_size, data)
    except ValueError as e:
        if r.report.missing:  # it may follow from the defaults the unfilled "auto"s were read as
            raise UnfilledAutoError(r.report.missing, after=str(e)) from e
        raise
    if r.report.missing:
        raise UnfilledAutoError(r.report.missing)

    unknown = r.unread()
    if unknown:
        lines = [f"{key}" + (f" (did you mean {near[0]!r}?)" if near else "") for key, near in unknown]
        if strict:
            raise ValueError("unknown config key(s): " + "; ".join(lines) + " (strict=False warns instead)")
        for line in lines:
            warnings.warn(f"unknown config key {line}: ignored", UserWarning, stacklevel=2)
    ignored = tuple(r.report.ignored)
    if ignored and log_ignored:
        logger.warning("config keys accepted but ignored by shardkit: %s", describe_ignored(ignored))
    return dataclasses.replace(cfg, ignored=ignored)


def describe_ignored(keys: tuple[str, ...] | list[str]) -> str:
    """The ignored keys as one line, each section accepted only disabled with the reason.

    Example:
        >>> describe_ignored(("steps_per_print", "hybrid_engine"))
        'steps_per_print, hybrid_engine (disabled; the RLHF generation engine is not offered)'
    """
    return ", ".join(f"{k} ({IGNORED_REASONS[k]})" if k in IGNORED_REASONS else k for k in keys)


def _context_parallel(r: Reader) -> ContextParallelConfig:
    """DeepSpeed's top-level ``sequence_parallel_size`` (the ranks that split each sequence; its
    data-parallel size is world / sequence_parallel_size, as here) and shardkit's
    ``context_parallel`` section: ``mode`` and ``layout`` (docs/engine.md, "Long sequences")."""
    size = r.get("sequence_parallel_size", to_int, 1, check=_positive, must="be >= 1")
    sec = r.section("context_parallel")
    mode = sec.choice("mode", CP_MODES, "ulysses")
    layout = sec.choice("layout", ("zigzag", "contiguous"), "zigzag")
    ulysses = sec.get("ulysses_size", to_int, None, check=_positive, must="be >= 1")
    if mode == "hybrid" and (ulysses is None or size % ulysses):
        raise ValueError(
            f"context_parallel.mode='hybrid' needs context_parallel.ulysses_size, a divisor of sequence_parallel_size "
            f"{size} (got {ulysses})"
        )
    if mode != "hybrid" and ulysses is not None:
        raise ValueError(f"context_parallel.ulysses_size applies to mode 'hybrid' only (mode is {mode!r})")
    return ContextParallelConfig(size, mode, layout, ulysses)


def _read(r: Reader, world_size: int, data: dict[str, Any]) -> EngineConfig:
    """Every section of the config (``ignored`` left empty: the caller fills it)."""
    tp = r.section("tensor_parallel")
    tp_size = tp.get("size", to_int, 1, check=_positive, must="be >= 1")
    plan = tp.get(
        "plan",
        lambda k, v: _string(k, v).lower(),
        "auto",
        auto=("tensor_parallel_plan",),
        auto_fallback="auto",  # "auto" is a plan here: picked from the model by initialize
        check=lambda v: v in TP_PLANS,
        must=f"be one of {list(TP_PLANS)}",
    )
    tp_cfg = TensorParallelConfig(tp_size, plan, tp.get("gather_logits", to_bool, True))
    pp = r.section("pipeline")
    stages = pp.get("stages", to_int, 1, check=_positive, must="be >= 1")
    schedule = pp.choice("schedule", PIPELINE_SCHEDULES, "1f1b")
    virtual = pp.get("virtual_stages", to_int, 1, check=_positive, must="be >= 1")
    if virtual > 1 and schedule != "interleaved":
        raise ValueError(
            f"pipeline.virtual_stages={virtual}: stages per rank need pipeline.schedule 'interleaved', got {schedule!r}"
        )
    partition = pp.choice("partition", ("layers", "params"), "layers")
    cp = _context_parallel(r)
    if world_size % (tp_size * stages * cp.size):
        raise ValueError(
            f"world_size {world_size} is not divisible by tensor_parallel.size ({tp_size}) × pipeline.stages ({stages})"
            + (f" × sequence_parallel_size ({cp.size})" if cp.size > 1 else "")
        )
    dp = world_size // (tp_size * stages * cp.size)
    train, micro, gas = _batch(r, dp)
    microbatches = pp.get("microbatches", to_int, gas, check=_positive, must="be >= 1")
    if stages > 1 and (micro * gas) % microbatches:
        raise ValueError(
            f"pipeline.microbatches={microbatches} must divide the rows of one train_batch, "
            f"train_micro_batch_size_per_gpu × gradient_accumulation_steps = {micro} × {gas}"
        )

    fce = r.section("fused_cross_entropy")
    fused = FusedCrossEntropyConfig(
        fce.get("enabled", to_bool, False), fce.get("chunk_tokens", to_int, None, check=_positive, must="be >= 1")
    )
    if fused.enabled and stages > 1:
        raise ValueError(
            "fused_cross_entropy.enabled with pipeline.stages > 1: not offered in the engine (a pipeline's loss "
            "is its PipelineModule's loss_fn); parallelize(fused_cross_entropy=True) fuses a pipeline's last stage"
        )
    if cp.size > 1:  # what the engine's forward over sequence shards does not combine with
        if tp_size > 1 and not tp_cfg.gather_logits:
            raise ValueError(
                f"sequence_parallel_size={cp.size} with tensor_parallel.gather_logits=false: the engine forms the loss "
                "over the sequence shards from whole-vocabulary logits; set gather_logits true"
            )
    precision = dataclasses.replace(_precision(r), autocast=_torch_autocast(r, stages))
    cfg = EngineConfig(
        world_size=world_size,
        dp_size=dp,
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        # absent: 1.0, DeepSpeed 0.19.8's GRADIENT_CLIPPING_DEFAULT (a DeepSpeed config without the key clips)
        gradient_clipping=r.get("gradient_clipping", to_float, 1.0, check=_nonneg, must="be >= 0"),
        precision=precision,
        optimizer=_optimizer(r),
        scheduler=_scheduler(r),
        zero=_zero(r, dp * cp.size),
        tensor_parallel=tp_cfg,
        pipeline=PipelineConfig(stages, schedule, microbatches, virtual, partition),
        fused_cross_entropy=fused,
        context_parallel=cp,
        ignored=(),
        source=_frozen(data),
    )
    if r.has("amp"):  # apex AMP: only a disabled section is accepted
        amp = r.raw("amp")
        if isinstance(amp, Mapping) and to_bool("amp.enabled", amp.get("enabled", False)):
            raise ValueError("amp.enabled=true (apex AMP) is not supported: use fp16 or bf16")
        r.report.add_ignored("amp")
    _hybrid_engine(r)
    _data_efficiency(r)
    r.ignore(*IGNORED_KEYS[""])
    _unsupported(r, "")
    return cfg
