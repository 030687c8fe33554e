"""DeepSpeed config keys that shardkit used to refuse as unknown, and ``"auto"`` values listed at once.

Per key, against DeepSpeed 0.19.8's own reading of it (deepspeed/runtime/config.py,
runtime/data_pipeline/config.py, runtime/torch_autocast.py, runtime/lr_schedules.py):

* ``hybrid_engine``: accepted disabled (reported ignored, with the reason); enabled is a
  ValueError naming the key (the RLHF generation engine is not offered).
* ``data_efficiency``: accepted with every on-switch false (DeepSpeed acts on each switch by
  itself); any switch true is a ValueError naming that dotted switch.
* ``torch_autocast``: implemented for bfloat16. The engine's forward runs under
  ``torch.autocast(device, bfloat16)``: the losses equal a plain torch loop under the same
  autocast and DeepSpeed's own engine on CPU, step for step. fp16 autocast (DeepSpeed pairs it
  with a GradScaler), no dtype, and pipeline stages are refused naming the key.
* ``OneBitAdam`` / ``ZeroOneAdam`` / ``OneBitLamb``: a ValueError naming the type and the
  uncompressed type to use (DeepSpeed 0.19.8 itself no longer has them).
* ``LRRangeTest``: built from the config (its formula and DeepSpeed equality are in
  test_engine_schedulers.py).
* every ``"auto"`` nothing fills: one ``UnfilledAutoError`` naming all of them, from
  ``load_config``, ``shardkit.initialize`` and ``shardkit config check``; ``config check``
  refuses what ``initialize`` refuses whatever the script, and says in one line what it cannot know.
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch
import torch.distributed as dist

from shardkit.engine import LRRangeTest, PrecisionConfig, UnfilledAutoError, load_config
from shardkit.engine.deepspeed_keys import DATA_EFFICIENCY_SWITCHES
from shardkit.examples import config_path

ZERO2 = config_path("zero2_config_accelerate.json")
ZERO3 = config_path("zero3_offload_config_accelerate.json")
BASE = {"train_micro_batch_size_per_gpu": 2}


def _load(**sections):
    return load_config({**BASE, **sections}, world_size=1)


def _logged_ignored(caplog, **sections) -> tuple[tuple[str, ...], str]:
    with caplog.at_level(logging.WARNING, logger="shardkit.engine"):
        cfg = _load(**sections)
    lines = [r.getMessage() for r in caplog.records if r.name == "shardkit.engine"]
    caplog.clear()
    assert len(lines) == 1, lines
    return cfg.ignored, lines[0]


# ---- hybrid_engine -------------------------------------------------------------------------------
def test_hybrid_engine_disabled_is_accepted_and_reported_with_the_reason(caplog) -> None:
    section = {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1, "release_inference_cache": False,
               "pin_parameters": True, "tp_gather_partition_size": 8, "enable_cuda_graph": False}  # fmt: skip
    ignored, line = _logged_ignored(caplog, hybrid_engine=section)
    assert ignored == ("hybrid_engine",)
    assert "hybrid_engine (disabled; the RLHF generation engine is not offered)" in line


def test_hybrid_engine_enabled_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"hybrid_engine\.enabled=true: .*not offered by shardkit"):
        _load(hybrid_engine={"enabled": True, "max_out_tokens": 256})
    with pytest.raises(ValueError, match=r"hybrid_engine\.max_out_tokns"):  # DeepSpeed forbids unknown fields too
        _load(hybrid_engine={"enabled": False, "max_out_tokns": 256})


# ---- data_efficiency -----------------------------------------------------------------------------
DATA_EFFICIENCY_OFF = {
    "enabled": False,
    "seed": 1234,
    "data_sampling": {
        "enabled": False,
        "num_epochs": 1000,
        "curriculum_learning": {"enabled": False, "curriculum_metrics": {"seqlen": {"min_difficulty": 64}}},
        "dynamic_batching": {"enabled": False, "max_tokens": 4096},
    },
    "data_routing": {"enabled": False, "random_ltd": {"enabled": False, "total_layer_num": 24}},
}


def test_data_efficiency_disabled_is_accepted_and_reported_with_the_reason(caplog) -> None:
    ignored, line = _logged_ignored(caplog, data_efficiency=DATA_EFFICIENCY_OFF)
    assert ignored == ("data_efficiency",)
    assert "data_efficiency (disabled; curriculum learning, dynamic batching and random-LTD are not offered)" in line
    assert _load(data_efficiency={}).ignored == ("data_efficiency",)


@pytest.mark.parametrize("switch", DATA_EFFICIENCY_SWITCHES)
def test_data_efficiency_any_switch_on_is_refused_naming_it(switch: str) -> None:
    section = json.loads(json.dumps(DATA_EFFICIENCY_OFF))
    *parents, leaf = switch.split(".")
    node = section
    for part in parents:
        node = node[part]
    node[leaf] = True
    with pytest.raises(ValueError, match="^" + re.escape(f"data_efficiency.{switch}=true: ") + ".*not offered"):
        _load(data_efficiency=section)


def test_data_efficiency_switches_are_the_ones_deepspeed_reads() -> None:
    """DeepSpeed's engine turns curriculum learning / random-LTD on from the leaf switch alone."""
    ds = pytest.importorskip("deepspeed.runtime.data_pipeline.config")
    for switch in DATA_EFFICIENCY_SWITCHES:
        section = json.loads(json.dumps(DATA_EFFICIENCY_OFF))
        *parents, leaf = switch.split(".")
        node = section
        for part in parents:
            node = node[part]
        node[leaf] = True
        read = ds.get_data_efficiency_config({"data_efficiency": section})
        on = [
            read["enabled"],
            read["data_sampling"]["enabled"],
            read["data_sampling"]["curriculum_learning"]["enabled"],
            read["data_sampling"]["dynamic_batching"]["enabled"],
            read["data_routing"]["enabled"],
            read["data_routing"]["random_ltd"]["enabled"],
        ]
        assert on == [s == switch for s in DATA_EFFICIENCY_SWITCHES], switch


