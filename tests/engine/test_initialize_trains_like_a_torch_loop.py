"""``shardkit.initialize``: seed 002's DeepSpeed configs (shipped in shardkit/examples/) train a Hugging Face GPT-2
built from config on 2 gloo ranks.

References are independent of the engine: a plain single-process torch loop (``torch.optim.AdamW``,
``torch.nn.utils.clip_grad_norm_``, the WarmupDecayLR formula written out below) on the global
batch; the fp16 loss-scale rule written out step by step; a run without interruption for the
checkpoint resume.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from shardkit.examples import config_path
from shardkit.comm import ParallelContext
from distributed import forbid_collectives
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32

transformers = pytest.importorskip("transformers")

CONFIGS = config_path("zero2_config_accelerate.json").parent
ZERO2, ZERO3 = "zero2_config_accelerate.json", "zero3_offload_config_accelerate.json"
VOCAB, SEQ, MICRO, GAS, STEPS = 128, 16, 2, 2, 5
AUTO = dict(
    lr=3e-3, weight_decay=0.1, warmup_min_lr=1e-4, warmup_num_steps=3, total_num_steps=6,
    gradient_clipping=0.5, train_micro_batch_size_per_gpu=MICRO,
)  # fmt: skip


def _config(name: str, *, fp16: bool, gas: int = GAS, stage: int | None = None) -> dict:
    """Seed 002's config as shipped, fp16 switched as asked and gradient accumulation set."""
    cfg = json.loads((CONFIGS / name).read_text())
    cfg["fp16"]["enabled"] = fp16
    cfg["gradient_accumulation_steps"] = gas
    cfg["optimizer"]["params"]["eps"] = ADAM_EPS_ACROSS_ORDERS  # the equality tests cross an order of additions
    if stage is not None:
        cfg["zero_optimization"]["stage"] = stage
    return cfg


def _gpt2(seed: int = 0):
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)  # lm_head.weight is transformer.wte.weight


def _groups(model) -> list[dict]:
    """Trainer-style groups: no weight decay for biases and LayerNorms (the decay group by name)."""
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or ".ln_" in n]
    decay = [n for n, p in model.named_parameters() if p.dim() >= 2 and ".ln_" not in n]
    return [{"params": decay, "weight_decay": AUTO["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]


def _batch(step: int, micro: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(VOCAB, (MICRO * world, SEQ), generator=g)


def warmup_decay_lr(it: int) -> float:
    """DeepSpeed's WarmupDecayLR (docs/engine.md), log warmup: the lr after ``it + 1`` scheduler
    steps; ``it = -1`` is construction."""
    lo, hi, w, t = AUTO["warmup_min_lr"], AUTO["lr"], max(2, AUTO["warmup_num_steps"]), AUTO["total_num_steps"]
    if it < 0:
        return lo
    gamma = math.log(it + 1) / math.log(w) if it < w else max(0.0, (t - it) / max(1, t - w))
    return lo + (hi - lo) * gamma


def _reference(steps: int, world: int) -> tuple[dict, list[float]]:
    """One process, plain torch, the global batch: AdamW, clip, the written-out schedule."""
    model = _gpt2()
    groups = _groups(model)
    named = dict(model.named_parameters())
    groups[0]["params"] = [named[n] for n in groups[0]["params"]]
    opt = torch.optim.AdamW(groups, lr=AUTO["lr"], eps=ADAM_EPS_ACROSS_ORDERS)
    norms = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = warmup_decay_lr(step - 1)  # step k runs with the lr of k scheduler steps
        for micro in range(GAS):
            x = _batch(step, micro, world)
            (model(input_ids=x, labels=x).loss / GAS).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), AUTO["gradient_clipping"])))
        opt.step()
        opt.zero_grad()
    return model.state_dict(), norms


