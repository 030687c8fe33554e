"""Smoke test of perf/pipeline.py (``--quick``: tiny model, 2 gloo ranks, every schedule).

The benchmark itself is never part of the test run; this checks that it runs end to end against
torch.distributed.pipelining, that both implementations computed the same step-0 loss and
gradients, that every ratio in the JSON is the one its own numbers give, and that the formula
column is docs/reference.md's, written out here independently.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts its own processes: run first (conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@pytest.mark.timeout(240)  # a hang guard only; ~20 s on 2 busy cores
def test_quick_pipeline_benchmark_writes_consistent_json(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "perf" / "pipeline.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rep = json.loads((tmp_path / "pipeline_cpu_quick.json").read_text())
    assert rep["backend"] == "gloo" and rep["pp"] == 2 and "--quick" in rep["command"]
    p, m = rep["pp"], rep["microbatches"]
    assert set(rep["results"]) == set(SCHEDULES)
    for name, r in rep["results"].items():
        assert (tmp_path / f"pipeline_cpu_quick_{name}.png").stat().st_size > 1000, name
        assert "torch" in r, (name, r.get("torch_error"))  # every torch peer runs on CPU/gloo here
        # same weights, same batch: the same loss and gradients at step 0
        s0 = r["step0"]
        assert math.isclose(s0["loss_ours"], s0["loss_torch"], rel_tol=1e-6), (name, s0)
        assert s0["grad_max_rel_diff"] < 1e-5, (name, s0)
        for k in ("ours", "torch"):
            res = r[k]
            assert res["n"] == 2 and 0 < res["min_ms"] <= res["median_ms"]
            # the busiest rank's idle share of the cross-rank compute window: >= 0 by construction,
            # and (a median of per-repeat minima over ranks) at most every rank's median
            assert len(res["bubble_per_rank"]) == p and 0 <= res["bubble"] <= min(res["bubble_per_rank"]) + 1e-12
            ref = r["bubble_formula"] if r["bubble_reference"] == "formula" else r["bubble_simulated"]
            assert res["bubble_over_formula"] == pytest.approx(res["bubble"] / ref)
            # the least disturbed repeat: never above the median
            assert 0 <= res["bubble_min"] <= res["bubble"]
            assert res["bubble_min_over_formula"] == pytest.approx(res["bubble_min"] / ref)
            assert res["bubble_over_stage_sim"] == pytest.approx(res["bubble"] / r["bubble_simulated_stages"])
        # every stage's compute kinds were timed: F and B (or BI and BW) on each of the p*v stages
        kinds = ("F", "BI", "BW") if name == "zb-h1" else ("F", "B")
        S = p * r["virtual_stages"]
        assert set(r["stage_action_ms"]) == {f"{k}{st}" for st in range(S) for k in kinds}, r["stage_action_ms"]
        assert all(ms >= 0 for ms in r["stage_action_ms"].values()) and r["stage_action_ms"]["F0"] > 0
        assert r["ratio_median"] == pytest.approx(r["ours"]["median_ms"] / r["torch"]["median_ms"])
        assert r["ratio_min"] == pytest.approx(r["ours"]["min_ms"] / r["torch"]["min_ms"])
        # docs/reference.md, "Pipeline bubbles", written out independently of the script
        v = r["virtual_stages"]
        t = r["action_ms"]
        expected = {
            "gpipe": (p - 1) / m,
            "1f1b": (p - 1) / m,
            "interleaved": (p - 1) / (v * m),
            "zb-h1": (p - 1)
            * (t.get("F", 0) + t.get("BI", 0) - t.get("BW", 0))
            / (m * (t.get("F", 0) + t.get("BI", 0) + t.get("BW", 0))),
        }[name]
        assert r["bubble_formula"] == pytest.approx(expected), name
        assert v == (2 if name == "interleaved" else 1)
        # our timeline: every rank ran m forwards per stage it holds
        for rank, rows in enumerate(r["timeline"]):
            assert sum(1 for row in rows if row[0] == "F") == m * v, (name, rank)
    assert rep["results"]["zb-h1"]["action_ms"].keys() >= {"F", "BI", "BW"}
