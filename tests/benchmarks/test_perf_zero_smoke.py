"""Smoke test of the ZeRO benchmark (perf/zero.py, ``shardkit bench zero``) on a tiny TinyGPT.

The benchmark itself is never part of the test run: ``--quick`` runs ours (stages 1-3, and
stages 2-3 with ``offload="cpu"``) and the torch peers (ZeroRedundancyOptimizer, FSDP2 with
``reshard_after_forward`` False for stage 2 and True for stage 3) for a few steps at 2 gloo ranks
(~20-30 s on 2 busy cores; DeepSpeed is left out here: its import and op builds alone take
longer) and checks that the JSON carries every field the report needs, that the ratios are the
ones its own numbers give, that every configuration's step-0 loss is the same, and that the
memory it counts matches the closed-form bytes of each layout.
"""

from __future__ import annotations

import argparse
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_peers import CATEGORIES, OFFLOAD_PEERS, PEERS, SHARDKIT, build_model, storage_bytes
from zero_report import LOSS_RTOL, check_losses

pytestmark = pytest.mark.slow  # starts its own processes: run first (conftest.py)

REPO = Path(__file__).resolve().parents[2]


def test_storage_bytes_counts_each_storage_once() -> None:
    flat = torch.zeros(10)
    other = torch.zeros(3, dtype=torch.float64)
    assert storage_bytes([flat[:4], flat[4:], flat, None, "x", other]) == 10 * 4 + 3 * 8
    assert storage_bytes([]) == 0


def test_loss_check_names_the_configuration_that_differs() -> None:
    same = {"2/shardkit": [[4.5, 4.4], [4.6, 4.5]], "2/torch.fully_shard": [[4.5, 4.41], [4.6, 4.5]]}
    assert check_losses(same) == {"step0_max_rel_diff": 0.0, "step1_max_rel_diff": pytest.approx(0.01 / 4.4)}
    off = {**same, "3/deepspeed": [[4.5, 4.4], [4.6 * (1 + 10 * LOSS_RTOL), 4.5]]}
    with pytest.raises(SystemExit, match=r"3/deepspeed \(rank 1\)"):
        check_losses(off)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("zero")
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "perf" / "zero.py"),
            "--quick",
            "--out",
            str(out),
            "--configs",
            SHARDKIT,
            "torch.ZeroRedundancyOptimizer",
            "torch.fully_shard",
        ],
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard only
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "zero_cpu_quick.json").read_text()), out


def test_quick_run_json_structure_and_ratios(report: tuple[dict, Path]) -> None:
    res, out = report
    assert (out / "zero_cpu_quick.png").stat().st_size > 1000
    assert res["command"].startswith("shardkit bench zero") and "--quick" in res["command"]
    assert res["nproc"] == 2 and res["backend"] == "gloo"
    assert list(res["stages"]) == ["1", "2", "2+cpu", "3", "3+cpu"]
    for key, st in res["stages"].items():
        stage, offload = int(key[0]), ("cpu" if key.endswith("+cpu") else None)
        assert (st["built"], st["stage"], st["offload"]) == (True, stage, offload)
        peers = PEERS[stage] if offload is None else OFFLOAD_PEERS
        assert set(st["configs"]) == {SHARDKIT, *peers}
        assert st["configs"]["deepspeed"] == {"available": False, "reason": "not selected (--configs)"}
        live = {k: c for k, c in st["configs"].items() if c["available"]}
        assert set(live) == ({SHARDKIT, peers[0]} if offload is None else {SHARDKIT})
        for c in live.values():
            assert c["n"] == res["settings"]["steps"] * res["settings"]["repeats"]
            assert 0 < c["min_ms"] <= c["median_ms"]
            assert len(c["memory_per_rank"]) == res["nproc"]
            for m in c["memory_per_rank"]:
                assert m["model_state"] == sum(m[k] for k in CATEGORIES)
            # the reported memory is the worst rank's (the one that runs out first)
            assert c["memory"] == max(c["memory_per_rank"], key=lambda m: m["model_state"])
        ours = live[SHARDKIT]
        assert set(st["ratios"]) == set(live) - {SHARDKIT}
        for peer, r in st["ratios"].items():
            c = live[peer]
            assert r["time_median"] == ours["median_ms"] / c["median_ms"]
            assert r["time_min"] == ours["min_ms"] / c["min_ms"]
            assert r["model_state"] == ours["memory"]["model_state"] / c["memory"]["model_state"]
            assert r["model_state_in_step"] == ours["memory"]["model_state_in_step"] / c["memory"]["model_state_in_step"]
        assert st["fastest_peer"] == (min(st["ratios"], key=lambda p: live[p]["median_ms"]) if st["ratios"] else None)


