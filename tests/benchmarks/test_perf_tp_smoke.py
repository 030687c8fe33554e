"""Smoke test of perf/tp.py (tiny sizes) and of its peak-memory measurement.

The benchmark itself is never part of the test run: ``--quick`` spawns 2 gloo ranks, runs a
one-block TinyGPT and two small vocabularies, and must write a JSON whose ratios are the ones
computed from its own numbers, with both TP models agreeing with the dense model at step 0.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # starts its own processes: run first (conftest.py)

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_bytes_sees_torch_allocations_and_frees() -> None:
    import tp

    n = 1 << 20  # 4 MiB of fp32

    def two_live() -> None:
        a = torch.ones(n)
        b = torch.ones(n)
        del a, b

    def one_at_a_time() -> None:
        for _ in range(3):
            a = torch.ones(n)
            del a

    def inside_an_op() -> None:  # exp(x - 1) allocates a temporary and the result
        x = torch.ones(n)
        torch.exp(x - 1.0)

    assert tp.peak_bytes(two_live) == 2 * 4 * n
    assert tp.peak_bytes(one_at_a_time) == 4 * n
    assert tp.peak_bytes(inside_an_op) == 3 * 4 * n


@pytest.mark.timeout(240)  # a hang guard; ~25 s on 2 idle cores (spawn + imports dominate)
def test_quick_run_writes_consistent_json(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "perf" / "tp.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "tp_cpu_quick.json").read_text())
    assert res["nproc"] == 2 and res["backend"] == "gloo" and "--quick" in res["command"]
    st = res["step"]
    for k in ("shardkit", "dtensor"):
        assert 0 < st[k]["min_ms"] <= st[k]["median_ms"] and st[k]["n"] == 2
        assert st["step0_loss"][k] == pytest.approx(st["step0_loss"]["dense"], rel=1e-4)
        # same SGD steps on the same batch: the two TP models stay the same model
        assert st["last_loss"][k] == pytest.approx(st["last_loss"]["shardkit"], rel=1e-4)
    assert st["ratio_median"] == st["shardkit"]["median_ms"] / st["dtensor"]["median_ms"]
    assert st["ratio_min"] == st["shardkit"]["min_ms"] / st["dtensor"]["min_ms"]
    b = res["blocks"]
    for mode in ("tp", "sp"):
        ours, peer = b[f"shardkit_{mode}"], b[f"dtensor_{mode}"]
        assert b["step0_loss"][f"shardkit_{mode}"] == pytest.approx(b["step0_loss"]["dense"], rel=1e-4)
        assert b["step0_loss"][f"dtensor_{mode}"] == pytest.approx(b["step0_loss"]["dense"], rel=1e-4)
        assert b[f"ratio_median_{mode}"] == ours["median_ms"] / peer["median_ms"]
        assert b[f"ratio_min_{mode}"] == ours["min_ms"] / peer["min_ms"]
    ce = res["cross_entropy"]
    assert sorted(int(v) for v in ce) == [1024, 2048]
    methods = {"shardkit", "gather_F_cross_entropy", "dtensor_loss_parallel"}
    for e in ce.values():
        assert set(e["time"]) == methods == set(e["peak_bytes"])
        assert e["ratio_time_median"] == e["time"]["shardkit"]["median_ms"] / e["time"]["gather_F_cross_entropy"]["median_ms"]
        assert e["ratio_peak_bytes"] == e["peak_bytes"]["shardkit"] / e["peak_bytes"]["gather_F_cross_entropy"]
        # the gathered baseline holds at least the full logits, log-softmax and their gradient
        assert e["peak_bytes"]["gather_F_cross_entropy"] >= 3 * e["shard_bytes"] * res["nproc"]
        assert 0 < e["peak_bytes"]["shardkit"] < e["peak_bytes"]["gather_F_cross_entropy"]
        assert e["max_abs_grad_diff"] < 1e-6
    assert "profiler" in res["memory_method"]
    assert (tmp_path / "tp_cpu_quick.png").stat().st_size > 1000
    report = _load("perf_report", REPO / "perf" / "report.py")
    assert len(report._tp_rows(res)) == 3 + len(ce)  # TinyGPT TP, blocks TP and SP, one per vocabulary
