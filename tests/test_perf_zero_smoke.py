"""Smoke test of the ZeRO benchmark (perf/zero.py, ``shardkit bench zero``) on a tiny TinyGPT.

The benchmark itself is never part of the test run: ``--quick`` runs ours and the torch peers
(ZeroRedundancyOptimizer, FSDP2) for a few steps at 2 gloo ranks (~10-20 s on 2 busy cores;
DeepSpeed is left out here: its import and op builds alone take longer) and checks that the
JSON carries every field the report needs, that the ratios are the ones its own numbers give,
and that the memory it counts matches the closed-form bytes of each layout.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardkit.bench.zero_peers import CATEGORIES, PEERS, SHARDKIT, storage_bytes

REPO = Path(__file__).resolve().parents[1]


def test_storage_bytes_counts_each_storage_once() -> None:
    flat = torch.zeros(10)
    other = torch.zeros(3, dtype=torch.float64)
    assert storage_bytes([flat[:4], flat[4:], flat, None, "x", other]) == 10 * 4 + 3 * 8
    assert storage_bytes([]) == 0


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
    assert res["stages"]["3"]["built"] is False and "not built" in res["stages"]["3"]["reason"]
    for stage in ("1", "2"):
        st = res["stages"][stage]
        assert set(st["configs"]) == {SHARDKIT, *PEERS[int(stage)]}
        assert st["configs"]["deepspeed"] == {"available": False, "reason": "not selected (--configs)"}
        live = {k: c for k, c in st["configs"].items() if c["available"]}
        assert set(live) == {SHARDKIT, PEERS[int(stage)][0]}
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
        assert st["fastest_peer"] == min(st["ratios"], key=lambda p: live[p]["median_ms"])


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


def test_report_renders_one_row_per_built_stage(report: tuple[dict, Path]) -> None:
    res, _ = report
    rows = runpy.run_path(str(REPO / "perf" / "report.py"))["_zero_rows"](res)
    assert len(rows) == 2
    for stage, row in zip(("1", "2"), rows):
        st = res["stages"][stage]
        assert row.startswith(f"| ZeRO-{stage} step") and f"**{st['ratios'][st['fastest_peer']]['time_median']:.3f}×**" in row
