"""DeepSpeed-style configs: seed 002's two configs, every error naming its key, DeepSpeed's batch rule.

shardkit/examples/*_accelerate.json are seed 002's configs copied verbatim (the Accelerate blog's
zero2_config_accelerate.json and zero3_offload_config_accelerate.json). The batch-size triple is
checked against a written-out rule and, when deepspeed is installed, against DeepSpeed's own
``DeepSpeedConfig`` (its process-group queries patched to a fake world size).
"""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.examples import config_path
from shardkit.engine import WarmupDecayLR, load_config
from shardkit.kernels import FusedAdam, FusedAdamW
from shardkit.parallel import DynamicLossScaler

CONFIGS = config_path("zero2_config_accelerate.json").parent
ZERO2 = CONFIGS / "zero2_config_accelerate.json"
ZERO3 = CONFIGS / "zero3_offload_config_accelerate.json"
# what the blog's Trainer/Accelerate run supplies for the "auto"s
AUTO = dict(
    lr=2e-5,
    weight_decay=0.01,
    warmup_num_steps=100,
    total_num_steps=1000,
    gradient_clipping=1.0,
    train_micro_batch_size_per_gpu=40,
    hidden_size=1600,
)


def _cfg(**over) -> dict:
    base = {"train_micro_batch_size_per_gpu": 2}
    base.update(over)
    return base


# ---- seed 002 ---------------------------------------------------------------------------------
def test_seed_zero2_config_resolves_as_the_seed_says(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="shardkit.engine"):
        cfg = load_config(ZERO2, world_size=2, **AUTO)
    assert cfg.zero.stage == 2 and cfg.zero.offload is None and not cfg.zero.offload_param.enabled
    assert cfg.precision.dtype == "fp16"  # "enabled": "true", a string
    ls = cfg.precision.loss_scaler
    assert (ls.loss_scale, ls.initial_scale_power, ls.loss_scale_window, ls.hysteresis, ls.min_loss_scale) == (0, 15, 1000, 2, 1)
    scaler = ls.make()
    assert isinstance(scaler, DynamicLossScaler) and scaler.scale == 2.0**15 and scaler.hysteresis == 2
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (80, 40, 1)
    assert cfg.gradient_clipping == 1.0
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.class_name == "FusedAdamW"
    assert dict(cfg.optimizer.params) == dict(lr=2e-5, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, amsgrad=False)
    assert cfg.scheduler.type == "WarmupDecayLR"
    # HF/Accelerate fill: warmup_min_lr 0, warmup_max_lr = lr
    assert dict(cfg.scheduler.params) == dict(warmup_min_lr=0.0, warmup_max_lr=2e-5, warmup_num_steps=100, total_num_steps=1000)
    assert cfg.zero.reduce_bucket_size == cfg.zero.allgather_bucket_size == 200_000_000  # 2e8 floats -> ints
    assert isinstance(cfg.zero.reduce_bucket_size, int)
    assert cfg.zero.bucket_mb(cfg.precision.grad_bytes) == pytest.approx(2e8 * 2 / 2**20)
    assert cfg.zero.overlap_comm and cfg.zero.contiguous_gradients
    assert cfg.ignored == (
        "zero_optimization.reduce_scatter",
        "zero_optimization.allgather_partitions",
        "steps_per_print",
        "wall_clock_breakdown",
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "shardkit.engine"]
    assert len(lines) == 1 and all(k in lines[0] for k in cfg.ignored)

    # what it builds: our fused AdamW under DeepSpeed's WarmupDecayLR, lr written at it = -1
    p = torch.nn.Parameter(torch.zeros(4))
    opt = cfg.optimizer.build([p])
    sched = cfg.scheduler.build(opt)
    assert type(opt) is FusedAdamW and type(sched) is WarmupDecayLR and opt.param_groups[0]["lr"] == 0.0
    assert opt.param_groups[0]["weight_decay"] == 0.01


