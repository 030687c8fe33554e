"""``shardkit train --config ds.json`` (the demo through ``shardkit.initialize``) and ``--model
hf:gpt2`` end to end through the CLI: 2 gloo ranks against one process on the same global batch,
seed 002's configs as shipped (fp16), the config's LR schedule against DeepSpeed's formula
written out, and bad flag combinations refused with exit 2 naming the flag."""

from __future__ import annotations

import json
import re
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.examples import config_path
from shardkit.train.config import TrainConfig

pytestmark = pytest.mark.slow  # starts its own processes: run first (conftest.py)

CONFIGS = config_path("zero2_config_accelerate.json").parent
ZERO2, ZERO3 = CONFIGS / "zero2_config_accelerate.json", CONFIGS / "zero3_offload_config_accelerate.json"
LR, WARMUP, STEPS = 3e-3, 3, 6
COMMON = ["--steps", str(STEPS), "--eval-every", "3", "--d-model", "32", "--n-layers", "2", "--n-heads", "2"]
COMMON += ["--seq-len", "32", "--lr", str(LR), "--warmup", str(WARMUP), "--device", "cpu"]


def _run(args: list[str], tmp_path: Path, log: str = "run.json") -> tuple[dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "train", *COMMON, *args, "--log-json", log],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / log).read_text()), proc.stdout


def _variant(tmp_path: Path, src: Path, *, fp16: bool, gas: int = 1) -> str:
    """A copy of a seed config with fp16 switched and gradient accumulation set."""
    cfg = json.loads(src.read_text())
    cfg["fp16"]["enabled"] = fp16
    cfg["gradient_accumulation_steps"] = gas
    path = tmp_path / f"{src.stem}_fp16{fp16}_gas{gas}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _same_evals(a: dict, b: dict, tol: float = 1e-4) -> None:
    assert [s for s, _ in a["eval"]] == [s for s, _ in b["eval"]] == [3, 6]
    for (_, x), (_, y) in zip(a["eval"], b["eval"]):
        assert abs(x - y) < tol, (a["eval"], b["eval"])


def warmup_decay_lr(it: int) -> float:
    """DeepSpeed's WarmupDecayLR after ``it + 1`` scheduler steps (docs/engine.md): log warmup from
    warmup_min_lr = 0 to warmup_max_lr = LR over W = max(2, WARMUP) steps, then linear decay to 0 at
    T = STEPS; at it = -1 (construction) the min."""
    w = max(2, WARMUP)
    if it < 0:
        return 0.0
    if it < w:
        return LR * math.log(it + 1) / math.log(w)
    return LR * max(0.0, (STEPS - it) / max(1, STEPS - w))


