"""``shardkit train`` with tensor, pipeline and offload options, end to end through the CLI:
each run's losses against the single-process run on the same global batch, and every bad
combination refused (exit 2, the flag named) before any process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.train.config import TrainConfig

pytestmark = pytest.mark.slow  # starts its own processes: run first (conftest.py)

# 3 TinyGPT blocks with the embedding and the head: 5 pipeline blocks
COMMON = ["--steps", "6", "--eval-every", "3", "--d-model", "32", "--n-layers", "3", "--n-heads", "2", "--seq-len", "32"]
COMMON += ["--batch-size", "8", "--device", "cpu"]


def _run(args: list[str], tmp_path: Path, log: str) -> dict:
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
    return json.loads((tmp_path / log).read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(["--nproc", "1"], tmp_path_factory.mktemp("single"), "single.json")


# Through the real command line, one run per family of flags that must reach the workers intact
# (tp with sequence parallelism; a pipeline schedule with checkpointing; ZeRO with offload). The
# other layouts (tp alone, 1f1b, tp x ZeRO-3, ...) step bitwise like parallelize() in process
# (tests/cli/test_train_builds_through_parallelize.py), and parallelize() like the dense model
# (tests/compose/); the flags themselves round-trip through argv (test_config_round_trips_through_argv).
@pytest.mark.parametrize(
    "args",
    [
        ["--nproc", "2", "--tp", "2", "--sequence-parallel"],  # vocab-parallel loss, TP-aware clip, SP
        ["--nproc", "2", "--pp", "2", "--schedule", "zb-h1", "--checkpointing", "blocks"],
        ["--nproc", "2", "--strategy", "zero2", "--offload", "cpu", "--batch-size", "4"],  # dp 2 x 4 rows = 8
        ["--nproc", "2", "--cp", "2", "--cp-mode", "ulysses", "--strategy", "ddp"],  # each rank 16 of 32 tokens
        # the same with the head's loss formed from its input (the single run's is not)
        ["--nproc", "2", "--cp", "2", "--strategy", "ddp", "--fused-ce"],
    ],
    ids=["tp2-sp", "pp2-zbh1-ckpt", "zero2-offload-cpu", "cp2-ulysses", "cp2-ring-fused-ce"],
)
def test_train_matches_the_single_process_run(tmp_path: Path, single: dict, args: list[str]) -> None:
    """Same global batch (8 rows), same seed: the same losses as one process, every step."""
    log = _run(args, tmp_path, "run.json")
    # the run's flags come after COMMON, so the zero2 run's --batch-size 4 wins: 4 rows x 2 ranks = 8
    assert len(log["train_loss"]) == len(single["train_loss"]) == 6
    if "--strategy" not in args:  # dp = 1: rank 0's loss is the global batch's (with dp it is its rows')
        for ours, ref in zip(log["train_loss"], single["train_loss"]):
            assert abs(ours - ref) < 1e-4, (log["train_loss"], single["train_loss"])
    for (s1, e1), (s2, e2) in zip(log["eval"], single["eval"]):
        assert s1 == s2 and abs(e1 - e2) < 1e-4
    assert len({r["final_eval_loss"] for r in log["ranks"]}) == 1  # every rank agrees


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(nproc=3, tp=2, strategy="ddp"), "multiple of tp x pp"),
        (dict(nproc=4, tp=2, strategy="none"), "dp=2"),
        (dict(nproc=2, pp=2, strategy="zero3"), "zero3"),
        (dict(nproc=2, tp=2, precision="fp16"), "fp16"),
        (dict(nproc=2, pp=2, precision="bf16"), "fp32"),
        (dict(nproc=2, pp=2, microbatches=3), "microbatches"),
        (dict(nproc=2, pp=4), "multiple of tp x pp"),
        (dict(nproc=2, pp=2, n_layers=1, virtual_stages=2, schedule="interleaved"), "blocks"),
        (dict(virtual_stages=2), "interleaved"),
        (dict(offload="cpu", strategy="ddp", nproc=2), "offload"),
        (dict(offload="nvme", strategy="zero2", nproc=2), "nvme-dir"),
        (
            dict(offload="nvme", strategy="zero2", nproc=2, nvme_dir="/no/such/dir"),
            "--nvme-dir: nvme_dir '/no/such/dir' does not exist",
        ),
        (dict(nproc=2, pp=2, schedule="interleaved"), "--virtual-stages V >= 2"),
        (dict(nproc=2, tp=2, n_heads=3, d_model=48), "n_heads"),
        (dict(sequence_parallel=True), "sequence_parallel"),
        (dict(nproc=2, tp=2, seq_len=33, sequence_parallel=True), "seq_len=33"),
        (dict(nproc=3, cp=2, strategy="ddp"), "multiple of cp x tp x pp"),
        (dict(nproc=2, cp=2), "--cp needs --strategy"),
        (dict(nproc=2, cp=2, strategy="ddp", dropout=0.1), "use --cp-mode ulysses or --dropout 0"),
        (dict(nproc=2, cp=2, strategy="ddp", seq_len=30), "multiple of 2 x cp = 4"),
        (dict(nproc=4, cp=4, strategy="ddp", n_heads=2, d_model=32, cp_mode="ulysses"), "--cp-mode ring"),
        (dict(nproc=2, cp=2, strategy="ddp", sample=100), "--sample 0"),
        (dict(nproc=2, cp=2, config="zero2_config_accelerate.json"), "its sequence_parallel_size"),
        (dict(nproc=4, cp=4, strategy="ddp", cp_mode="hybrid"), "needs --cp-ulysses U"),
        (dict(nproc=4, cp=4, strategy="ddp", cp_mode="hybrid", cp_ulysses=3), "a divisor of --cp 4"),
        (dict(nproc=4, cp=4, strategy="ddp", cp_mode="hybrid", cp_ulysses=4, n_heads=2, d_model=32), "--cp-ulysses 4"),
        (dict(nproc=2, cp=2, strategy="ddp", cp_ulysses=2), "--cp-mode hybrid only"),
    ],
)
def test_bad_parallel_combinations_name_the_flag(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        TrainConfig(**kwargs).validate()


def test_dropout_under_cp_is_accepted_with_ulysses() -> None:
    TrainConfig(nproc=2, cp=2, strategy="ddp", dropout=0.1, cp_mode="ulysses").validate()


def test_a_torchrun_worker_validates_against_its_world() -> None:
    """Workers run with nproc=1 in a world of WORLD_SIZE ranks (the launcher drops --nproc)."""
    TrainConfig(nproc=1, tp=2, pp=2).validate(world_size=4)
    with pytest.raises(ValueError, match="multiple of tp x pp"):
        TrainConfig(nproc=1, tp=2).validate()
