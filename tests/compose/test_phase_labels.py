"""The phase labels each layout sets while it communicates (``CommStats.set_phase``), which the
heartbeat publishes so that a stall or a frozen rank is placed inside its step (comm/heartbeat.py).

Every label set during one training step is recorded, in order, for ZeRO-3 and a 2-stage pipeline
on 2 gloo ranks. The expected sequence is written out from the step's structure: TinyGPT's units
or the pipeline's 1F1B schedule over two micro-batches.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from shardkit.comm import CommStats, ParallelContext
from shardkit.models import gpt_blocks
from shardkit.parallel import parallelize
from parallelize_cases import B, lm_batches, tiny_gpt


def _labels_of_one_step(dp: str, pp: int) -> list[str]:
    import torch.distributed as dist

    world = dist.get_world_size()
    seen: list[str] = []
    real = CommStats.set_phase

    def record(self: CommStats, label: str) -> None:
        if not seen or seen[-1] != label:
            seen.append(label)
        real(self, label)

    with ParallelContext.from_world(dp=world // pp, pp=pp) as ctx:
        kwargs = {"blocks": gpt_blocks, "pp": {"microbatches": 2, "schedule": "1f1b"}} if pp > 1 else {}
        par = parallelize(tiny_gpt(False), ctx, dp=dp, **kwargs)
        opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.1)
        x, y = next(iter(lm_batches()))
        rows = slice(ctx.rank("dp") * B // ctx.size("dp"), (ctx.rank("dp") + 1) * B // ctx.size("dp"))
        with mock.patch.object(CommStats, "set_phase", record):
            par.forward_backward(x[rows], y[rows])
            par.clip(1.0)
            par.step(opt)
    return seen


def test_zero3_labels_each_unit_gather_and_bucket_reduce_scatter(dist_pool) -> None:
    seen = dist_pool.run(_labels_of_one_step, "zero3", 1, world_size=2, timeout=120)
    assert seen[0] == seen[1]  # the same story on both ranks
    labels = seen[0]
    assert labels[0] == "forward" and labels[-2:] == ["gradient clip", "optimizer step"]
    # each unit gathered for its forward (root first), and again in backward, ahead of its need
    # (the backward prefetch), last unit first
    units = ["''", "'blocks.0'", "'blocks.1'", "'blocks.2'", "'blocks.3'"]
    assert labels[1:6] == [f"forward: all-gather of unit {u}" for u in units] and labels[6] == "backward"
    again = [label for label in labels[7:] if "all-gather of unit" in label]
    assert again == [f"prefetch: all-gather of unit {u}" for u in units[:0:-1]]
    assert any(label.startswith("backward: reduce-scatter of gradient bucket ") for label in labels)


def test_a_pipeline_labels_each_compute_and_receive_with_its_micro_batch_and_stage(dist_pool) -> None:
    seen = dist_pool.run(_labels_of_one_step, "none", 2, world_size=2, timeout=120)
    first, last = seen
    # 1F1B on 2 stages, 2 micro-batches: stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1
    assert [label for label in first if label.startswith("pipeline: ") and "receive" not in label] == [
        "pipeline: forward of micro-batch 0 on stage 0",
        "pipeline: forward of micro-batch 1 on stage 0",
        "pipeline: backward of micro-batch 0 on stage 0",
        "pipeline: backward of micro-batch 1 on stage 0",
    ]
    assert "pipeline: receive of micro-batch 0's activation from stage 0" in last
    assert "pipeline: receive of micro-batch 1's gradient from stage 1" in first
    assert first[0] == last[0] == "pipeline step" and first[-1] == last[-1] == "optimizer step"


@pytest.mark.parametrize("label", ["forward", "optimizer step"])
def test_parallel_model_sets_a_phase_on_every_stats_object(label: str) -> None:
    par = parallelize(tiny_gpt(False), None, dp="none")
    par.set_phase(label)
    assert [s.phase()[0] for s in par.comm_stats()] == [label] * len(par.comm_stats())
