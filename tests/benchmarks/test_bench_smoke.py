"""Smoke tests of the optimizer benchmark (tiny sizes) and of the CUDA C baseline's source.

The benchmark itself is never part of the test run (docs/architecture.md, "perf/"): ``--quick`` runs every peer
for a few steps on tiny tensors (~5-10 s, one torch thread) to check that the script runs end to
end, that each peer did the same work, and that the JSON carries every field the report needs.
"""

from __future__ import annotations

import json
import math
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from optim import PEERS, SHARDKIT, CudaToolUnavailable, cuda_source_to_ptx, model_shapes

REPO = Path(__file__).resolve().parents[2]
CUDA_SRC = REPO / "perf" / "cuda" / "adamw.cu"


@pytest.mark.parametrize("total", [1 << 14, 1_000_003, 12_345_679, 100_000_000])
def test_model_shapes_total_exactly(total: int) -> None:
    shapes = model_shapes(total)
    assert sum(math.prod(s) for s in shapes) == total
    assert len(shapes) > 40  # many tensors, as in a real model: multi-tensor overhead counts


def test_model_shapes_rejects_tiny_totals() -> None:
    with pytest.raises(ValueError, match="too small"):
        model_shapes(1000)


@pytest.mark.timeout(120)  # a hang guard only; the run takes ~2-5 s on 2 busy cores
def test_quick_benchmark_writes_complete_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process (torch is already imported) but through the perf/ script, as a user runs it.
    threads = torch.get_num_threads()
    # --device cpu: with the default `auto` a CUDA machine would run (and name the file) cuda
    monkeypatch.setattr(sys, "argv", ["perf/optim.py", "--quick", "--device", "cpu", "--out", f"{tmp_path}/"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "perf" / "optim.py"), run_name="__main__")
    assert exit_info.value.code == 0
    assert torch.get_num_threads() == threads  # --quick's 1 thread does not leak
    out = tmp_path / "optim_cpu.json"
    report = json.loads(out.read_text())
    assert (tmp_path / "optim_cpu.png").stat().st_size > 1000
    assert report["machine"]["versions"]["torch"] and report["machine"]["versions"]["triton"]
    assert report["command"][0] == "optim.py" and "--quick" in report["command"]
    assert not (tmp_path / "optim_cuda.json").exists()
    assert [r["params"] for r in report["results"]] == report["settings"]["sizes"]
    for res in report["results"]:
        assert set(res["peers"]) == set(PEERS)  # every peer has an entry, available or not
        live = {k: v for k, v in res["peers"].items() if v["available"]}
        assert {SHARDKIT, "torch.AdamW(foreach)", "torch.AdamW(fused)"} <= set(live)
        for name, v in res["peers"].items():
            if not v["available"]:
                assert v["reason"], name
                continue
            assert len(v["wall_ms"]) == report["settings"]["repeats"]
            assert 0 < v["min_ms"] <= v["median_ms"] and v["gbps"] > 0
            assert v["ratio_vs_fastest_peer"] > 0 and v["ratio_vs_fastest_peer_min"] > 0
            # same inputs, same number of steps: every peer must land on the same params
            assert v["param_norm_rel_diff"] < 1e-5, (name, v["param_norm_rel_diff"])
        assert res["peers"][res["fastest_peer"]]["ratio_vs_fastest_peer"] == 1.0
        assert res["shardkit_ratio"] == live[SHARDKIT]["ratio_vs_fastest_peer"]


@pytest.mark.parametrize("compiler", ["auto", "nvrtc", "nvcc"])
def test_cuda_c_adamw_compiles_to_ptx(compiler: str) -> None:
    """perf/cuda/adamw.cu compiles with no GPU (CuPy's NVRTC, else nvcc, else skip)."""
    try:
        ptx, tool = cuda_source_to_ptx(CUDA_SRC.read_text(), arch=80, compiler=compiler)
    except CudaToolUnavailable as exc:
        pytest.skip(f"no CUDA C compiler here: {exc}")
    assert compiler in ("auto", tool)
    assert set(re.findall(r"\.entry\s+(\w+)", ptx)) == {"adamw_fp32_vec4", "adamw_fp32"}
    vec4 = ptx[ptx.index(".entry adamw_fp32_vec4") :]
    vec4 = vec4[: vec4.index(".entry adamw_fp32(")] if ".entry adamw_fp32(" in vec4 else vec4
    # float4 views must become 128-bit accesses: 4 loads (p, g, m, v) and 3 stores (p, m, v)
    assert len(re.findall(r"ld\.global(?:\.nc)?\.v4\.f32", vec4)) == 4
    assert len(re.findall(r"st\.global\.v4\.f32", vec4)) == 3


def test_shardkit_bench_runs_the_program_in_perf(capfd: pytest.CaptureFixture[str], monkeypatch, tmp_path) -> None:
    from shardkit.bench import perf_dir
    from shardkit.cli import main

    assert main(["bench", "optim", "--help"]) == 0  # perf/optim.py's own parser answers, in its process
    assert "--quick" in capfd.readouterr().out
    assert perf_dir() == REPO / "perf"
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nosuch"])
    assert exc.value.code == 2
    monkeypatch.setenv("SHARDKIT_PERF_DIR", str(tmp_path))  # no programs there: say where they are
    assert main(["bench", "optim", "--help"]) == 2
    assert "ship with the source tree" in capfd.readouterr().err
