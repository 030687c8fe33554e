"""``shardkit train --nnodes 2``: two machines (two torchrun agents on loopback) train like one.

Each "machine" is a ``shardkit train --nnodes 2 --rdzv-endpoint 127.0.0.1:PORT`` process with its
own torchrun agent; the ranks meet through torchrun's c10d rendezvous. The same layout on one
machine (``--nproc`` = all ranks) is the reference: the same global ranks do the same work in
the same order, so every step's loss is bitwise equal. tp stays inside a machine (tp divides the
ranks per machine: [Note: mesh layout] in comm/context.py), dp crosses machines; with pp and
dp, the pipeline's stages are on different machines.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SMALL = ["--d-model", "32", "--n-layers", "2", "--seq-len", "32", "--batch-size", "4", "--device", "cpu", "--steps", "4"]
#: name -> (ranks per machine, flags)
LAYOUTS = {
    "tp-inside-dp-across": (2, ["--tp", "2", "--strategy", "zero3"]),  # ZeRO-3 on the dp axis, across machines
    # pp outermost: the two stages on two machines (P2P across them), DDP's all-reduce inside each
    "pp-across-dp-inside": (2, ["--pp", "2", "--strategy", "ddp", "--microbatches", "2"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_machines_train_bitwise_like_one(tmp_path: Path, layout: str) -> None:
    per_node, flags = LAYOUTS[layout]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shardkit = [sys.executable, "-m", "shardkit.cli", "train", *SMALL, *flags]
    one = subprocess.run(
        [*shardkit, "--nproc", str(2 * per_node), "--log-json", str(tmp_path / "one.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    endpoint = f"127.0.0.1:{_free_port()}"
    two = ["--nproc", str(per_node), "--nnodes", "2", "--rdzv-endpoint", endpoint, "--log-json", str(tmp_path / "two.json")]
    machines = [
        subprocess.Popen([*shardkit, *two], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [m.communicate(timeout=240) for m in machines]
    for m, (_, err) in zip(machines, outs, strict=True):
        assert m.returncode == 0, err[-3000:]
    a, b = json.loads((tmp_path / "one.json").read_text()), json.loads((tmp_path / "two.json").read_text())
    assert len(b["ranks"]) == 2 * per_node
    assert b["train_loss"] == a["train_loss"] and b["eval"] == a["eval"], (b["train_loss"], a["train_loss"])
    # every rank's own losses too (rank 0 reported them all)
    assert [r["final_train_loss"] for r in b["ranks"]] == [r["final_train_loss"] for r in a["ranks"]]
