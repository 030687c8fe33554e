"""The failure report of ``shardkit train --nproc N``: one line per failed rank, each distinct
traceback once, read from the workers' torchrun stderr logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.train.worker_logs import earlier_failures, failure_report, first_failures, rank_stderr, stderr_logs


def _traceback(message: str, pid: int) -> str:
    return (
        f"W1126 07:00:00.000000 {pid} torch/distributed/run.py:1] some startup warning\n"
        "Traceback (most recent call last):\n"
        f'  File "/x/train.py", line {pid}, in train\n'
        "    raise ValueError(...)\n"
        f"{message}\n"
        f"[W1126 07:00:01.000000 {pid} ProcessGroupGloo.cpp:1] a shutdown warning\n"
    )


def _write_logs(root: Path, texts: list[str]) -> Path:
    for rank, text in enumerate(texts):
        d = root / "none_abc" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text(text)
    return root


def test_same_error_on_every_rank_is_one_line_each_and_one_traceback(tmp_path: Path) -> None:
    logs = _write_logs(tmp_path, [_traceback("ValueError: nvme_dir '/nope' does not exist", 100 + r) for r in range(3)])
    report = failure_report(logs, nproc=3).splitlines()
    assert report[0] == "3 of 3 ranks failed:"
    assert report[1].startswith("  rank 0: ValueError: nvme_dir '/nope' does not exist (full log: ")
    assert report[2].startswith("  rank 1: the same error as rank 0") and report[3].startswith(
        "  rank 2: the same error as rank 0"
    )
    assert report.count("Traceback (most recent call last):") == 1
    assert "--- traceback of rank 0 (the same on ranks 1, 2):" in report
    assert not any("shutdown warning" in line or "startup warning" in line for line in report)


def _tagged(text: str, rank: int) -> str:
    """As torch's excepthook writes a worker's traceback: every line after the first tagged."""
    first, *rest = text.split("Traceback (most recent call last):\n", 1)
    body = "".join(f"[rank{rank}]: {line}\n" for line in rest[0].splitlines()) if rest else ""
    return first + "Traceback (most recent call last):\n" + body


def test_different_errors_each_keep_their_traceback(tmp_path: Path) -> None:
    logs = _write_logs(tmp_path, [_tagged(_traceback("RuntimeError: boom", 1), 0), "", _traceback("KeyError: 'x'", 3)])
    report = failure_report(logs, nproc=3)
    assert report.startswith("2 of 3 ranks failed:\n  rank 0: RuntimeError: boom (full log: ")
    assert "\n  rank 2: KeyError: 'x' (full log: " in report
    assert report.count("Traceback (most recent call last):") == 2
    assert "--- traceback of rank 0:" in report and "--- traceback of rank 2:" in report


def test_no_traceback_names_the_logs(tmp_path: Path) -> None:
    logs = _write_logs(tmp_path, ["", "killed\n"])
    report = failure_report(logs, nproc=2)
    assert "without a Python traceback" in report and str(stderr_logs(logs)[1]) in report
    assert rank_stderr(logs, 1) == "killed\n" and rank_stderr(logs, 5) == ""


_LOST = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242."


def test_a_killed_rank_is_named_first_and_the_survivors_error_is_its_consequence(tmp_path: Path) -> None:
    # rank 1 was killed (no traceback); rank 0 then raised from its broken all-reduce
    logs = _write_logs(tmp_path, [_traceback(_LOST, 100), ""])
    report = failure_report(logs, nproc=2, first_failed=(1, -9)).splitlines()
    assert report[0].startswith("rank 1 failed first: it was killed by SIGKILL (the OOM killer, or kill -9?)")
    assert report[1].startswith("  rank 0: lost its peers after that: RuntimeError: ") and "Connection closed" in report[1]
    assert "Traceback" not in "\n".join(report)  # the consequence's traceback is left out
    # without torchrun's word, the rank that left no traceback is the suspect
    assert failure_report(logs, nproc=2).startswith("rank 1 failed first, without a Python traceback")


def test_a_raised_error_is_the_cause_even_when_torchrun_saw_the_survivor_exit_first(tmp_path: Path) -> None:
    logs = _write_logs(tmp_path, [_traceback(_LOST, 100), _traceback("ValueError: bad batch", 101)])
    report = failure_report(logs, nproc=2, first_failed=(0, 1))
    assert report.startswith("1 of 2 ranks failed:\n  rank 1: ValueError: bad batch (full log: ")
    assert "\n  rank 0: lost its peers after that: " in report and report.count("Traceback") == 1


def test_first_failures_and_earlier_attempts_come_from_torchrun_and_its_log_dir(tmp_path: Path) -> None:
    launcher = (
        "E1126 10:23:22.421000 32720 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) "
        "local_rank: 1 (pid: 32727) of binary: python\n"
        "E1126 10:23:40.000000 32720 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) "
        "local_rank: 0 (pid: 32801) of binary: python\n"
    )
    assert first_failures(launcher) == [(1, -9), (0, 1)]
    for attempt, texts in enumerate([[_traceback(_LOST, 1), ""], ["", ""]]):
        for rank, text in enumerate(texts):
            d = tmp_path / "run" / f"attempt_{attempt}" / str(rank)
            d.mkdir(parents=True)
            (d / "stderr.log").write_text(text)
    assert stderr_logs(tmp_path)[0].parent.parent.name == "attempt_1"  # the latest attempt
    ((attempt, report),) = earlier_failures(tmp_path, 2, launcher)
    assert attempt == 0 and report.startswith("rank 1 failed first: it was killed by SIGKILL")


_FAIL_ON_BROADCAST = """
import os
if os.environ.get("LOCAL_RANK") is not None:
    import torch.distributed as dist

    def broadcast(*args, **kwargs):
        raise RuntimeError(f"injected failure on rank {os.environ['RANK']} (pid {os.getpid()})")

    dist.broadcast = broadcast
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shardkit_train_reports_each_failed_rank_once(tmp_path: Path) -> None:
    """Both workers raise the same error (a ``sitecustomize`` breaks ``dist.broadcast`` in the
    workers only): stderr has one line per rank and one traceback, not two interleaved ones."""
    (tmp_path / "sitecustomize.py").write_text(_FAIL_ON_BROADCAST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "train", "--nproc", "2", "--strategy", "ddp", "--steps", "2", "--d-model", "32",
         "--n-layers", "1", "--seq-len", "32", "--device", "cpu"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode != 0
    lines = run.stderr.splitlines()
    assert lines[0] == "shardkit train: 2 of 2 ranks failed:", run.stderr[-3000:]
    assert lines[1].startswith("  rank 0: RuntimeError: injected failure on rank 0")
    assert lines[2].startswith("  rank 1: the same error as rank 0 (full log: ")
    assert run.stderr.count("Traceback (most recent call last):") == 1
    assert run.stderr.count("injected failure on rank 1") == 0  # rank 1's copy is not printed