def test_seed_zero3_offload_config_resolves_as_the_seed_says() -> None:
    cfg = load_config(ZERO3, world_size=1, **AUTO)
    z = cfg.zero
    assert z.stage == 3 and cfg.precision.dtype == "fp16" and cfg.precision.loss_scaler.initial_scale_power == 16
    assert (z.offload_optimizer.device, z.offload_optimizer.pin_memory) == ("cpu", True)
    assert (z.offload_param.device, z.offload_param.pin_memory) == ("cpu", True)
    assert z.offload == "cpu"
    # transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_finalize
    assert z.reduce_bucket_size == 1600 * 1600
    assert z.prefetch_bucket_size == int(0.9 * 1600 * 1600)
    assert z.param_persistence_threshold == 16_000
    assert z.sub_group_size == z.max_live_parameters == z.max_reuse_distance == 1_000_000_000
    assert z.gather_16bit_weights_on_model_save and z.overlap_comm
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (40, 1)
    assert cfg.optimizer.class_name == "FusedAdamW" and cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.ignored == ("steps_per_print", "wall_clock_breakdown")
    # an explicit auto value for the key itself wins over hidden_size
    assert load_config(ZERO3, world_size=1, **{**AUTO, "reduce_bucket_size": 12345}).zero.reduce_bucket_size == 12345


def test_the_callers_dict_is_not_modified() -> None:
    raw = json.loads(ZERO2.read_text())
    before = json.dumps(raw, sort_keys=True)
    load_config(raw, world_size=2, **AUTO)
    assert json.dumps(raw, sort_keys=True) == before


# ---- "auto" left unresolved ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("drop", "key"),
    [
        ("lr", "optimizer.params.lr"),
        ("weight_decay", "optimizer.params.weight_decay"),
        ("warmup_num_steps", "scheduler.params.warmup_num_steps"),
        ("total_num_steps", "scheduler.params.total_num_steps"),
        ("gradient_clipping", "gradient_clipping"),
        ("hidden_size", "zero_optimization.reduce_bucket_size"),
    ],
)
def test_unresolved_auto_names_the_key_and_the_keyword(drop: str, key: str) -> None:
    auto = {k: v for k, v in AUTO.items() if k != drop}
    with pytest.raises(ValueError) as err:
        load_config(ZERO3, world_size=1, **auto)
    msg = str(err.value)
    assert f'{key} is "auto"' in msg and f"{key.rsplit('.', 1)[-1]}=..." in msg, msg
    if drop == "hidden_size":
        assert "hidden_size=..." in msg


def test_auto_batch_sizes_without_values_name_the_keys() -> None:
    auto = {k: v for k, v in AUTO.items() if k != "train_micro_batch_size_per_gpu"}
    with pytest.raises(ValueError, match="train_batch_size or train_micro_batch_size_per_gpu must be given"):
        load_config(ZERO2, world_size=2, **auto)
    cfg = load_config(ZERO2, world_size=2, **{**auto, "train_batch_size": 64})  # micro derived: 64 / 2 / 1
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (64, 32)


# ---- the batch triple ---------------------------------------------------------------------------
def ref_batch(train, micro, gas, dp):
    """DeepSpeed's rule, written out: any two give the third (floor division), one gives gas = 1."""
    if train and micro and not gas:
        gas = train // micro // dp
    elif train and gas and not micro:
        micro = train // dp // gas
    elif micro and gas and not train:
        train = micro * gas * dp
    elif train and not micro and not gas:
        micro, gas = train // dp, 1
    elif micro and not train and not gas:
        train, gas = micro * dp, 1
    ok = bool(train and micro and gas) and micro > 0 and gas > 0 and train == micro * gas * dp
    return (train, micro, gas) if ok else None


@pytest.mark.parametrize(
    ("train", "micro", "gas", "dp"),
    [(32, 4, None, 4), (32, None, 2, 4), (None, 4, 2, 4), (32, None, None, 4), (None, 3, None, 2), (24, 3, 4, 2)],
)
def test_batch_triple_follows_deepspeeds_rule(train, micro, gas, dp) -> None:
    given = {
        k: v
        for k, v in zip(
            ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"), (train, micro, gas)
        )
        if v
    }
    cfg = load_config(given, world_size=dp)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == ref_batch(train, micro, gas, dp)


@pytest.mark.parametrize(
    ("given", "dp"),
    [
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 2),
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=3), 4),  # gas derived: 2; 3 × 2 × 4 != 32
        (dict(train_batch_size=2), 4),  # micro derived: 0
    ],
)
def test_inconsistent_batch_triple_names_all_three(given: dict, dp: int) -> None:
    with pytest.raises(ValueError) as err:
        load_config(given, world_size=dp)
    msg = str(err.value)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert key + "=" in msg, msg
    for key, value in given.items():
        assert f"{key}={value}" in msg, msg


