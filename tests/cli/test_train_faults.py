"""What ``shardkit train --nproc 2`` does when a rank fails: who is named, how fast it ends, how it restarts.

Each case runs the real command line (torchrun, gloo) with ``--inject-fault RANK:STEP:KIND``:

* one of 4 ranks killed by SIGKILL under ``--max-restarts 1 --resume auto``: torchrun restarts the
  workers, they resume from the newest checkpoint, and the final checkpoint holds bitwise the
  parameters and optimizer state of a run that was never interrupted;
* (a rank that raises: tests/cli/test_worker_logs.py, end to end and on written logs;)
* a rank that hangs inside a step: after ``--heartbeat`` seconds without a collective the rank
  ahead warns which rank it waits for; the collective times out after ``--timeout`` and the
  verdict says the same (it has issued fewer collectives);
* a frozen rank (SIGSTOP): the rank that watches its heartbeat names it and kills it;
* ``shardkit train`` itself killed: its torchrun and workers end too (no orphans).

The times are printed; the bounds asserted are far above them (a hang would take the 300 s
default timeout). perf/faults.py measures the times per case.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SMALL = ["--d-model", "32", "--n-layers", "2", "--seq-len", "32", "--batch-size", "4", "--device", "cpu"]


def _train(tmp: Path, *flags: str, nproc: int = 2, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "train", "--nproc", str(nproc), "--strategy", "zero2", *SMALL, *flags],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return run, time.perf_counter() - t0


def _consolidated(ckpt: Path, out: Path) -> tuple[dict, dict]:
    from shardkit.consolidate import consolidate

    model, optim = consolidate(ckpt, out)
    return torch.load(model), torch.load(optim)


def test_killed_rank_restarts_and_the_run_ends_bitwise_like_an_uninterrupted_one(tmp_path: Path) -> None:
    """4 ranks, the last one killed by SIGKILL at step 5."""
    steps = ["--steps", "10", "--save-every", "3", "--eval-every", "5"]
    ref, _ = _train(tmp_path, *steps, "--ckpt-dir", "a", nproc=4)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run, seconds = _train(
        tmp_path, *steps, "--ckpt-dir", "b", "--resume", "auto", "--max-restarts", "1", "--inject-fault", "3:5:kill", nproc=4
    )
    print(f"killed at step 5, restarted, finished: {seconds:.1f} s")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "attempt 0 failed and the workers were restarted: rank 3 failed first: it was killed by SIGKILL" in run.stderr
    assert "resumed from " in run.stdout and "step-00000003 (step 3, saved by 4 rank(s))" in run.stdout
    want_model, want_optim = _consolidated(tmp_path / "a" / "step-00000010", tmp_path / "export-a")
    got_model, got_optim = _consolidated(tmp_path / "b" / "step-00000010", tmp_path / "export-b")
    assert got_model.keys() == want_model.keys()
    for key, want in want_model.items():
        assert torch.equal(got_model[key], want), key
    for index, state in want_optim["state"].items():
        for name, value in state.items():
            got = got_optim["state"][index][name]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, (index, name)


def test_hung_rank_ends_the_run_after_the_collective_timeout(tmp_path: Path) -> None:
    run, seconds = _train(tmp_path, "--steps", "20", "--timeout", "12", "--heartbeat", "4", "--inject-fault", "1:3:hang")
    print(f"hang with --timeout 12: every process ended after {seconds:.1f} s (start-up included)")
    assert run.returncode != 0
    # named after --heartbeat seconds without a collective, while the run waits for the timeout
    warning = next((line for line in run.stdout.splitlines() if line.startswith("shardkit stall warning")), None)
    assert warning is not None and warning.startswith("shardkit stall warning: rank 0 has issued no collective for "), run.stdout
    assert "no mismatch; behind: shardkit_dp[0, 1]: rank 1 at #" in warning, warning
    # rank 0 timed out waiting; the heartbeats' progress says whom for, and where each rank was
    first = run.stderr.splitlines()[0]
    assert re.match(r"shardkit train: stall: rank 1 is behind: (\d+) collectives issued \(last: .*; step 3\); rank 0: ", first), (
        first
    )
    # and in which phase: rank 1 hangs before step 3's forward (its last phase: step 2's optimizer
    # step), rank 0 waits in step 3's first gradient reduce-scatter (ZeRO-2)
    assert "; optimizer step; step 3); rank 0: " in first, first
    assert "backward: reduce-scatter of gradient bucket 0; step 3)" in first, first
    assert "  rank 0: lost its peers after that: " in run.stderr and "CommTimeoutError" in run.stderr
    assert seconds < 120


def test_frozen_rank_is_named_and_ended_by_the_rank_watching_it(tmp_path: Path) -> None:
    """SIGSTOP: the rank holds its sockets and answers nothing, so no collective fails; without the
    heartbeat the others would wait out the 300 s collective timeout."""
    run, seconds = _train(tmp_path, "--steps", "20", "--heartbeat", "5", "--inject-fault", "1:3:stop")
    print(f"stop with --heartbeat 5: every process ended after {seconds:.1f} s (start-up included)")
    assert run.returncode != 0
    assert re.match(r"shardkit train: rank 1 \(pid \d+ on .+\) sent no heartbeat for \d+\.\d s", run.stderr), run.stderr[-3000:]
    assert "frozen or stopped; rank 0 kills it (SIGKILL)" in run.stderr.splitlines()[0]
    assert seconds < 120


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(pid))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_killing_shardkit_train_ends_its_torchrun_and_workers(tmp_path: Path) -> None:
    marker = f"--seed {1000 + os.getpid() % 1000}"  # only this test's processes carry it
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardkit.cli", "train", "--nproc", "2", "--strategy", "ddp", *SMALL, "--steps", "100000"]
    launcher = subprocess.Popen([*cmd, *marker.split()], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    for line in launcher.stdout:  # training has begun: torchrun and both workers are up
        if line.startswith("step "):
            break
    assert len(_processes_with(marker)) >= 4, _processes_with(marker)  # launcher, torchrun, 2 workers
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 60
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_with(marker)
    for pid in left:  # leave nothing behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphans after the launcher was killed: {left}"