# ---- fp32: equal to one process ----------------------------------------------------------------
def _equality_body(name: str, stage: int | None) -> dict:
    import shardkit

    world = torch.distributed.get_world_size()
    with ParallelContext.from_world() as ctx:
        rank = ctx.rank("dp")
        model = _gpt2()
        engine, opt, loader, sched = shardkit.initialize(
            model=model, model_parameters=_groups(model), config=_config(name, fp16=False, stage=stage), ctx=ctx, **AUTO
        )
        assert loader is None and opt is engine.optimizer and sched is engine.lr_scheduler
        assert engine.gradient_accumulation_steps() == GAS and engine.train_batch_size() == MICRO * GAS * world
        lrs, norms, boundaries = [], [], []
        for step in range(STEPS):
            for micro in range(GAS):
                x = _batch(step, micro, world)[MICRO * rank : MICRO * (rank + 1)]
                boundaries.append(engine.is_gradient_accumulation_boundary())
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
                lrs.append(engine.get_lr())
            assert engine.was_step_applied()
            norms.append(engine.get_global_grad_norm())
        ref, ref_norms = _reference(STEPS, world)
        full = engine.full_state_dict()
        for k, r in ref.items():
            if k in full:  # GPT-2's causal-mask buffers are not in every transformers version
                torch.testing.assert_close(full[k], r, **FP32, msg=lambda m, k=k: f"{k}: {m}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **FP32)
        assert min(ref_norms) > AUTO["gradient_clipping"]  # clipping changed every step
        # the scheduler steps once per optimizer step, not per micro-batch
        assert boundaries == [False, True] * STEPS
        expect = [warmup_decay_lr(step - (micro < GAS - 1)) for step in range(STEPS) for micro in range(GAS)]
        assert [lr[0] for lr in lrs] == pytest.approx(expect, rel=1e-12)
        assert all(lr[0] == lr[1] for lr in lrs)
        assert engine.global_steps == STEPS and engine.micro_steps == STEPS * GAS
        report = engine.memory_report()
        assert report["model_state"] > 0
        return {"stage": engine.zero_optimization_stage(), "offloaded": report.get("offloaded")}


@pytest.mark.parametrize(
    "name,stage",
    [(ZERO2, 0), (ZERO2, 1), (ZERO2, None), (ZERO3, None)],
    ids=["zero2-config-stage0", "zero2-config-stage1", "zero2-config", "zero3-offload-config"],
)
@pytest.mark.reduction_order
def test_seed_configs_fp32_equal_one_process(dist_pool, name, stage):
    out = dist_pool.run(_equality_body, name, stage, world_size=2, timeout=120)
    if name == ZERO3:
        assert out[0]["stage"] == 3 and out[0]["offloaded"]["cpu"] > 0  # masters and Adam state on the CPU
    else:
        assert out[0]["stage"] == (2 if stage is None else stage)


def _offload_param_body() -> dict:
    """Seed 002's ZeRO-3 CPU-offload config with and without its offload_param section (and
    without prefetch): the same training, bitwise."""
    import shardkit

    world = torch.distributed.get_world_size()
    runs = {}
    with ParallelContext.from_world() as ctx:
        for keep in (True, False):
            cfg = _config(ZERO3, fp16=False)
            if not keep:
                del cfg["zero_optimization"]["offload_param"]
                cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0  # DeepSpeed: no prefetch
            model = _gpt2()
            engine, *_ = shardkit.initialize(model=model, model_parameters=_groups(model), config=cfg, ctx=ctx, **AUTO)
            # stage3_prefetch_bucket_size > 0 ("auto" here: 0.9·hidden²) turns forward prefetch on
            assert engine._wrapped._units.forward_prefetch == keep
            losses = _train(engine, range(3), ctx.rank("dp"), world)
            runs[keep] = (losses, engine.full_state_dict(), engine.memory_report())
    (losses, state, mem), (losses0, state0, mem0) = runs[True], runs[False]
    assert losses == losses0  # bitwise: the host shard is the same fp32 shard
    for k, v in state.items():
        assert torch.equal(v, state0[k]), k
    assert mem["offloaded"]["params"] > 0 and "params" not in mem0["offloaded"]
    assert mem["params"] < mem0["params"]  # the device keeps no parameter shard between gathers
    return {"host_param_bytes": mem["offloaded"]["params"]}


def test_offload_param_trains_identically_and_keeps_the_shards_on_the_host(dist_pool):
    out = dist_pool.run(_offload_param_body, world_size=2, timeout=120)
    assert out[0]["host_param_bytes"] > 0


# ---- fp16: the loss-scaler path ----------------------------------------------------------------
def expected_scales(overflows: list[bool], power: int, hysteresis: int, window: int) -> list[float]:
    """The scale after each step under DeepSpeed's rule (docs/reference.md "fp16 dynamic loss
    scaling"), written out: an overflow spends one hysteresis, the last one halves the scale;
    window clean steps since the last overflow double it."""
    scale, hyst, last_overflow, out = 2.0**power, hysteresis, -1, []
    for it, overflow in enumerate(overflows):
        if overflow:
            if hyst == 1:
                scale /= 2
            else:
                hyst -= 1
            last_overflow = it
        elif (it - last_overflow - 1) > 0 and (it - last_overflow - 1) % window == 0:
            scale, hyst = scale * 2, hysteresis
        out.append(scale)
    return out


def _fp16_body(name: str) -> dict:
    import shardkit

    world = torch.distributed.get_world_size()
    overflow_at = {1, 2}  # hysteresis 2: the first overflow keeps the scale, the second halves it
    with ParallelContext.from_world() as ctx:
        rank = ctx.rank("dp")
        model = _gpt2()
        cfg = _config(name, fp16=True)
        engine, *_ = shardkit.initialize(model=model, config=cfg, ctx=ctx, **AUTO)
        assert next(engine.module.parameters()).dtype == torch.float16 and engine.fp16_enabled()
        scales, applied, lrs, before = [], [], [], None
        for step in range(4):
            before = engine.full_state_dict()
            for micro in range(GAS):
                x = _batch(step, micro, world)[MICRO * rank : MICRO * (rank + 1)]
                loss = engine(input_ids=x, labels=x).loss
                hook = None
                if step in overflow_at and micro == GAS - 1 and rank == world - 1:  # ONE rank overflows
                    w = engine.module.transformer.h[0].mlp.c_fc.weight
                    hook = w.register_hook(lambda g: torch.full_like(g, float("inf")))
                engine.backward(loss)
                if hook is not None:
                    hook.remove()
                engine.step()
            scales.append(engine.get_loss_scale())
            applied.append(engine.was_step_applied())
            lrs.append(engine.get_lr()[0])
            after = engine.full_state_dict()
            changed = any(not torch.equal(before[k], after[k]) for k in after)
            assert changed == applied[-1], f"step {step}: params changed={changed} but applied={applied[-1]}"
        fp16 = cfg["fp16"]
        want = expected_scales([s in overflow_at for s in range(4)], fp16["initial_scale_power"], fp16["hysteresis"], 1000)
        assert scales == want
        assert applied == [s not in overflow_at for s in range(4)]
        assert engine.skipped_steps == 2 and engine.global_steps == 4
        # as DeepSpeed: a skipped step does not advance the scheduler
        assert lrs == pytest.approx([warmup_decay_lr(0), warmup_decay_lr(0), warmup_decay_lr(0), warmup_decay_lr(1)])
        return {"scales": scales}


@pytest.mark.parametrize("name", [ZERO2, ZERO3])
def test_fp16_overflow_skips_on_every_rank_and_follows_the_scaler_rule(dist_pool, name):
    out = dist_pool.run(_fp16_body, name, world_size=2, timeout=120)
    assert out[0] == out[1]


# ---- checkpoints -------------------------------------------------------------------------------
def _train(engine, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        for micro in range(GAS):
            x = _batch(step, micro, world)[MICRO * rank : MICRO * (rank + 1)]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def _checkpoint_body(name: str, fp16: bool, root: str) -> None:
    import shardkit

    world = torch.distributed.get_world_size()
    with ParallelContext.from_world() as ctx:
        rank = ctx.rank("dp")
        cfg = _config(name, fp16=fp16)
        model = _gpt2()
        engine, *_ = shardkit.initialize(model=model, model_parameters=_groups(model), config=cfg, ctx=ctx, **AUTO)
        _train(engine, range(3), rank, world)
        engine.save_checkpoint(root, client_state={"epoch": 7})
        straight = _train(engine, range(3, 6), rank, world)
        final = engine.full_state_dict()
        model = _gpt2(seed=1)  # other weights: everything must come from the checkpoint
        resumed, *_ = shardkit.initialize(model=model, model_parameters=_groups(model), config=cfg, ctx=ctx, **AUTO)
        path, client = resumed.load_checkpoint(root)
        assert path == str(Path(root) / "global_step3") and client == {"epoch": 7}
        assert (resumed.global_steps, resumed.micro_steps) == (3, 3 * GAS)
        assert resumed.get_lr() == engine_lr_after(3)
        if fp16:
            assert resumed.loss_scaler.state_dict() == _scaler_after_3(cfg)
        again = _train(resumed, range(3, 6), rank, world)
        assert again == straight  # bitwise on CPU
        for k, v in resumed.full_state_dict().items():
            assert torch.equal(v, final[k]), k
        assert resumed.get_lr() == engine.get_lr()
        if fp16:
            assert resumed.loss_scaler.state_dict() == engine.loss_scaler.state_dict()


def engine_lr_after(steps: int) -> list[float]:
    return [warmup_decay_lr(steps - 1)] * 2


def _scaler_after_3(cfg: dict) -> dict:
    from shardkit.parallel import DynamicLossScaler

    s = DynamicLossScaler(**{k: v for k, v in cfg["fp16"].items() if k != "enabled"})
    for _ in range(3):
        s.update(False)
    return s.state_dict()


@pytest.mark.parametrize("name,fp16", [(ZERO2, True), (ZERO3, False)], ids=["zero2-fp16", "zero3-offload-fp32"])
def test_checkpoint_round_trip_resumes_bitwise(dist_pool, tmp_path, name, fp16):
    dist_pool.run(_checkpoint_body, name, fp16, str(tmp_path / "ckpt"), world_size=2, timeout=120)


# ---- errors before any collective ----------------------------------------------------------------
def _bad_inputs_body(nvme_root: str) -> None:
    import shardkit

    with ParallelContext.from_world() as ctx:
        good = _config(ZERO2, fp16=False)
        model = _gpt2()
        other = torch.nn.Parameter(torch.zeros(3))

        def cfg(**changes) -> dict:
            c = json.loads(json.dumps(good))
            for dotted, value in changes.items():
                *path, last = dotted.split("__")
                node = c
                for part in path:
                    node = node.setdefault(part, {})
                node[last] = value
            return c

        no_lr = {k: v for k, v in AUTO.items() if k != "lr"}
        stepped = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        stepped.step()
        for p in model.parameters():
            p.grad = None
        cases = [
            (dict(config=cfg(train_batch_size=5)), ValueError, "train_batch_size"),
            (dict(config=cfg(zero_optimization__bogus=1)), ValueError, "zero_optimization.bogus"),
            (dict(config=good, auto=no_lr), ValueError, "optimizer.params.lr"),
            (
                dict(config=cfg(zero_optimization__offload_optimizer={"device": "nvme"})),
                ValueError,
                "zero_optimization.offload_optimizer.nvme_path",
            ),
            (
                dict(config=cfg(zero_optimization__offload_optimizer={"device": "nvme", "nvme_path": nvme_root + "/no"})),
                ValueError,
                "nvme_path",
            ),
            (dict(config=good, model_parameters=[other]), ValueError, "model_parameters"),
            (dict(config=good, model_parameters=[{"params": ["nope.weight"]}]), ValueError, "model_parameters"),
            # a built optimizer is rebuilt on the shards, unless it already stepped (its state has no place there)
            (dict(config=good, optimizer=stepped), TypeError, "already stepped"),
            (dict(config=good, optimizer=torch.optim.AdamW([other])), ValueError, "not parameters of the model"),
            (dict(config=cfg(tensor_parallel={"size": 2})), ValueError, "tensor_parallel.size"),
            (dict(config=None), ValueError, "config"),
        ]
        for case, exc, key in cases:
            kwargs = dict(case)
            auto = kwargs.pop("auto", AUTO)
            stack = forbid_collectives()
            try:
                with pytest.raises(exc, match=key.replace(".", r"\.")):
                    shardkit.initialize(model=model, ctx=ctx, **kwargs, **auto)
            finally:
                stack.stop()


def test_bad_inputs_raise_naming_the_key_before_any_collective(dist_pool, tmp_path):
    dist_pool.run(_bad_inputs_body, str(tmp_path), world_size=2, timeout=60)


def test_import_shardkit_does_not_import_torch():
    code = "import sys, shardkit; assert 'torch' not in sys.modules; assert callable(shardkit.initialize)"
    subprocess.run([sys.executable, "-c", code], check=True)


EXIT_SCRIPT = """
import atexit, socket, sys
import torch, torch.distributed as dist
import shardkit

# registered first, so it runs after initialize's hook (atexit runs hooks last-in, first-out)
atexit.register(lambda: print("world at exit:", dist.is_initialized(), flush=True))
if sys.argv[1] == "script":  # a DeepSpeed-style script that makes the world itself
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = torch.nn.Linear(8, 8)
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
engine, *_ = shardkit.initialize(model=model, model_parameters=model.parameters(), config=config)
engine.backward(engine(torch.randn(2, 8)).square().mean())
engine.step()
print("world after the step:", dist.is_initialized(), flush=True)
"""


@pytest.mark.parametrize("world", ["script", "initialize"])
def test_the_groups_initialize_made_are_destroyed_at_exit(tmp_path: Path, world: str) -> None:
    """A DeepSpeed script never destroys its process groups; a gloo group left to interpreter
    teardown aborted 1 run in 20 of notebooks/scripts/train_deepspeed.py ("terminate called
    without an active exception"). initialize destroys what it made, and the world, at exit."""
    env = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    if world == "initialize":  # initialize rendezvouses itself (torchrun's variables)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    run = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, world], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "world after the step: True" in run.stdout and "world at exit: False" in run.stdout, run.stdout


def test_deepspeed_names_are_accepted_at_their_defaults():
    import shardkit

    with mock.patch("shardkit.engine.entry.load_config", side_effect=AssertionError("not reached")):
        with pytest.raises(NotImplementedError, match="mpu"):
            shardkit.initialize(model=_gpt2(), config={}, ctx=None, mpu=object())


# ---- DeepSpeed itself, same config -------------------------------------------------------------
def _resolved_for_deepspeed(cfg: dict) -> dict:
    """The config with its "auto" values filled as HF's Trainer would (DeepSpeed reads no "auto")."""
    cfg = json.loads(json.dumps(cfg))
    cfg["optimizer"]["params"].update(lr=AUTO["lr"], weight_decay=AUTO["weight_decay"])
    cfg["scheduler"]["params"].update(
        warmup_min_lr=AUTO["warmup_min_lr"], warmup_max_lr=AUTO["lr"],
        warmup_num_steps=AUTO["warmup_num_steps"], total_num_steps=AUTO["total_num_steps"],
    )  # fmt: skip
    cfg.update(
        gradient_clipping=AUTO["gradient_clipping"], train_micro_batch_size_per_gpu=MICRO, train_batch_size=MICRO * GAS * 2
    )
    return cfg


def _deepspeed_body(name: str) -> dict:
    import os

    import shardkit

    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(torch.distributed.get_rank()))
    deepspeed = pytest.importorskip("deepspeed")
    world = torch.distributed.get_world_size()
    cfg = _config(name, fp16=False)
    with ParallelContext.from_world() as ctx:
        rank = ctx.rank("dp")
        ours, *_ = shardkit.initialize(model=_gpt2(), config=cfg, ctx=ctx, **AUTO)
        model = _gpt2()
        theirs, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_resolved_for_deepspeed(cfg))
        out = {}
        for who, engine in (("shardkit", ours), ("deepspeed", theirs)):
            losses, lrs = [], []
            for step in range(STEPS):
                for micro in range(GAS):
                    x = _batch(step, micro, world)[MICRO * rank : MICRO * (rank + 1)]
                    loss = engine(input_ids=x, labels=x).loss
                    engine.backward(loss)
                    engine.step()
                    losses.append(float(loss))
                lrs.append(engine.get_lr()[0])
            out[who] = (losses, lrs)
        return out


@pytest.mark.timeout(900)  # DeepSpeed JIT-builds its CPU extensions on a fresh checkout
@pytest.mark.parametrize("name", [ZERO2])
def test_losses_equal_deepspeed_with_the_same_config(dist_pool, name):
    # 600 s: DeepSpeed JIT-builds its CPU extensions (cc1plus) on a fresh checkout before the first step
    for out in dist_pool.run(_deepspeed_body, name, world_size=2, timeout=600):
        (ours, our_lrs), (theirs, their_lrs) = out["shardkit"], out["deepspeed"]
        assert our_lrs == pytest.approx(their_lrs, rel=1e-12)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), **FP32)