def test_tensor_and_pipeline_sections_set_the_data_parallel_size() -> None:
    cfg = load_config(
        _cfg(gradient_accumulation_steps=4, tensor_parallel={"size": 2}, pipeline={"stages": 2, "schedule": "gpipe"}),
        world_size=8,
    )
    assert (cfg.dp_size, cfg.tensor_parallel.size, cfg.pipeline.stages, cfg.pipeline.schedule) == (2, 2, 2, "gpipe")
    assert cfg.train_batch_size == 2 * 4 * 2 and cfg.pipeline.microbatches == 4  # default: one per accumulation step
    with pytest.raises(ValueError, match=r"tensor_parallel.size \(3\)"):
        load_config(_cfg(tensor_parallel={"size": 3}), world_size=8)
    with pytest.raises(ValueError, match="pipeline.schedule must be one of"):
        load_config(_cfg(pipeline={"schedule": "zigzag"}), world_size=1)


# ---- values as DeepSpeed accepts them -----------------------------------------------------------
def test_string_booleans_and_float_sizes() -> None:
    cfg = load_config(
        _cfg(
            bf16={"enabled": "True"},
            fp16={"enabled": "false"},
            zero_optimization={"stage": 3.0, "overlap_comm": "false", "reduce_bucket_size": 5e8, "sub_group_size": "1e9"},
        ),
        world_size=1,
    )
    assert cfg.precision.dtype == "bf16" and cfg.precision.loss_scaler is None
    assert cfg.zero.stage == 3 and cfg.zero.overlap_comm is False
    assert cfg.zero.reduce_bucket_size == 500_000_000 and cfg.zero.sub_group_size == 10**9
    with pytest.raises(ValueError, match=r"zero_optimization.reduce_bucket_size: expected an integer, got 2.5"):
        load_config(_cfg(zero_optimization={"reduce_bucket_size": 2.5}), world_size=1)
    with pytest.raises(ValueError, match=r"zero_optimization.overlap_comm: expected true/false, got 'maybe'"):
        load_config(_cfg(zero_optimization={"overlap_comm": "maybe"}), world_size=1)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        (dict(fp16={"enabled": True}, bf16={"enabled": True}), "fp16.enabled and bf16.enabled"),
        (
            dict(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}),
            "zero_optimization.offload_optimizer.nvme_path",
        ),
        (dict(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}), "zero_optimization.offload_param.nvme_path"),
        (dict(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}), "zero_optimization.offload_param.device"),
        (dict(zero_optimization={"stage": 4}), "zero_optimization.stage"),
        (dict(zero_optimization={"zero_quantized_weights": True}), "zero_optimization.zero_quantized_weights"),
        (dict(optimizer={"type": "Adagrad"}), "optimizer.type"),
        (dict(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}), "scheduler.params.total_num_steps"),
        (dict(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cos"}}), "scheduler.params.warmup_type"),
        (dict(fp16={"enabled": True, "loss_scale_window": 0}), "fp16.loss_scale_window"),
        (dict(amp={"enabled": True}), "amp.enabled"),
    ],
)
def test_errors_name_the_key(config: dict, key: str) -> None:
    with pytest.raises(ValueError) as err:
        load_config(_cfg(**config), world_size=1)
    assert key in str(err.value), str(err.value)


def test_hpz_partition_size_is_read_and_checked_against_the_dp_size() -> None:
    """ZeRO++'s key: a divisor of dp (world / (tp x pp x cp)), stage 3 only, 1 is off."""
    z = {"stage": 3, "zero_hpz_partition_size": 2}
    assert load_config(_cfg(zero_optimization=z), world_size=8).zero.hpz_partition_size == 2
    assert load_config(_cfg(zero_optimization={"stage": 3}), world_size=8).zero.hpz_partition_size == 1
    with pytest.raises(ValueError, match="zero_hpz_partition_size=3 must divide the data-parallel size 4"):
        load_config(_cfg(zero_optimization={**z, "zero_hpz_partition_size": 3}, tensor_parallel={"size": 2}), world_size=8)
    with pytest.raises(ValueError, match="zero_hpz_partition_size=2 needs zero_optimization.stage 3, got 2"):
        load_config(_cfg(zero_optimization={**z, "stage": 2}), world_size=8)
    with pytest.raises(ValueError, match="zero_hpz_partition_size"):
        load_config(_cfg(zero_optimization={**z, "zero_hpz_partition_size": 0}), world_size=8)


def test_nvme_offload_with_a_path() -> None:
    z = {"stage": 3, "offload_optimizer": {"device": "NVMe", "nvme_path": "/local_nvme"}, "offload_param": {"device": "cpu"}}
    cfg = load_config(_cfg(zero_optimization=z), world_size=1)
    assert cfg.zero.offload == "nvme" and cfg.zero.offload_optimizer.nvme_path == "/local_nvme"


