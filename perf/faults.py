"""How fast ``shardkit train --nproc N`` ends when a rank fails, whom it blames, what it leaves.

Per case (``--inject-fault RANK:STEP:KIND`` on a ZeRO-2 run of 4 ranks saving every 2 steps):
seconds from the fault (the time the failing rank stamps in its log) until ``shardkit train``
returned (every process gone, torchrun included), whether the verdict's first line names the
failing rank, and whether the newest complete checkpoint still passes its checks (sizes and
CRC-32 of every file). Kill and raise and exit run at default settings; the frozen rank (SIGSTOP)
at the default heartbeat (20 s); the hung rank (alive, stuck before a collective) with
``--timeout 30`` (the default is 300 s). Then the heartbeat's cost: the same run's step time with
``--heartbeat 0`` and the default, interleaved over repeats in alternating order.

Usage:
    .venv/bin/python perf/faults.py                      # -> perf/results/faults_cpu.json
    .venv/bin/python perf/faults.py --nproc 2 --repeats 1 --out /tmp/   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_workers import machine_info

CASES = {  # kind -> extra flags
    "raise": [],
    "exit": [],
    "kill": [],
    "stop": [],  # the default --heartbeat 20
    "hang": ["--timeout", "30"],
}
_STAMP = re.compile(r"--inject-fault: \w+ at step \d+ \(t=(\d+\.\d+)\)")


def _train(nproc: int, flags: list[str], tmp: Path) -> tuple[subprocess.CompletedProcess, float]:
    model = ["--d-model", "64", "--n-layers", "2", "--seq-len", "64", "--batch-size", "8", "--device", "cpu"]
    cmd = [sys.executable, "-m", "shardkit.cli", "train", "--nproc", str(nproc), "--strategy", "zero2", *model, *flags]
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}  # the workers' logs land in tmp
    run = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    return run, time.time()


def _fault_time(tmp: Path) -> float | None:
    for log in tmp.glob("shardkit-train-*/**/stderr.log"):
        match = _STAMP.search(log.read_text(errors="replace"))
        if match:
            return float(match.group(1))
    return None


def _checkpoint_ok(root: Path) -> bool | None:
    from shardkit.parallel.checkpoint.api import read_manifest, verify_files
    from shardkit.train.run_checkpoints import complete_checkpoints

    found = complete_checkpoints(root)
    if not found:
        return None
    newest = found[0][1]
    return not verify_files(newest, read_manifest(newest))


def run_case(kind: str, nproc: int, fault_step: int) -> dict[str, Any]:
    rank = nproc - 1
    with tempfile.TemporaryDirectory(prefix=f"faults-{kind}-") as tmp:
        flags = ["--steps", "40", "--ckpt-dir", "ckpt", "--save-every", "2", "--inject-fault", f"{rank}:{fault_step}:{kind}"]
        run, ended = _train(nproc, flags + CASES[kind], Path(tmp))
        fault_at = _fault_time(Path(tmp))
        said = [line for line in run.stderr.splitlines() if line.startswith("shardkit train: ") and ": warning: " not in line]
        first = (said or [""])[0]
        return {
            "kind": kind,
            "rank": rank,
            "step": fault_step,
            "flags": CASES[kind],
            "exit_code": run.returncode,
            "seconds_fault_to_exit": None if fault_at is None else round(ended - fault_at, 2),
            "verdict": first[:300],
            "verdict_names_rank": bool(
                re.match(rf"shardkit train: (rank {rank}\b|1 of {nproc} ranks failed:|stall: rank {rank} is behind)", first)
            )
            and (kind != "raise" or f"rank {rank}: RuntimeError: --inject-fault" in run.stderr),
            "checkpoint_ok": _checkpoint_ok(Path(tmp) / "ckpt"),
        }


def heartbeat_cost(nproc: int, repeats: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(repeats):
        order = (("off", "0"), ("on", "20")) if repeat % 2 == 0 else (("on", "20"), ("off", "0"))  # no order bias
        for name, value in order:
            with tempfile.TemporaryDirectory(prefix="faults-hb-") as tmp:
                log = Path(tmp) / "log.json"
                run, _ = _train(nproc, ["--steps", "60", "--heartbeat", value, "--log-json", str(log)], Path(tmp))
                if run.returncode != 0:
                    raise RuntimeError(run.stderr[-2000:])
                ranks = json.loads(log.read_text())["ranks"]
                times[name].append(max(r["train_time_s"] for r in ranks) / 60 * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "step_ms": times,
        "median_step_ms": med,
        "min_step_ms": {k: min(v) for k, v in times.items()},
        "ratio_on_over_off": med["on"] / med["off"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    cases = []
    for repeat in range(args.repeats):
        for kind in CASES:
            case = run_case(kind, args.nproc, fault_step=5 + 2 * repeat)
            cases.append(case)
            print(
                f"{kind:>5} rank {case['rank']} step {case['step']}: ended {case['seconds_fault_to_exit']} s after the fault, "
                f"names the rank: {case['verdict_names_rank']}, checkpoint ok: {case['checkpoint_ok']}",
                flush=True,
            )
    cost = heartbeat_cost(args.nproc, 2 * args.repeats)
    print(f"heartbeat: median step {cost['median_step_ms']['on']:.1f} ms on vs {cost['median_step_ms']['off']:.1f} ms off "
          f"(ratio {cost['ratio_on_over_off']:.3f})")  # fmt: skip
    result = {
        "benchmark": "faults",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": ["faults.py", *(argv if argv is not None else sys.argv[1:])],
        "machine": machine_info(),
        "settings": {"nproc": args.nproc, "strategy": "zero2", "repeats": args.repeats},
        "cases": cases,
        "heartbeat_cost": cost,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "faults_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