def test_quick_run_step0_losses_equal_across_configurations(report: tuple[dict, Path]) -> None:
    """Same weights, same batch: every configuration's first loss is the same number (the
    script asserts it on every rank; here rank 0's values, against the report's own check)."""
    res, _ = report
    firsts = [c["loss_first_steps_rank0"] for st in res["stages"].values() for c in st["configs"].values() if c["available"]]
    assert len(firsts) == 8 and all(len(f) == 2 for f in firsts)
    assert max(abs(f[0] - firsts[0][0]) for f in firsts) <= LOSS_RTOL * abs(firsts[0][0])
    assert res["loss_check"]["step0_max_rel_diff"] <= res["loss_check"]["rtol_step0"] == LOSS_RTOL
    assert all(f[1] < f[0] for f in firsts)  # one AdamW step on the same batch lowers its loss


def test_quick_run_memory_matches_the_layout_formulas(report: tuple[dict, Path]) -> None:
    """Bytes per rank against closed forms (docs/reference.md, "ZeRO memory and communication"):
    the peers' exact tensor sizes, ours within the 16·N-element padding of each bucket."""
    res, _ = report
    psi, n = res["params"], res["nproc"]
    zro = res["stages"]["1"]["configs"]["torch.ZeroRedundancyOptimizer"]["memory"]
    assert zro["params"] == zro["grads"] == 4 * psi  # replicated params, DDP's full gradient
    assert zro["params_in_step"] == 4 * psi
    fsdp = res["stages"]["2"]["configs"]["torch.fully_shard"]["memory"]
    assert fsdp["params"] == fsdp["grads"] == 4 * psi // n  # sharded at rest (psi is even here)
    assert fsdp["params_in_step"] == 4 * psi // n + 4 * psi  # + the gathered params, forward to backward
    assert fsdp["model_state_in_step"] == fsdp["model_state"] + 4 * psi
    assert 0 < fsdp["model_state"] - 16 * psi // n <= 4 * 1024  # + AdamW's fp32 `step` scalar per tensor
    # ZeroRedundancyOptimizer splits whole params greedily: its ranks' Adam states differ but sum to 8Ψ
    per_rank = res["stages"]["1"]["configs"]["torch.ZeroRedundancyOptimizer"]["memory_per_rank"]
    extra = sum(m["optimizer_state"] for m in per_rank) - 8 * psi  # torch AdamW's one `step` scalar per tensor
    assert 0 < extra <= 8 * 1024, extra
    for stage, formula in (("1", 4 * psi + 4 * psi + 8 * psi // n), ("2", 4 * psi + 12 * psi // n)):
        ours = res["stages"][stage]["configs"][SHARDKIT]["memory"]
        assert res["formulas_bytes"][f"stage{stage}"] == formula
        assert formula <= ours["model_state"] <= formula * 1.02, (stage, ours, formula)
        assert ours["master_params"] == 0  # fp32 params are their own master
        assert ours["params_in_step"] == ours["params"]  # stages 1-2 gather nothing
        assert ours["model_state_in_step"] == ours["model_state"]


def test_quick_run_stage3_memory_matches_the_layout_formulas(report: tuple[dict, Path]) -> None:
    """Stage 3 and the offload rows: 16Ψ/N at rest for both; in step, the root plus the units
    gathered at once — one block for both (neither prefetches in forward by default)."""
    res, _ = report
    psi, n = res["params"], res["nproc"]
    args = argparse.Namespace(vocab=128, d_model=64, n_layers=2, n_heads=4, seq_len=32)  # perf/zero.py --quick
    model = build_model(args)
    assert sum(p.numel() for p in model.parameters()) == psi
    block = 4 * max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    root = 4 * psi - 4 * sum(p.numel() for p in model.blocks.parameters())
    st = res["stages"]["3"]["configs"]
    fsdp, ours = st["torch.fully_shard"]["memory"], st[SHARDKIT]["memory"]
    assert fsdp["params"] == fsdp["grads"] == 4 * psi // n
    assert 0 < fsdp["model_state"] - 16 * psi // n <= 4 * 1024  # + AdamW's fp32 `step` scalar per tensor
    assert fsdp["params_in_step"] == 4 * psi // n + root + block
    assert res["formulas_bytes"]["stage3"] == 16 * psi // n
    assert 16 * psi // n <= ours["model_state"] <= 16 * psi // n * 1.02, ours
    assert ours["master_params"] == 0
    gathered = ours["params_in_step"] - ours["params"]
    assert root + block <= gathered <= (root + block) * 1.05, (gathered, root + block)  # + the buckets' padding
    assert ours["model_state_in_step"] == ours["model_state"] + gathered
    for stage, rest in (("2", 4 * psi + 4 * psi // n), ("3", 8 * psi // n)):  # params + grad shard on the device
        off = res["stages"][f"{stage}+cpu"]["configs"][SHARDKIT]["memory"]
        assert off["optimizer_state"] == off["master_params"] == 0
        assert rest <= off["model_state"] <= rest * 1.02, (stage, off)
        assert 12 * psi // n <= off["offloaded"]["cpu"] <= 12 * psi // n * 1.02  # fp32 master + Adam's m, v


def test_report_renders_one_row_per_built_stage(report: tuple[dict, Path]) -> None:
    res, _ = report
    rows = runpy.run_path(str(REPO / "perf" / "report.py"))["_zero_rows"](res)
    assert len(rows) == 3  # the offload rows have no peer without DeepSpeed: no README row
    for stage, row in zip(("1", "2", "3"), rows):
        st = res["stages"][stage]
        assert row.startswith(f"| ZeRO-{stage} step") and f"**{st['ratios'][st['fastest_peer']]['time_median']:.3f}×**" in row


def test_report_renders_an_offload_row_with_time_only() -> None:
    """perf/report.py on a written-out offload row: its label, the peer's time, no memory ratio."""
    cfg = {"available": True, "median_ms": 30.0, "min_ms": 25.0}
    res = {
        "params": 2e7,
        "nproc": 2,
        "backend": "gloo",
        "command": "shardkit bench zero",
        "stages": {
            "3+cpu": {
                "built": True,
                "stage": 3,
                "offload": "cpu",
                "configs": {SHARDKIT: {**cfg, "median_ms": 15.0}, "deepspeed": cfg},
                "ratios": {"deepspeed": {"time_median": 0.5, "time_min": 0.6}},
                "fastest_peer": "deepspeed",
            }
        },
    }
    (row,) = runpy.run_path(str(REPO / "perf" / "report.py"))["_zero_rows"](res)
    assert row.startswith("| ZeRO-3 + CPU optimizer offload step, 20.0M-param TinyGPT, 2 ranks gloo | 15.0 ms |")
    assert "deepspeed offload_optimizer cpu 30.0 ms | **0.500×** (min 0.600×)" in row and "memory" not in row