@pytest.mark.parametrize(
    ("type_", "params", "cls"),
    [("Adam", {}, FusedAdamW), ("adam", {"adam_w_mode": False}, FusedAdam), ("AdamW", {"adam_w_mode": "false"}, FusedAdamW)],
)
def test_adam_w_mode_means_what_deepspeed_means(type_: str, params: dict, cls: type) -> None:
    """DeepSpeed: "Adam" decouples weight decay unless adam_w_mode is false; "AdamW" always does."""
    cfg = load_config(_cfg(optimizer={"type": type_, "params": {"lr": 0.1, "weight_decay": 0.1, **params}}), world_size=1)
    opt = cfg.optimizer.build([torch.nn.Parameter(torch.ones(3))])
    assert type(opt) is cls and opt.param_groups[0]["weight_decay"] == 0.1


def test_other_optimizers_use_deepspeeds_defaults() -> None:
    lion = load_config(_cfg(optimizer={"type": "Lion"}), world_size=1).optimizer
    assert lion.class_name == "FusedLion" and lion.params["betas"] == (0.9, 0.999) and lion.params["weight_decay"] == 0.0
    sgd = load_config(_cfg(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}), world_size=1).optimizer
    assert sgd.build([torch.nn.Parameter(torch.ones(2))]).param_groups[0]["momentum"] == 0.9
    lamb = load_config(_cfg(optimizer={"type": "LAMB", "params": {"max_coeff": 5.0, "min_coeff": 0.01}}), world_size=1)
    assert lamb.optimizer.params["max_trust_ratio"] == 5.0 and "optimizer.params.min_coeff" in lamb.ignored


# ---- unknown and ignored keys -------------------------------------------------------------------
def test_unknown_keys_are_errors_naming_each_dotted_key() -> None:
    bad = _cfg(zero_optimization={"stage": 3, "stage3_prefetch_bucket_sizee": 10}, trian_batch_size=4, fp16={"enabeld": True})
    with pytest.raises(ValueError) as err:
        load_config(bad, world_size=1)
    msg = str(err.value)
    for key in ("zero_optimization.stage3_prefetch_bucket_sizee", "trian_batch_size", "fp16.enabeld"):
        assert key in msg, msg
    assert "did you mean 'stage3_prefetch_bucket_size'" in msg
    with pytest.raises(ValueError, match="scheduler.params.warmup_steps"):
        load_config(_cfg(scheduler={"type": "WarmupLR", "params": {"warmup_steps": 5}}), world_size=1)


def test_unknown_keys_warn_once_each_when_not_strict() -> None:
    bad = _cfg(zero_optimization={"stage": 1, "colour": "blue"}, my_key=1)
    with pytest.warns(UserWarning) as record:
        cfg = load_config(bad, world_size=1, strict=False)
    msgs = [str(w.message) for w in record if "unknown config key" in str(w.message)]
    assert len(msgs) == 2 and any("zero_optimization.colour" in m for m in msgs) and any("my_key" in m for m in msgs)
    assert cfg.zero.stage == 1


def test_ignored_keys_are_reported_once_each_never_dropped(caplog) -> None:
    config = _cfg(
        steps_per_print=10,
        wall_clock_breakdown=False,
        tensorboard={"enabled": True, "output_path": "x"},
        zero_optimization={"stage": 2, "round_robin_gradients": True, "mics_shard_size": -1},
    )
    with caplog.at_level(logging.WARNING, logger="shardkit.engine"):
        cfg = load_config(config, world_size=1)
    assert set(cfg.ignored) == {
        "steps_per_print",
        "wall_clock_breakdown",
        "tensorboard",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.mics_shard_size",  # unsupported, but at DeepSpeed's default
    }
    assert len(cfg.ignored) == len(set(cfg.ignored))
    assert len([r for r in caplog.records if r.name == "shardkit.engine"]) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardkit.engine"):
        assert load_config(_cfg(), world_size=1).ignored == ()
    assert not caplog.records  # nothing ignored, nothing logged