@pytest.fixture(scope="module")
def fp32_single(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("single")
    return _run(["--nproc", "1", "--batch-size", "8", "--config", _variant(tmp, ZERO2, fp16=False)], tmp)[0]


def test_zero2_fp32_two_ranks_equal_one_process(tmp_path: Path, fp32_single: dict) -> None:
    """Global batch 8 = micro 4 x dp 2 = micro 8 x dp 1: same eval losses, the same lr per step."""
    log, out = _run(["--nproc", "2", "--batch-size", "4", "--config", _variant(tmp_path, ZERO2, fp16=False)], tmp_path)
    assert log["engine"] == {"stage": 2, "precision": "fp32", "micro": 4, "gas": 1, "dp": 2}
    _same_evals(log, fp32_single)
    assert len({r["final_eval_loss"] for r in log["ranks"]}) == 1  # the replicas agree
    assert "memory measured (planner ZeRO-2)" in out  # memory_report next to the plan
    # each rank's collectives: ZeRO-2's reduce-scatters and all-gathers, as the flag path reports them
    for r in log["ranks"]:
        assert r["comm"]["reduce_scatter"]["bytes"] > 0 and r["comm"]["all_gather"]["bytes"] > 0
        assert r["comm_links"] is None  # one machine
    assert "| comm all_gather" in out
    # the config's WarmupDecayLR, not the demo's cosine: lr of step k is the scheduler's after k - 1 steps
    for k, lr in enumerate(log["lr"]):
        assert lr == pytest.approx(warmup_decay_lr(k - 1), rel=1e-6, abs=1e-12), (k, log["lr"])
    assert log["eval"][-1][1] < log["eval"][0][1]


def test_sequence_parallel_size_two_ranks_equal_one_process(tmp_path: Path, fp32_single: dict) -> None:
    """DeepSpeed's sequence_parallel_size 2: the two ranks are one replica, each running half of
    every sequence of the whole 8-row batch (dp = world / 2 = 1)."""
    cfg = json.loads(Path(_variant(tmp_path, ZERO2, fp16=False)).read_text())
    cfg["sequence_parallel_size"], cfg["context_parallel"] = 2, {"mode": "ring"}
    path = tmp_path / "zero2_sp2.json"
    path.write_text(json.dumps(cfg))
    log, out = _run(["--nproc", "2", "--batch-size", "8", "--config", str(path)], tmp_path)
    _same_evals(log, fp32_single)
    assert "over 1 data-parallel replica (2 ranks, 2 per replica)" in out  # each token counted once
    # ZeRO-2 shards gradients and optimizer state over dp x cp = 2 ranks: the plan says so too
    grads = re.findall(r"grads ([\d.]+ \w+) \(([\d.]+ \w+)\)", out)
    assert len(grads) == 2 and all(measured == planned for measured, planned in grads), grads


def test_gradient_accumulation_is_the_same_global_batch(tmp_path: Path, fp32_single: dict) -> None:
    """micro 4 x gas 2 in one process: two engine.step() calls per optimizer step, same losses."""
    log, _ = _run(["--nproc", "1", "--batch-size", "4", "--config", _variant(tmp_path, ZERO2, fp16=False, gas=2)], tmp_path)
    assert log["engine"]["gas"] == 2 and log["engine"]["micro"] == 4
    _same_evals(log, fp32_single)


@pytest.mark.parametrize(
    "config, nproc, batch, scale",
    [(ZERO2, "2", "4", 2.0**15), (ZERO3, "1", "8", 2.0**16)],  # initial_scale_power 15 / 16
    ids=["zero2-fp16-2ranks", "zero3-offload-fp16"],
)
def test_seed_configs_as_shipped_run_in_fp16(
    tmp_path: Path, fp32_single: dict, config: Path, nproc: str, batch: str, scale: float
) -> None:
    """fp16 with dynamic loss scaling: no overflow in 6 small steps, so the scale stays at
    2^initial_scale_power (loss_scale_window 1000); the losses track the fp32 run."""
    log, out = _run(["--nproc", nproc, "--batch-size", batch, "--config", str(config)], tmp_path)
    assert log["engine"]["precision"] == "fp16"
    assert log["loss_scale"] == [scale] * STEPS
    assert f"loss scale {scale:g}" in out
    _same_evals(log, fp32_single, tol=1e-2)  # fp16 params and activations vs fp32


def test_hf_gpt2_with_config_learns_and_equals_one_process(tmp_path: Path) -> None:
    """A transformers GPT-2 (tied embeddings, the labels= loss path) under the fp32 ZeRO-2 config."""
    pytest.importorskip("transformers")
    cfg = _variant(tmp_path, ZERO2, fp16=False)
    two, out = _run(["--model", "hf:gpt2", "--nproc", "2", "--batch-size", "4", "--config", cfg], tmp_path, "two.json")
    one, _ = _run(["--model", "hf:gpt2", "--nproc", "1", "--batch-size", "8", "--config", cfg], tmp_path, "one.json")
    assert "hf:gpt2" in out
    _same_evals(two, one)
    assert two["eval"][-1][1] < two["eval"][0][1] - 0.05


def test_hf_gpt2_without_config_learns_and_equals_one_process(tmp_path: Path) -> None:
    """The same model through parallelize(): ZeRO-2 on 2 ranks against one process."""
    pytest.importorskip("transformers")
    two, _ = _run(["--model", "hf:gpt2", "--nproc", "2", "--batch-size", "4", "--strategy", "zero2"], tmp_path, "two.json")
    one, _ = _run(["--model", "hf:gpt2", "--nproc", "1", "--batch-size", "8"], tmp_path, "one.json")
    _same_evals(two, one)
    assert two["eval"][-1][1] < two["eval"][0][1] - 0.05


def test_a_flag_the_config_decides_exits_2_naming_it() -> None:
    """Through the CLI: a usage error before any worker starts (the other flags: below, in process)."""
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "train", "--config", str(ZERO2), "--nproc", "2", "--strategy", "zero2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--strategy with --config" in proc.stderr, proc.stderr[-2000:]


def test_a_config_error_exits_2_naming_the_key_before_any_worker(tmp_path: Path) -> None:
    """An unknown key (or an "auto" nothing fills) is a usage error in the launcher, not a
    traceback from every worker."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 2, "bogus_key": 1}}')
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "train", "--config", str(bad), "--nproc", "2", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "zero_optimization.bogus_key" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(config=str(ZERO2), precision="fp16"), "--fp16 with --config"),
        (dict(config=str(ZERO2), offload="cpu", strategy="zero2"), "--strategy with --config"),
        (dict(config=str(ZERO2), offload="cpu"), "--offload with --config"),
        (dict(config=str(ZERO2), tp=2, nproc=2), "--tp with --config"),
        (dict(config="no/such.json"), "no such file"),
        (dict(auto=("lr=1e-3",)), "--auto .* needs --config"),
        (dict(config=str(ZERO2), auto=("lr",)), "KEY=VALUE"),
        (dict(model="hf:gpt2", pp=2, nproc=2, strategy="ddp"), "--pp with --model hf:gpt2"),
        (dict(model="hf:llama", checkpointing="blocks"), "--checkpointing with --model hf:llama"),
        (dict(model="hf:gpt2", sample=10), "--sample"),
    ],
)
def test_bad_combinations_name_the_flag(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        TrainConfig(**kwargs).validate()
