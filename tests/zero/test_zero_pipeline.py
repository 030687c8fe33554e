"""ZeRO-1/2 on the dp axis of a pipeline (``parallelize(dp="zero1"|"zero2", pp=...)``): dp 2 × pp 2
trains like the dense single-process model, holds 1/dp of the optimizer state, and reduces with
one reduce-scatter + one all-gather per bucket over dp (no all-reduce of gradients); ZeRO-3 with
pp is refused before any collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.models import gpt_blocks
from shardkit.parallel import parallelize
from shardkit.parallel.tensor import gpt_plan
from parallelize_cases import B, CLIP, dense_run, lm_batches, tiny_gpt
from tolerances import FP32


def train_parallelized(strategy: str, schedule: str, tie: bool, tp: int) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size()
    pp = 2
    with ParallelContext.from_world(dp=world // (tp * pp), tp=tp, pp=pp) as ctx:
        dense, ref_losses, ref_norms = dense_run(tie)
        opts = {"microbatches": 2, "schedule": schedule}
        if schedule == "interleaved":
            opts["virtual_stages"] = 2
        kwargs = {"tp_plan": gpt_plan(tie_embeddings=tie)} if tp > 1 else {}
        par = parallelize(tiny_gpt(tie), ctx, dp=strategy, pp=opts, blocks=gpt_blocks, **kwargs)
        opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3, momentum=0.9)
        sdp = par.module
        sdp.comm_stats.reset()  # the wrap's model check and broadcast are not per-step traffic
        dp_group = ctx.group("dp")
        dp, r = ctx.size("dp"), ctx.rank("dp")
        rows = slice(r * B // dp, (r + 1) * B // dp)
        losses = []
        for step, (x, y) in enumerate(lm_batches()):
            opt.zero_grad(set_to_none=True)
            loss = par.forward_backward(x[rows], y[rows])
            norm = par.clip(CLIP)
            assert par.step(opt)
            mean = loss.clone().reshape(1)
            dist.all_reduce(mean, group=dp_group)
            losses.append(float(mean) / dp)
            assert abs(float(norm) - ref_norms[step]) <= 1e-4 * ref_norms[step], (step, float(norm), ref_norms[step])
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        steps = len(losses)

        # communication over dp: per step and bucket one reduce-scatter of the full gradient and
        # one all-gather of the params; the only dp all-reduce is the 4-byte Σg² (8 with a loss
        # scaler: the overflow flag too) with one fp32 flag per param of this stage folded in (which params got a gradient on
        # some rank: [Note: params without a gradient are not stepped] in zero/flat_shards.py)
        # (dp 1: every collective over dp takes the local path and records nothing)
        buckets = sdp.sharded_buckets
        full_bytes = sum(sb.total * 4 for sb in buckets)
        st, n = sdp.comm_stats, steps if dp > 1 else 0
        assert st.calls("reduce_scatter", group=dp_group) == n * len(buckets)
        assert st.bytes("reduce_scatter", group=dp_group) == n * full_bytes
        assert st.calls("all_gather", group=dp_group) == n * len(buckets)
        assert st.bytes("all_gather", group=dp_group) == n * full_bytes
        flags = 4 * sum(len(sb.grad_bucket.params) for sb in buckets)
        head = 4 if sdp.loss_scaler is None else 8
        assert st.bytes("all_reduce", group=dp_group) == n * (head + flags)
        # not the ddp path's coalesced all-reduce: only the pipeline's 16-byte global token count
        # ([Note: pipeline loss normalization])
        assert par.stats.bytes("all_reduce", group=dp_group) == n * 16
        report = par.report(opt)
        assert dp == 1 or {"reduce_scatter", "all_gather"} <= set(report.comm)

        # optimizer state: SGD's momentum on this rank's shard only; over dp the shards add up to
        # exactly the ddp state (4 bytes per element of this rank's stage parameters)
        state = report.memory["optimizer_state"]
        ddp_state = sum(p.numel() * 4 for p in par.parameters())
        total = torch.tensor([state])
        dist.all_reduce(total, group=dp_group)
        assert int(total) == ddp_state, (int(total), ddp_state)
        padding = sum(16 * (len(sb.segments) + dp) * 4 for sb in buckets)  # alignment + tail per bucket
        assert abs(state - ddp_state / dp) <= padding, (state, ddp_state, dp)

        # the wrapper's full_state_dict holds this rank's blocks under the unsplit model's keys
        if tp == 1:
            want = nn.Sequential(*gpt_blocks(dense)).state_dict()
            got = sdp.full_state_dict()
            assert got and set(got) <= set(want)
            for key, value in got.items():
                torch.testing.assert_close(value, want[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")
        # the pipeline's full state dict sees the all-gathered params on every dp rank
        full = par.pipeline.full_state_dict()
        flat = torch.cat([v.reshape(-1) for v in full.values()])
        gathered = [torch.empty_like(flat) for _ in range(dp)]
        dist.all_gather(gathered, flat, group=dp_group)
        for g in gathered[1:]:
            assert torch.equal(g, gathered[0])
        par.close()
        return {"losses": losses, "state": state, "ddp_state": ddp_state}


@pytest.mark.parametrize(
    "strategy, schedule, tie, tp, world_size",
    [
        ("zero1", "1f1b", True, 1, 4),  # dp 2 x pp 2, embedding tied to the head across stages
        ("zero2", "1f1b", False, 1, 4),
        ("zero2", "interleaved", True, 1, 4),  # two chunks per rank in one ZeRO wrapper
        ("zero1", "zb-h1", False, 1, 4),
        ("zero2", "1f1b", True, 2, 4),  # tp 2 x pp 2 (dp 1): tp-replicated params counted 1/tp, tie once
    ],
)
def test_zero_under_a_pipeline_trains_like_the_dense_model(dist_pool, strategy, schedule, tie, tp, world_size):
    out = dist_pool.run(train_parallelized, strategy, schedule, tie, tp, world_size=world_size, timeout=120)
    if world_size // (tp * 2) > 1:  # sharded over dp: less than the replicated state on every rank
        assert all(o["state"] < o["ddp_state"] for o in out)


def _zero3_refused() -> None:
    from unittest import mock

    import torch.distributed as dist

    with ParallelContext.from_world(dp=2, pp=2) as ctx:
        names = ("all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "barrier", "send", "recv", "new_group")
        patches = [mock.patch.object(dist, n, side_effect=AssertionError(f"collective {n}")) for n in names]
        for patch in patches:
            patch.start()
        try:
            with pytest.raises(ValueError, match="zero3.*per micro-batch.*zero1"):
                parallelize(tiny_gpt(), ctx, pp={"microbatches": 2}, blocks=gpt_blocks, dp="zero3")
            # the wrapper's own checks (here nvme_dir) run before the pipeline's constructor and
            # the stage context's new_group (review finding)
            with pytest.raises(ValueError, match="nvme_dir"):
                parallelize(
                    tiny_gpt(), ctx, pp={"microbatches": 2}, blocks=gpt_blocks, dp="zero1", dp_options={"offload": "nvme"}
                )
        finally:
            for patch in patches:
                patch.stop()


def test_zero3_under_a_pipeline_raises_before_any_collective(dist_pool):
    dist_pool.run(_zero3_refused, world_size=4, timeout=60)
