"""What a checkpoint costs the step loop: no saving vs ``--ckpt-dir`` (synchronous) vs ``--async-save``.

``shardkit train --nproc 2 --strategy zero2`` on a TinyGPT of ~13M params, 30 steps, saving every
5 steps (6 saves). Per run, from the trainer's summary: the time the loop spent in saves
(``save_time_s``: the whole write when synchronous; copying to host memory and waiting for the
previous save when asynchronous) and the step time (``train_time_s`` / steps, saves excluded:
with ``--async-save`` the background writes run during these steps). The three configurations
are interleaved over repeats; min and median per configuration; rank 0's figures.

Usage:
    .venv/bin/python perf/checkpoint_save.py                 # -> perf/results/checkpoint_save_cpu.json
    .venv/bin/python perf/checkpoint_save.py --repeats 1 --out /tmp/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_workers import machine_info

STEPS, EVERY = 30, 5
MODEL = ["--d-model", "384", "--n-layers", "6", "--n-heads", "6", "--seq-len", "64", "--batch-size", "4"]
CONFIGS = {"no saving": [], "sync save": ["--save-every", str(EVERY)], "async save": ["--save-every", str(EVERY), "--async-save"]}


def _run(flags: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        ckpt = ["--ckpt-dir", str(Path(tmp) / "ckpt")] if flags else []
        cmd = [sys.executable, "-m", "shardkit.cli", "train", "--nproc", "2", "--strategy", "zero2", "--device", "cpu"]
        cmd += [
            *MODEL,
            "--steps",
            str(STEPS),
            "--eval-every",
            str(STEPS),
            *ckpt,
            *flags,
            "--log-json",
            str(Path(tmp) / "log.json"),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if run.returncode != 0:
            raise RuntimeError(run.stderr[-3000:])
        log = json.loads((Path(tmp) / "log.json").read_text())
        rank0 = log["ranks"][0]
        return {"step_ms": rank0["train_time_s"] / STEPS * 1e3, "save_s": rank0["save_time_s"], "params": log["params"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name, flags in CONFIGS.items():
            runs[name].append(_run(flags))
            print(f"{name:>10}: step {runs[name][-1]['step_ms']:.1f} ms, in saves {runs[name][-1]['save_s']:.2f} s", flush=True)
    summary = {
        name: {
            "median_step_ms": statistics.median(r["step_ms"] for r in rs),
            "min_step_ms": min(r["step_ms"] for r in rs),
            "median_save_s_per_save": statistics.median(r["save_s"] for r in rs) / (STEPS // EVERY),
            "min_save_s_per_save": min(r["save_s"] for r in rs) / (STEPS // EVERY),
        }
        for name, rs in runs.items()
    }
    base = summary["no saving"]["median_step_ms"]
    for name, row in summary.items():
        row["step_ratio_vs_no_saving"] = row["median_step_ms"] / base
        print(
            f"{name:>10}: median step {row['median_step_ms']:.1f} ms ({row['step_ratio_vs_no_saving']:.3f}x), "
            f"loop time per save {row['median_save_s_per_save'] * 1e3:.0f} ms"
        )
    sync, background = summary["sync save"], summary["async save"]
    result = {
        "benchmark": "checkpoint_save",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": ["checkpoint_save.py", *(argv if argv is not None else sys.argv[1:])],
        "machine": machine_info(),
        "settings": {"nproc": 2, "strategy": "zero2", "steps": STEPS, "save_every": EVERY, "model": MODEL},
        "params": runs["no saving"][0]["params"],
        "runs": runs,
        "summary": summary,
        "loop_time_per_save_async_over_sync": background["median_save_s_per_save"] / sync["median_save_s_per_save"],
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "checkpoint_save_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
