"""The run summary's numbers: sizes in the binary units they are computed in, and a job's
throughput with each token counted once however the model is split."""

from __future__ import annotations

import pytest

from shardkit.train.progress import fmt_bytes, fmt_rank_summary, fmt_total_throughput


def test_sizes_are_binary_and_labelled_so() -> None:
    assert fmt_bytes(3 * 2**20) == "3.00 MiB"
    assert fmt_bytes(820 * 2**10) == "820.00 KiB"
    assert fmt_bytes(3_270_000) == "3.12 MiB"  # the demo model's 0.82M fp32 params; `plan` says 3.27 MB
    assert fmt_bytes(512) == "512 B"


def test_total_throughput_counts_each_replica_once() -> None:
    """tp=2 x pp=2 over 8 ranks: 2 replicas; the 4 ranks of a replica all see its tokens."""
    ranks = [{"tokens_per_s": 1000.0 + r} for r in range(8)]  # per-rank rates differ a little
    line = fmt_total_throughput(ranks, model_parallel=4)
    assert f"{sum(s['tokens_per_s'] for s in ranks) / 4 / 1e3:.1f}k tok/s" in line
    assert "over 2 data-parallel replicas (8 ranks, 4 per replica)" in line
    assert fmt_total_throughput(ranks[:2], model_parallel=1) == "total  | 2.0k tok/s over 2 data-parallel replicas"


def test_rank_row_shows_last_step_and_recent_mean() -> None:
    row = fmt_rank_summary(
        dict(rank=1, final_train_loss=1.5, mean_train_loss=1.75, tail_steps=4, final_eval_loss=1.8, tokens_per_s=2500.0,
             wall_time_s=2.0, param_bytes=2**20, grad_bytes=2**19, optim_state_bytes=2**21)
    )  # fmt: skip
    assert row.startswith("rank 1 | train loss 1.5000 (mean of last 4: 1.7500) | eval loss 1.8000 | 2.5k tok/s")
    assert "params 1.00 MiB | grads 512.00 KiB | optim state 2.00 MiB" in row


def test_plot_flag_draws_the_run(tmp_path) -> None:
    """``shardkit train --plot`` writes a PNG of the run; a bad extension is refused up front."""
    from shardkit.cli import main

    out = tmp_path / "run.png"
    args = [
        "train",
        "--steps",
        "3",
        "--d-model",
        "32",
        "--n-layers",
        "1",
        "--seq-len",
        "32",
        "--eval-every",
        "3",
        "--device",
        "cpu",
    ]
    assert main([*args, "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(SystemExit):  # argparse's usage error, before training
        main([*args, "--plot", str(tmp_path / "run.jpg")])
