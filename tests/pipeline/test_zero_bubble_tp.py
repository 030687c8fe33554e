"""ZB-H1 with tensor parallelism: the weight pass (W) computes weight gradients only.

A column-parallel linear is one autograd node computing ``dX`` (and its all-reduce, or
reduce-scatter under sequence parallelism) and ``dW``. Split into an input pass (BI) and a
weight pass (W), each pass must do only its half: BI ``dX`` and the collective, W ``dW`` from
the saved input and the gradient BI captured. Before, both passes computed both (twice the
matmuls and twice the collectives), and with sequence parallelism and activation checkpointing
W ran the same node twice and raised ``CheckpointError``. tp × pp ZB-H1 must also train like the
dense single-process model.
"""

from __future__ import annotations

from unittest import mock


import pytest
import torch
from torch.utils.checkpoint import GraphExecGroup, checkpoint
from tolerances import FP32

from shardkit.comm import ParallelContext
from shardkit.models import gpt_blocks
from shardkit.parallel import parallelize
from shardkit.parallel.pipeline import PipelineParallel
from shardkit.parallel.pipeline.backward import backward_input, backward_weight
from shardkit.parallel.tensor import gpt_plan
from shardkit.parallel.tensor.layers import _ColumnLinear
from parallelize_cases import lm_batches, tiny_gpt, train_parallelized

MICROBATCHES = 2


def _zb_trains_like_dense(sp: bool, checkpointing: bool | str) -> list[float]:
    """tp 2 × pp 2, ZB-H1 (test_parallelize's body: losses, clipped norms, evaluation)."""
    return train_parallelized(2, 2, False, "zb-h1", checkpointing, "ddp", sp)


@pytest.mark.reduction_order
@pytest.mark.parametrize(
    "sp, checkpointing",
    [(False, False), (True, False), (False, True), (True, True), (True, "cpu")],
    ids=["tp", "sp", "tp-ckpt", "sp-ckpt", "sp-ckpt-cpu"],
)
def test_zb_h1_with_tensor_parallel_trains_like_the_dense_model(dist_pool, sp, checkpointing):
    """Before the fix the SP + checkpointing cases raised ``CheckpointError: Unpack is being
    triggered for a tensor that was already unpacked once`` in the first weight pass."""
    losses = dist_pool.run(_zb_trains_like_dense, sp, checkpointing, world_size=4, timeout=240)
    assert all(run == losses[0] for run in losses)  # every rank reports the same global losses


def _work_per_pass(sp: bool, checkpointing: bool) -> dict[str, dict[str, int]]:
    """One ZB-H1 step at tp 2 × pp 2; per pass (BI, W, full B) on this rank: the column-parallel
    linears' backward calls, how many of them computed dX and dW, and the tp collectives."""
    import torch.distributed as dist

    counts = {p: {"calls": 0, "dx": 0, "dw": 0, "tp_collectives": 0} for p in ("BI", "W")}
    phase: list[str] = []
    original = _ColumnLinear.backward

    def counting_backward(ctx, grad):
        out = original(ctx, grad)
        c = counts[phase[-1]]
        c["calls"] += 1
        c["dx"] += out[0] is not None
        c["dw"] += out[1] is not None
        return out

    orig_backward, orig_weight = PipelineParallel.backward, PipelineParallel.backward_weight

    def in_phase(name, fn, tp_group, stats):
        def run(self, *args, **kwargs):
            phase.append(name)
            before = stats.calls(group=tp_group)
            try:
                return fn(self, *args, **kwargs)
            finally:
                counts[name]["tp_collectives"] += stats.calls(group=tp_group) - before
                phase.pop()

        return run

    with ParallelContext.from_world(tp=2, pp=2) as ctx:
        par = parallelize(
            tiny_gpt(False),
            ctx,
            tp_plan=gpt_plan(tie_embeddings=False, sequence_parallel=sp),
            blocks=gpt_blocks,
            checkpointing=checkpointing,
            pp={"microbatches": MICROBATCHES, "schedule": "zb-h1"},
        )
        tp_group, stats = ctx.group("tp"), par.stats
        x, y = lm_batches()[0]
        with (
            mock.patch.object(_ColumnLinear, "backward", staticmethod(counting_backward)),
            mock.patch.object(PipelineParallel, "backward", in_phase("BI", orig_backward, tp_group, stats)),
            mock.patch.object(PipelineParallel, "backward_weight", in_phase("W", orig_weight, tp_group, stats)),
        ):
            par.forward_backward(x, y)
        first, last = ctx.rank("pp") == 0, ctx.rank("pp") == ctx.size("pp") - 1
        w, bi = counts["W"], counts["BI"]
        # 2 blocks per stage, 2 column-parallel linears (qkv, fc) each, 2 micro-batches
        per_step = 2 * 2 * MICROBATCHES
        if last:
            assert bi["dx"] == per_step and bi["dw"] == 0, f"BI is dX and its collective only: {counts}"
            assert w["dw"] == per_step and w["dx"] == 0, f"the weight pass computed input gradients: {counts}"
            if not checkpointing:  # a recomputed forward replays its own (forward) collectives
                assert w["tp_collectives"] == 0, f"the weight pass ran tp collectives: {counts}"
        if first:  # the input (token ids) takes no gradient: all of the backward is W, once
            assert bi["calls"] == 0 and w["dx"] == w["dw"] == w["calls"] == per_step, counts
        dist.barrier()
        return counts


@pytest.mark.parametrize("sp, checkpointing", [(False, False), (True, False), (True, True)], ids=["tp", "sp", "sp-ckpt"])
def test_zb_h1_weight_pass_does_no_input_gradient_work_or_tp_collective(dist_pool, sp, checkpointing):
    """The column-parallel linears compute dX (and its all-reduce / reduce-scatter) only in BI
    and dW only in W; the weight pass runs no tp collective (without checkpointing: a recompute
    replays the forward's). Before the fix W recomputed every dX with its collective."""
    counts = dist_pool.run(_work_per_pass, sp, checkpointing, world_size=4, timeout=180)
    last = counts[-1]  # a last-stage rank: both passes
    assert last["BI"]["calls"] == last["W"]["calls"] == 2 * 2 * MICROBATCHES, counts


class _SharedNorms(torch.nn.Module):
    """Two norms whose parameters pass through one node (as sequence parallelism's coalesced
    gradient sum does): their intermediates lie one below the other on the way to the input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.w = torch.nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = (self.w * 1.0).unbind(0)[:2]  # one node over the shared parameter
        return self.lin2(torch.tanh(self.lin1(x) * w1)) * w2


@pytest.mark.parametrize("accumulate", [False, True])
def test_split_backward_of_nested_weights_runs_each_node_once_under_checkpointing(accumulate):
    """W's call for weights joining the input path at nested nodes re-walked the path between
    them, running the other groups' nodes twice in one recomputation (CheckpointError); B now
    computes those weights' gradients."""
    torch.manual_seed(0)
    mod = _SharedNorms()
    params = list(mod.parameters())
    x = torch.randn(4, 6, requires_grad=True)
    g = torch.randn(4, 6)
    want = torch.autograd.grad(mod(x), [x, *params], grad_outputs=g)
    y = checkpoint(mod, x, use_reentrant=False)
    dx, work = backward_input(y, x, g, params, accumulate=accumulate)
    torch.testing.assert_close(dx, want[0], **FP32)
    with GraphExecGroup():
        got = backward_weight(work, accumulate=accumulate)
    got = [q.grad for q in params] if accumulate else got
    for a, b in zip(got, want[1:], strict=True):
        torch.testing.assert_close(a, b, **FP32)
