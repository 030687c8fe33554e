"""Smoke test of perf/context_parallel.py (tiny sizes).

The benchmark itself is never part of the test run: ``--quick`` spawns 2 gloo ranks, runs the
attention op (ours in ring and Ulysses modes, PyTorch's ring attention, DeepSpeed's
DistributedAttention, full-sequence SDPA) at one short sequence and a one-block TinyGPT at
cp = 1 and 2, and must write a JSON whose ratios are the ones computed from its own numbers,
with every method agreeing with full-sequence SDPA and every cp's loss with cp=1's.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts its own processes: run first (conftest.py)

REPO = Path(__file__).resolve().parents[2]


def test_a_repeat_counts_the_slowest_rank() -> None:
    import context_parallel as cpb

    row = cpb._row([[0.010, 0.030, 0.020], [0.015, 0.010, 0.040]], [(100, 1), (300, -24)])
    assert row["samples_ms"] == [15.0, 30.0, 40.0]
    assert row["min_ms"] == pytest.approx(15.0) and row["median_ms"] == pytest.approx(30.0) and row["n"] == 3
    assert row["peak_bytes"] == 300 and row["peak_bytes_per_rank"] == [100, 300]
    assert row["memory_settled_call_per_rank"] == [1, -24]


@pytest.mark.timeout(300)  # a hang guard; 35-90 s on 2 busy cores (spawn and imports dominate)
def test_quick_run_writes_consistent_json(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "perf" / "context_parallel.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "context_parallel_cpu_quick.json").read_text())
    assert (tmp_path / "context_parallel_cpu_quick.png").stat().st_size > 1000
    assert res["nproc"] == 2 and res["backend"] == "gloo" and res["cps"] == [2] and "--quick" in res["command"]
    assert res["torch"] and res["cpus"] and "profiler" in res["memory_method"]
    settings = res["settings"]
    tries = res["memory_tries"]
    have_deepspeed = importlib.util.find_spec("deepspeed") is not None

    att = res["attention"]["cp2"]
    assert sorted(att, key=int) == ["128"]
    for S, e in att.items():
        assert e["tokens_per_rank"] == int(S) // 2
        repeats = e["repeats"]
        assert settings["repeats"] <= repeats <= settings["max_repeats"]
        rows = e["methods"]
        assert set(rows) == {
            "sdpa_full_cp1",
            "shardkit_ring_zigzag",
            "torch_ring_load_balanced",
            "shardkit_ulysses_contiguous",
            "shardkit_ulysses_zigzag",
            "deepspeed_ulysses",
        }
        live = {k: r for k, r in rows.items() if r["available"]}
        assert set(rows) - set(live) == (set() if have_deepspeed else {"deepspeed_ulysses"}), rows
        for name, r in live.items():
            assert 0 < r["min_ms"] <= r["median_ms"] and r["n"] == repeats == len(r["samples_ms"]), name
            assert r["min_ms"] == pytest.approx(min(r["samples_ms"]), abs=1e-3)  # samples: the slowest rank's, rounded
            assert r["peak_bytes"] == max(r["peak_bytes_per_rank"]) > 0 and len(r["peak_bytes_per_rank"]) == 2
            assert all(c in (*range(1, tries + 1), -tries) for c in r["memory_settled_call_per_rank"]), name
            assert r["layout"] == (
                "full sequence"
                if name == "sdpa_full_cp1"
                else "contiguous"
                if "contiguous" in name or "deepspeed" in name
                else "zigzag"
            )
        # every method computed full-sequence SDPA's output and gradients
        assert set(e["max_abs_diff_vs_sdpa"]) == set(live) - {"sdpa_full_cp1"}
        for name, d in e["max_abs_diff_vs_sdpa"].items():
            assert set(d) == {"out", "dq", "dk", "dv"} and max(d.values()) < 1e-5, (name, d)
        assert all(v < 1e-5 for v in e["max_abs_diff_vs_peer"].values()), e["max_abs_diff_vs_peer"]
        base = rows["sdpa_full_cp1"]
        for name, r in live.items():
            if name != "sdpa_full_cp1":
                ratio = e["ratios"][f"{name}/sdpa_full_cp1"]
                assert ratio["median"] == r["median_ms"] / base["median_ms"] and ratio["min"] == r["min_ms"] / base["min_ms"]
        pairs = [("shardkit_ring_zigzag", "torch_ring_load_balanced")]
        if have_deepspeed:
            pairs += [("shardkit_ulysses_contiguous", "deepspeed_ulysses"), ("shardkit_ulysses_zigzag", "deepspeed_ulysses")]
        for ours, peer in pairs:
            ratio = e["ratios"][f"{ours}/{peer}"]
            assert ratio["median"] == rows[ours]["median_ms"] / rows[peer]["median_ms"]
            assert ratio["min"] == rows[ours]["min_ms"] / rows[peer]["min_ms"]
            assert ratio["peak_bytes"] == rows[ours]["peak_bytes"] / rows[peer]["peak_bytes"]

    model = res["model_level"]
    assert sorted(model, key=int) == ["128"]
    for S, e in model.items():
        configs = e["configs"]
        assert list(configs) == ["cp1", "cp2_ring", "cp2_ulysses"]
        c1 = configs["cp1"]
        assert (c1["cp"], c1["mode"], c1["tokens_per_rank"]) == (1, None, int(S))
        for name, c in configs.items():
            assert 0 < c["min_ms"] <= c["median_ms"] and c["n"] == e["repeats"], name
            assert c["peak_bytes"] == max(c["peak_bytes_per_rank"]) > 0
            assert all(k in (*range(1, tries + 1), -tries) for k in c["memory_settled_call_per_rank"]), name
            if name == "cp1":
                continue
            assert (c["cp"], c["mode"], c["tokens_per_rank"]) == (2, name.split("_")[1], int(S) // 2)
            assert c["loss"] == pytest.approx(c1["loss"], rel=1e-4)  # the script asserts it too
            assert e["max_abs_grad_diff_vs_cp1"][name] < 1e-5
            assert e["memory_ratio_vs_cp1"][name] == c["peak_bytes"] / c1["peak_bytes"]
            assert e["memory_over_ideal"][name] == 2 * e["memory_ratio_vs_cp1"][name]
            assert e["time_ratio_vs_cp1"][name]["median"] == c["median_ms"] / c1["median_ms"]
            assert e["time_ratio_vs_cp1"][name]["min"] == c["min_ms"] / c1["min_ms"]
    # half the tokens per rank: less activation memory, even at these tiny sizes
    for name in ("cp2_ring", "cp2_ulysses"):
        assert model["128"]["configs"][name]["peak_bytes"] < model["128"]["configs"]["cp1"]["peak_bytes"], name
    assert "TinyGPT" in run.stdout and "sk ring zz" in run.stdout  # the printed table