# ---- torch_autocast: the config ------------------------------------------------------------------
def test_torch_autocast_disabled_is_reported_ignored(caplog) -> None:
    ignored, line = _logged_ignored(caplog, torch_autocast={"enabled": False, "dtype": "float16"})
    assert ignored == ("torch_autocast",) and "torch_autocast (disabled)" in line
    assert _load(torch_autocast={"enabled": False}).precision.autocast is None


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", "torch.bfloat16"])
def test_torch_autocast_bf16_is_read(dtype: str, caplog) -> None:
    cfg = _load(torch_autocast={"enabled": True, "dtype": dtype})
    assert cfg.precision == PrecisionConfig("fp32", None, "bf16") and cfg.ignored == ()
    # the modules whose gradients DeepSpeed's ZeRO reduces in bf16: reduced in fp32 here, said so
    modules = ["torch.nn.Linear", "torch.nn.Conv2d"]
    ignored, line = _logged_ignored(
        caplog, torch_autocast={"enabled": True, "dtype": dtype, "lower_precision_safe_modules": modules}
    )
    assert ignored == ("torch_autocast.lower_precision_safe_modules",) and "shardkit reduces them in fp32" in line
    # with a bf16/fp16 section, as in DeepSpeed: the parameters in that dtype, autocast on top
    assert _load(torch_autocast={"enabled": True, "dtype": dtype}, bf16={"enabled": True}).precision == PrecisionConfig(
        "bf16", None, "bf16"
    )


