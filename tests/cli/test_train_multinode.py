"""``shardkit train --nnodes 2``: two machines (two torchrun agents on loopback) train like one.

Each "machine" is a ``shardkit train --nnodes 2 --rdzv-endpoint 127.0.0.1:PORT`` process with its
own torchrun agent; the ranks meet through torchrun's c10d rendezvous. The same layout on one
machine (``--nproc`` = all ranks) is the reference: the same global ranks do the same work in
the same order, so every step's loss is bitwise equal. tp stays inside a machine (tp divides the
ranks per machine: [Note: mesh layout] in comm/context.py), dp crosses machines; with pp and
dp, the pipeline's stages are on different machines. With one rank per machine, DDP's all-reduce
and ZeRO-3's gathers and reduce-scatters all cross them.

The last test loses a machine (elastic, ``--min-nnodes``) and checks that the run goes on.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tolerances import FP32

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = ["--d-model", "32", "--n-layers", "2", "--seq-len", "32", "--device", "cpu"]
SMALL = [*MODEL, "--batch-size", "4", "--steps", "4"]
#: name -> (ranks per machine, flags)
LAYOUTS = {
    "ddp-across": (1, ["--strategy", "ddp"]),  # one rank per machine: every all-reduce crosses them
    "zero3-across": (1, ["--strategy", "zero3"]),  # every unit gather and reduce-scatter crosses them
    "tp-inside-dp-across": (2, ["--tp", "2", "--strategy", "zero3"]),  # ZeRO-3 on the dp axis, across machines
    # pp outermost: the two stages on two machines (P2P across them), DDP's all-reduce inside each
    "pp-across-dp-inside": (2, ["--pp", "2", "--strategy", "ddp", "--microbatches", "2"]),
    # ZeRO++'s hpZ: the backward's gathers inside each machine; the reference is flat ZeRO-3 on one
    # machine (the same values are gathered, so the same bits)
    "zero3-hpz-gathers-inside": (2, ["--strategy", "zero3", "--hpz", "2"]),
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
    flat = [sys.executable, "-m", "shardkit.cli", "train", *SMALL, *(flags[:-2] if "--hpz" in flags else flags)]
    one = subprocess.run(
        [*flat, "--nproc", str(2 * per_node), "--log-json", str(tmp_path / "one.json")],
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
    # the summary splits each rank's payload by link; one machine has no split
    assert all(r["comm_links"] is None for r in a["ranks"])
    links = [r["comm_links"] for r in b["ranks"]]
    if per_node == 1:  # every group of more than one rank spans both machines
        assert all(x["within_machine"] == 0 < x["across_machines"] for x in links), links
    if "--hpz" in flags:  # the backward's all-gather moved inside: it carries what the forward's does
        assert all(0 < x["within_machine"] < x["across_machines"] for x in links), links
        assert "across machines" in outs[0][0] or "across machines" in outs[1][0]


def _wait_listening(port: int, proc: subprocess.Popen, *, timeout: float) -> None:
    """Return once something accepts connections on 127.0.0.1:``port`` (``proc``'s torchrun agent
    hosting the c10d rendezvous store); fail if ``proc`` ends first or ``timeout`` passes."""
    t0 = time.perf_counter()
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            assert proc.poll() is None, "the first machine ended before it hosted the rendezvous store"
            assert time.perf_counter() - t0 < timeout, f"no rendezvous store on port {port} after {timeout} s"
            time.sleep(0.05)


def _consolidated_model(ckpt: Path, out: Path) -> dict:
    from shardkit.consolidate import consolidate

    model, _ = consolidate(ckpt, out)
    return torch.load(model)


def test_lost_machine_the_run_goes_on_with_one_and_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    """Elastic: two machines x 2 ranks (``--nnodes 2 --min-nnodes 1``, ZeRO-2, ``--global-batch 8``)
    lose the second machine (its shardkit train, torchrun and workers killed at once) after a
    checkpoint. The first machine's torchrun restarts its workers in a world of 2; they resume the
    4-rank checkpoint with 4 sequences each instead of 2, and the run ends with the parameters of
    an uninterrupted 4-rank run (another order of additions: within fp32 rounding)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = [*MODEL, "--steps", "10", "--save-every", "2", "--eval-every", "5", "--strategy", "zero2", "--global-batch", "8"]
    shardkit = [sys.executable, "-m", "shardkit.cli", "train", *flags]
    ref = subprocess.run(
        [*shardkit, "--nproc", "4", "--ckpt-dir", "a", "--log-json", "a.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    endpoint = f"127.0.0.1:{_free_port()}"
    # --rdzv-wait (default 30 s): how long the first round waits for the second machine once the
    # first is there (on a loaded machine its agent can take many seconds to join, and a later join
    # would end the run) and how long the re-formed round waits after the loss
    elastic = [*shardkit, "--nproc", "2", "--nnodes", "2", "--min-nnodes", "1", "--rdzv-endpoint", endpoint]  # default wait, 30 s
    elastic += ["--max-restarts", "1", "--ckpt-dir", "b", "--resume", "auto", "--log-json", str(tmp_path / "b.json")]
    t0 = time.perf_counter()
    first = subprocess.Popen(elastic, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the first machine must host the rendezvous store (the test kills the second): wait until its
    # agent listens on the endpoint before starting the second, which then joins as a client
    _wait_listening(int(endpoint.rsplit(":", 1)[1]), first, timeout=120)
    second = subprocess.Popen(
        elastic, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while not (tmp_path / "b" / "step-00000002").is_dir():  # a complete checkpoint of the 4-rank world
            assert first.poll() is None and second.poll() is None, "a machine ended before the first checkpoint"
            assert time.perf_counter() - t0 < 180, "no checkpoint after 180 s"
            time.sleep(0.05)
        os.killpg(second.pid, signal.SIGKILL)  # the whole machine: its launcher, torchrun and workers
        out, err = first.communicate(timeout=240)
    finally:
        for p in (first, second):
            if p.poll() is None:
                p.kill()
    print(f"lost a machine after step 2, went on with one, finished: {time.perf_counter() - t0:.1f} s")
    assert first.returncode == 0, err[-3000:]
    assert "attempt 0 failed and the workers were restarted" in err, err[-3000:]
    assert "saved by 4 rank(s)" in out, out[-3000:]
    assert "the run started with" not in out  # both machines were in the first world (workers warn on stdout)
    log, ref_log = json.loads((tmp_path / "b.json").read_text()), json.loads((tmp_path / "a.json").read_text())
    assert [r["world_size"] for r in log["ranks"]] == [2, 2] and log["config"]["batch_size"] == 4  # 8 over 2 replicas
    assert ref_log["config"]["batch_size"] == 2  # 8 over 4 replicas
    # train losses are rank 0's own rows (2 then 4 of them): eval losses are over the same fixed batches
    assert [s for s, _ in log["eval"]] == [s for s, _ in ref_log["eval"]] == [5, 10]
    torch.testing.assert_close(torch.tensor(log["eval"]), torch.tensor(ref_log["eval"]), **FP32)
    assert log["train_loss"][:2] == ref_log["train_loss"][:2]  # saved by the 4-rank world
    want = _consolidated_model(tmp_path / "a" / "step-00000010", tmp_path / "export-a")
    got = _consolidated_model(tmp_path / "b" / "step-00000010", tmp_path / "export-b")
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **FP32, msg=lambda m, key=key: f"{key}: {m}")
