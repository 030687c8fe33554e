"""README's performance table must be the one rendered from perf/results/*.json."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts its own processes: run first (conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def test_readme_perf_table_is_generated_from_results() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "perf" / "report.py"), "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_ddp_benchmark_smoke(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "perf" / "ddp.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    res = json.loads((tmp_path / "ddp_cpu_quick.json").read_text())
    assert {"shardkit", "torch_ddp", "ratio_median", "sweep"} <= set(res)