def test_parser_never_touches_torch_distributed() -> None:
    """All errors come before any collective: the config layer does not even import torch.distributed."""
    engine = Path(__file__).resolve().parents[2] / "shardkit" / "engine"
    for name in ("config_reader.py", "_reader.py", "resolved.py", "schedulers.py"):
        tree = ast.parse((engine / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m.startswith("torch.distributed") for m in imported), name
    with pytest.raises(ValueError):
        load_config(_cfg(train_batch_size=3, gradient_accumulation_steps=1), world_size=2)
    assert not torch.distributed.is_initialized()


# ---- differential: DeepSpeed's own DeepSpeedConfig ------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    train=st.one_of(st.none(), st.integers(1, 64)),
    micro=st.one_of(st.none(), st.integers(1, 16)),
    gas=st.one_of(st.none(), st.integers(1, 8)),
    dp=st.integers(1, 8),
)
def test_batch_triple_equals_deepspeed(train, micro, gas, dp) -> None:
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    given_ = {
        k: v
        for k, v in zip(
            ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"), (train, micro, gas)
        )
        if v is not None
    }
    mp = pytest.MonkeyPatch()
    mp.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    mp.setattr(ds_config.dist, "get_world_size", lambda *a, **k: dp)
    try:
        try:
            ds = ds_config.DeepSpeedConfig(dict(given_))
            theirs = (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps)
            assert ds.world_size == dp
        except AssertionError:
            theirs = None
    finally:
        mp.undo()
    try:
        cfg = load_config(given_, world_size=dp)
        ours = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    except ValueError:
        ours = None
    assert ours == theirs, (given_, dp)


# ---- shardkit config check ----------------------------------------------------------------------
def _check(argv: list[str], capsys) -> tuple[int, str, str]:
    from shardkit.engine.config_check import config_check_main

    rc = config_check_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _auto_args(**over) -> list[str]:
    return [a for k, v in {**AUTO, **over}.items() for a in ("--auto", f"{k}={v}")]


def test_config_check_prints_the_resolution_and_the_plan(capsys) -> None:
    from shardkit.parallel.zero import plan_memory

    rc, out, err = _check([str(ZERO2), "--world-size", "2", *_auto_args(), "--params", "124e6"], capsys)
    assert rc == 0, err
    for text in (
        "ZeRO stage 2; offload optimizer: none; offload params: none",
        "precision: fp16, dynamic loss scale from 2^15 (window 1000, hysteresis 2, min 1)",
        "train_batch_size 80 = micro 40 × gradient_accumulation_steps 1 × dp 2",
        "gradient clipping: 1",
        "optimizer: AdamW -> shardkit.kernels.FusedAdamW(lr=2e-05, weight_decay=0.01",
        "scheduler: WarmupDecayLR(",
        "ignored keys: zero_optimization.reduce_scatter, zero_optimization.allgather_partitions, "
        "steps_per_print, wall_clock_breakdown",
    ):
        assert text in out, (text, out)
    # the planner with the settings the config means: 2e8 fp16 elements = 381.47 MiB buckets
    plan = plan_memory(124_000_000, dp=2, stage=2, precision="fp16", optimizer="adamw", bucket_mb=2e8 * 2 / 2**20)
    assert plan.table() in out
    assert "config keys accepted but ignored" not in err  # printed once, not logged as well


def test_config_check_lists_every_unfilled_auto_in_one_run_with_its_flag(capsys) -> None:
    rc, out, err = _check([str(ZERO2), "--world-size", "2"], capsys)
    assert rc == 1 and "valid" not in out
    head, *rows = err.strip().splitlines()
    assert head == 'shardkit config check: error: 6 "auto" value(s) nothing fills; pass them with --auto:'
    listed = {row.split(":")[0].strip(): row for row in rows}
    assert set(listed) == {
        "train_batch_size / train_micro_batch_size_per_gpu",
        "gradient_clipping",
        "optimizer.params.lr",
        "optimizer.params.weight_decay",
        "scheduler.params.total_num_steps",
        "scheduler.params.warmup_num_steps",
    }
    assert listed["optimizer.params.lr"].endswith("--auto lr=VALUE")
    assert "load_config" not in err
    # everything the listing asks for, given: valid (warmup_max_lr is lr's, as in HF's Trainer)
    names = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "lr": 3e-4, "weight_decay": 0.1}
    names |= {"total_num_steps": 100, "warmup_num_steps": 10}
    rc, out, err = _check(
        [str(ZERO2), "--world-size", "2", *(a for k, v in names.items() for a in ("--auto", f"{k}={v}"))], capsys
    )
    assert rc == 0, err
    rc, out, err = _check([str(ZERO2), *_auto_args(), "--set", "typo_key=1"], capsys)
    assert rc == 1 and "--lenient" in err and "strict=False" not in err