@pytest.mark.parametrize(
    ("section", "extra", "message"),
    [
        ({"enabled": True, "dtype": "float16"}, {}, r"torch_autocast\.dtype='float16': float16 autocast needs a gradient scaler"),
        ({"enabled": True, "dtype": "half"}, {}, r"torch_autocast\.dtype='half'"),
        ({"enabled": True}, {}, r"torch_autocast\.dtype is required"),
        ({"enabled": True, "dtype": "fp32"}, {}, r"torch_autocast\.dtype='fp32' is no lower precision"),
        ({"enabled": False, "dtype": "bfloat17"}, {}, r"torch_autocast\.dtype must be one of"),  # DeepSpeed checks it too
        ({"enabled": True, "dtype": "bf16", "lower_precision_safe_modules": "torch.nn.Linear"}, {},
         r"torch_autocast\.lower_precision_safe_modules: expected a list"),
        ({"enabled": True, "dtype": "bf16"}, {"pipeline": {"stages": 2}}, r"torch_autocast\.enabled with pipeline\.stages=2"),
        ({"enabled": True, "dtype": "bf16", "enabeld": 1}, {}, r"torch_autocast\.enabeld"),
    ],
)  # fmt: skip
def test_torch_autocast_refusals_name_the_key(section: dict, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config({**BASE, "torch_autocast": section, **extra}, world_size=2)


def test_torch_autocast_dtype_names_are_deepspeeds() -> None:
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    for name in ("bfloat16", "bf16", "torch.bfloat16"):
        assert ds_config.get_torch_autocast_dtype({"torch_autocast": {"dtype": name}}) is torch.bfloat16
        assert _load(torch_autocast={"enabled": True, "dtype": name}).precision.autocast == "bf16"
    for name in ("float16", "fp16", "half", "torch.float16"):
        assert ds_config.get_torch_autocast_dtype({"torch_autocast": {"dtype": name}}) is torch.float16
        with pytest.raises(ValueError, match="gradient scaler"):
            _load(torch_autocast={"enabled": True, "dtype": name})


def test_the_forward_context_is_deepspeeds_autocast_if_enabled(monkeypatch, caplog) -> None:
    on, off = PrecisionConfig(autocast="bf16"), PrecisionConfig()
    with on.forward_context("cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16), on.forward_context("cpu"):  # the config's dtype wins
        assert torch.get_autocast_dtype("cpu") is torch.bfloat16
    with off.forward_context("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    # a CUDA autocast the caller opened is switched off for the forward, with one warning (DeepSpeed
    # looks at CUDA's autocast only); this machine may have no CUDA: its state is faked
    import shardkit.engine.resolved as resolved

    monkeypatch.setattr(resolved, "_WARNED_OUTER_AUTOCAST", False)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: True)
    with caplog.at_level(logging.WARNING, logger="shardkit.engine"):
        ctx = off.forward_context("cpu")
        off.forward_context("cpu")
    assert isinstance(ctx, torch.autocast) and ctx._enabled is False
    assert len([r for r in caplog.records if "runs without autocast" in r.getMessage()]) == 1


# ---- torch_autocast: the engine's forward --------------------------------------------------------
# gradient_clipping written out: DeepSpeed 0.19.8 clips at 1.0 when the key is absent, shardkit not
AUTOCAST_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 0.0,
    "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(n)]


def _train(forward, backward_and_step) -> tuple[list[float], list[torch.dtype]]:
    losses, dtypes = [], []
    for x, y in _batches():
        out = forward(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        backward_and_step(loss)
        losses.append(loss.item())
        dtypes.append(out.dtype)
    return losses, dtypes


def _autocast_runs() -> dict[str, tuple[list[float], list[torch.dtype]]]:
    """The same model, data and SGD through a plain torch loop under torch.autocast, shardkit's
    engine and DeepSpeed's engine (every rank the same batch: dp averaging changes nothing)."""
    import shardkit

    out = {}
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def torch_forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    def torch_step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()

    out["torch"] = _train(torch_forward, torch_step)

    model = _model()
    engine, *_ = shardkit.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=AUTOCAST_CONFIG)
    assert all(p.dtype is torch.float32 for p in model.parameters())  # autocast keeps fp32 parameters
    out["shardkit"] = _train(engine, lambda loss: (engine.backward(loss), engine.step()))

    try:
        import deepspeed
    except ImportError:
        return out
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(dist.get_rank()))
    model = _model()
    theirs, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=AUTOCAST_CONFIG)
    out["deepspeed"] = _train(theirs, lambda loss: (theirs.backward(loss), theirs.step()))
    return out


@pytest.mark.timeout(900)  # DeepSpeed JIT-builds its CPU extensions on a fresh checkout
def test_torch_autocast_forward_equals_torch_autocast_and_deepspeed(dist_pool) -> None:
    for runs in dist_pool.run(_autocast_runs, world_size=2, timeout=600):
        ref, dtypes = runs["torch"]
        assert set(dtypes) == {torch.bfloat16}
        ours, our_dtypes = runs["shardkit"]
        assert our_dtypes == dtypes
        assert ours == ref, (ours, ref)  # the same ops in the same order: bitwise
        if "deepspeed" not in runs:
            pytest.skip("deepspeed is not installed: compared with the torch loop only")
        theirs, their_dtypes = runs["deepspeed"]
        assert their_dtypes == dtypes and ours == theirs, (ours, theirs)


# ---- 1-bit optimizers ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "instead"),
    [("OneBitAdam", "Adam"), ("onebitadam", "Adam"), ("ZeroOneAdam", "Adam"), ("OneBitLamb", "Lamb")],
)
def test_one_bit_optimizers_are_refused_naming_the_type_and_what_to_use(kind: str, instead: str) -> None:
    with pytest.raises(ValueError, match=rf"optimizer\.type='{kind}': DeepSpeed's 1-bit optimizers .* \"type\": \"{instead}\""):
        _load(optimizer={"type": kind, "params": {"lr": 1e-3, "freeze_step": 100}})