def test_config_check_prints_the_tensor_and_pipeline_layout(capsys) -> None:
    sets = ["tensor_parallel.size=2", "tensor_parallel.gather_logits=false", "pipeline.stages=2", "pipeline.microbatches=8"]
    args = [str(ZERO2), "--world-size", "8", *_auto_args(), "--set", "zero_optimization.stage=1", "--set", "fp16.enabled=false"]
    rc, out, err = _check([*args, *(a for kv in sets for a in ("--set", kv))], capsys)
    assert rc == 0, err
    for text in (
        "world size 8 = dp 2 × tensor_parallel 2 × pipeline 2",
        "tensor parallel: 2 ranks per group, plan 'auto'; LM-head logits vocabulary-parallel shards",
        "pipeline: 2 stages split by layers, schedule 1f1b; train_batch runs 1 micro-batches as 8 pipeline micro-batches of 5 rows",
    ):
        assert text in out, (text, out)


@pytest.mark.parametrize(
    "section,message",
    [
        ({"tensor_parallel": {"size": 2, "plan": "megatron"}}, "tensor_parallel.plan must be one of"),
        ({"tensor_parallel": {"size": 2, "gather_logits": "maybe"}}, "tensor_parallel.gather_logits"),
        ({"pipeline": {"stages": 2, "virtual_stages": 2}}, "pipeline.virtual_stages"),
        ({"pipeline": {"stages": 2, "microbatches": 3}}, "pipeline.microbatches=3 must divide"),
        ({"pipeline": {"stages": 2, "partition": "uniform"}}, "pipeline.partition must be one of"),
    ],
)
def test_tensor_and_pipeline_keys_are_checked(section, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(_cfg(gradient_accumulation_steps=2, **section), world_size=4)
    assert load_config(_cfg(tensor_parallel={"size": 2, "plan": "AUTO"}), world_size=2).tensor_parallel.plan == "auto"


def test_config_check_offload_set_and_errors(capsys) -> None:
    from shardkit.parallel.zero import plan_memory

    rc, out, err = _check([str(ZERO3), *_auto_args(), "--params", "1.5B", "--set", "fp16.enabled=false"], capsys)
    assert rc == 0, err
    assert "ZeRO stage 3; offload optimizer: cpu; offload params: cpu" in out and "precision: fp32" in out
    plan = plan_memory(
        1_500_000_000, dp=1, stage=3, precision="fp32", optimizer="adamw", offload="cpu", offload_params=True,
        bucket_mb=1600 * 1600 * 4 / 2**20,
    )  # fmt: skip
    assert plan.table() in out

    rc, out, err = _check([str(ZERO3), *_auto_args(), "--set", "zero_optimization.offload_optimizer.device=nvme"], capsys)
    assert rc == 1 and "zero_optimization.offload_optimizer.nvme_path" in err and out == ""
    rc, _, err = _check([str(ZERO2), *_auto_args(lr="auto")], capsys)  # "auto" passed on is still unresolved
    assert rc == 1 and "optimizer.params.lr" in err
    rc, _, err = _check([str(ZERO2), "--set", "zero_optimization.stagee=1", *_auto_args()], capsys)
    assert rc == 1 and "zero_optimization.stagee" in err
    with pytest.warns(UserWarning, match="zero_optimization.stagee"):
        rc, _, err = _check([str(ZERO2), "--set", "zero_optimization.stagee=1", "--lenient", *_auto_args()], capsys)
    assert rc == 0
    rc, _, err = _check([str(ZERO2), "--params", "lots"], capsys)
    assert rc == 2 and "not a parameter count" in err


def test_a_shipped_config_is_found_by_its_name_from_any_directory(tmp_path, monkeypatch) -> None:
    """``config="zero2_config_accelerate.json"`` works after ``pip install``, from any directory;
    a local file of that name wins; another missing name lists the shipped ones."""
    monkeypatch.chdir(tmp_path)
    by_name = load_config("zero2_config_accelerate.json", world_size=2, **AUTO)
    assert by_name == load_config(str(ZERO2), world_size=2, **AUTO)
    local = json.loads(ZERO2.read_text())
    local["zero_optimization"]["stage"] = 1
    (tmp_path / "zero2_config_accelerate.json").write_text(json.dumps(local))
    assert load_config("zero2_config_accelerate.json", world_size=2, **AUTO).zero.stage == 1
    with pytest.raises(ValueError, match="not a file.*zero2_config_accelerate.json, zero3_offload_config_accelerate.json"):
        load_config("zero4_config.json", world_size=2, **AUTO)