def test_deepspeed_0_19_8_has_no_one_bit_optimizer_either() -> None:
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    for kind in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        assert kind.lower() not in ds_config.DEEPSPEED_OPTIMIZERS
        assert not hasattr(torch.optim, kind)  # DeepSpeed's last resort, getattr(torch.optim, type), fails


# ---- LRRangeTest from a config -------------------------------------------------------------------
def test_lr_range_test_is_built_from_the_config() -> None:
    params = {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2,
              "lr_range_test_staircase": "true"}  # fmt: skip
    cfg = _load(scheduler={"type": "LRRangeTest", "params": params})
    assert dict(cfg.scheduler.params) == {**params, "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = cfg.scheduler.build(opt)
    assert isinstance(sched, LRRangeTest) and opt.param_groups[0]["lr"] == 1e-4
    for _ in range(5):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4 * 3)  # it = 4: ⌊5 / 5⌋ = 1 stair of +200 %
    assert _load(scheduler={"type": "LRRangeTest"}).scheduler.build(opt).step_size == 2000  # DeepSpeed's defaults
    with pytest.raises(ValueError, match=r"scheduler\.params\.lr_range_test_step_size must be > 0"):
        _load(scheduler={"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}})
    with pytest.raises(ValueError, match=r"scheduler\.params\.lr_range_test_step_size: expected an integer"):
        _load(scheduler={"type": "LRRangeTest", "params": {"lr_range_test_step_size": 2.5}})


# ---- every unfilled "auto" at once ---------------------------------------------------------------
ZERO3_AUTOS = {
    "train_batch_size / train_micro_batch_size_per_gpu",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.weight_decay",
    "scheduler.params.total_num_steps",
    "scheduler.params.warmup_num_steps",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
}


def test_load_config_names_every_unfilled_auto_in_one_error() -> None:
    with pytest.raises(UnfilledAutoError) as err:
        load_config(ZERO3, world_size=1)
    e = err.value
    assert isinstance(e, ValueError) and e.after is None
    assert {key for key, _ in e.missing} == ZERO3_AUTOS  # warmup_max_lr is filled by lr, asked for already
    msg = str(e)
    assert msg.startswith(f'{len(ZERO3_AUTOS)} "auto" values nothing fills; pass them to load_config / initialize')
    for key, names in e.missing:
        assert " or ".join(f"{n}=..." for n in names) in msg, key
        if key != "train_batch_size / train_micro_batch_size_per_gpu":
            assert f'{key} is "auto" but nothing fills it' in msg
    assert dict(e.missing)["zero_optimization.reduce_bucket_size"] == ["reduce_bucket_size", "hidden_size"]
    # filling some leaves exactly the others
    with pytest.raises(UnfilledAutoError) as err:
        load_config(ZERO3, world_size=1, lr=1e-3, hidden_size=64, train_micro_batch_size_per_gpu=2)
    assert {key for key, _ in err.value.missing} == {
        "gradient_clipping",
        "optimizer.params.weight_decay",
        "scheduler.params.total_num_steps",
        "scheduler.params.warmup_num_steps",
    }


def test_an_error_after_unfilled_autos_is_reported_with_them() -> None:
    config = {**BASE, "gradient_clipping": "auto", "zero_optimization": {"stage": 7}}
    with pytest.raises(UnfilledAutoError) as err:
        load_config(config, world_size=1)
    assert err.value.missing == [("gradient_clipping", ["gradient_clipping"])]
    assert "zero_optimization.stage must be 0, 1, 2 or 3" in err.value.after
    assert 'gradient_clipping is "auto"' in str(err.value) and "zero_optimization.stage" in str(err.value)


def _initialize_with_autos() -> str:
    import shardkit

    try:
        shardkit.initialize(model=_model(), config=str(ZERO2))
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_initialize_raises_one_error_naming_every_unfilled_auto(dist_pool) -> None:
    for msg in dist_pool.run(_initialize_with_autos, world_size=2, timeout=120):
        assert msg.startswith('UnfilledAutoError: 6 "auto" values nothing fills'), msg
        for key in ("gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay",
                    "scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"):  # fmt: skip
            assert f'{key} is "auto"' in msg, (key, msg)
        assert "train_batch_size or train_micro_batch_size_per_gpu must be given" in msg


# ---- shardkit config check -----------------------------------------------------------------------
def _check(argv: list[str], capsys) -> tuple[int, str, str]:
    from shardkit.engine.config_check import config_check_main

    rc = config_check_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_config_check_lists_every_unfilled_auto_with_its_flag(capsys) -> None:
    rc, out, err = _check([str(ZERO3)], capsys)
    assert rc == 1 and out == ""
    head, *rows = err.strip().splitlines()
    assert head == f'shardkit config check: error: {len(ZERO3_AUTOS)} "auto" value(s) nothing fills; pass them with --auto:'
    listed = {row.split(":")[0].strip(): row for row in rows}
    assert set(listed) == ZERO3_AUTOS
    assert listed["zero_optimization.reduce_bucket_size"].endswith("--auto reduce_bucket_size=VALUE or --auto hidden_size=VALUE")
    assert "load_config" not in err
    rc, _, err = _check([str(ZERO2), "--set", "zero_optimization.stage=7"], capsys)
    assert rc == 1 and "zero_optimization.stage must be 0, 1, 2 or 3" in err and "load_config" not in err


AUTO_ARGS = ["--auto", "lr=3e-4", "--auto", "weight_decay=0.01", "--auto", "warmup_num_steps=10", "--auto",
             "total_num_steps=100", "--auto", "gradient_clipping=1.0", "--auto", "train_micro_batch_size_per_gpu=4"]  # fmt: skip


@pytest.mark.parametrize(
    ("sets", "world", "message"),
    [
        (["tensor_parallel.size=2", "zero_optimization.stage=0"], 2, "fp16.enabled with tensor_parallel.size > 1 needs"),
        (["pipeline.stages=2", "zero_optimization.stage=3", "fp16.enabled=false"], 2, "zero_optimization.stage=3 with pipeline"),
        (["zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu"], 1,
         "offload_param.device='cpu' needs zero_optimization.offload_optimizer"),
    ],
)  # fmt: skip
def test_config_check_refuses_what_initialize_refuses_whatever_the_script(sets, world, message, capsys) -> None:
    argv = [str(ZERO2), "--world-size", str(world), *AUTO_ARGS, *(a for kv in sets for a in ("--set", kv))]
    rc, out, err = _check(argv, capsys)
    assert rc == 1 and "valid" not in out, (out, err)
    assert message in err and "shardkit.initialize refuses this config" in err, err


def test_config_check_valid_says_what_it_cannot_know(capsys, tmp_path) -> None:
    argv = [str(ZERO2), *AUTO_ARGS, "--set", "zero_optimization.stage=0", "--set", "fp16.enabled=false",
            "--set", "bf16.enabled=true", "--set", "hybrid_engine.enabled=false",
            "--set", "torch_autocast.enabled=true", "--set", "torch_autocast.dtype=bfloat16"]  # fmt: skip
    rc, out, err = _check(argv, capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].endswith(": valid")
    assert "precision: bf16; forward under torch.autocast(bf16) (torch_autocast)" in out
    assert "hybrid_engine (disabled; the RLHF generation engine is not offered)" in out
    (note,) = [line for line in lines if line.startswith("not checked here")]
    assert "a built optimizer= that has already stepped" in note
    assert "a built torch.optim optimizer (no fp32 masters with bf16 at stage 0)" in note
    # a config without an optimizer section: the script must bring one
    no_optimizer = tmp_path / "no_optimizer.json"
    no_optimizer.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    rc, out, err = _check([str(no_optimizer)], capsys)
    assert rc == 0, err
    assert "not checked here (they need the training script's objects): that the script passes optimizer=" in out
    rc, out, err = _check(["zero2_config_accelerate.json", *AUTO_ARGS, "--set", "hybrid_engine.enabled=true"], capsys)
    assert rc == 1 and "hybrid_engine.enabled=true" in err


@pytest.mark.parametrize(
    "params, want",
    [
        ({"torch_adam": True}, 0.01),  # torch.optim.AdamW's default weight_decay
        ({"torch_adam": True, "adam_w_mode": False}, 0.0),  # torch.optim.Adam's (type Adam below)
        ({}, 0.0),  # DeepSpeed's own Adam classes
        ({"torch_adam": True, "weight_decay": 0.2}, 0.2),
    ],
)
def test_torch_adam_takes_torchs_weight_decay_default_as_deepspeed_does(params: dict, want: float) -> None:
    from shardkit.engine import load_config

    kind = "Adam" if params.get("adam_w_mode") is False else "AdamW"
    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": kind, "params": params}}, world_size=1)
    assert cfg.optimizer.params["weight_decay"] == want
    assert "optimizer.params.torch_adam" not in cfg.ignored
