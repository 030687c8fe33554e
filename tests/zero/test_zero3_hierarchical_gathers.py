"""ZeRO-3 with hierarchical gathers (``reshard_after_forward=B``: FSDP2's int, ZeRO++'s hpZ).

After a unit's forward each rank keeps its piece of the gathered parameters for its place in a
block of B consecutive dp ranks, and the backward gathers inside the block. The values gathered
are the same bits, so the run must equal flat ZeRO-3 bitwise, and the single-process model
within the fp32 tolerance; the backward's all-gather must leave the dp group for the block
groups (2 simulated machines x 2 ranks: ``bytes_per_link(2)``). Written-out reference: [Note:
hierarchical gathers] in shardkit/parallel/zero/stage3_shards.py and docs/zero.md.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardkit.comm import ParallelContext
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer
from zero3_models import D, GLOBAL_BATCH, dp_rows, zero3_batch, zero3_model
from tolerances import FP32

V = 32


class _UsageLM(nn.Module):
    """What users do to a stage-3 model at once: tied embedding and head (the root unit), a block
    recomputed under activation checkpointing, a block called twice, dropout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.emb(idx))
        x = self.blocks[0](x)
        x = checkpoint(self.blocks[1], x, use_reentrant=False)
        x = self.blocks[2](self.blocks[0](x))
        return self.head(x)


def _tokens(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + micro)
    return torch.randint(0, V, (GLOBAL_BATCH, 5), generator=g), torch.randint(0, V, (GLOBAL_BATCH, 5), generator=g)


def _loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())


def _train(reshard, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Steps of two micro-batches each, with an evaluation forward and a forward whose graph is
    dropped between them; the full parameters after each step."""
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_UsageLM(), ctx, 3, bucket_mb=0.004, reshard_after_forward=reshard)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    rows, out = dp_rows(ctx), []
    for step in range(steps):
        torch.manual_seed(1000 + step * 8 + ctx.rank("dp"))  # dropout masks: the same in both runs
        with torch.no_grad():
            sdp(_tokens(step, 9)[0][rows])  # evaluation: nothing kept for a backward
        sdp(_tokens(step, 8)[0][rows]).sum()  # a graph never backpropagated: its pieces go stale
        opt.zero_grad()
        for micro in range(2):
            idx, tgt = _tokens(step, micro)
            (_loss(sdp, idx[rows], tgt[rows]) / 2).backward()
        opt.step()
        assert sdp._shards._transient == 0, "a secondary shard or gathered buffer outlived the step"
        out.append(sdp.full_state_dict())
    ctx.destroy()
    return out


@pytest.mark.reduction_order
def test_block_gathers_train_bitwise_like_flat_zero3_and_like_one_process(dist_pool) -> None:
    flat = dist_pool.run(_train, True, world_size=4, timeout=120)
    blocks = dist_pool.run(_train, 2, world_size=4, timeout=120)
    for rank, (a, b) in enumerate(zip(flat, blocks)):
        for step, (sa, sb) in enumerate(zip(a, b)):
            for name in sa:
                assert torch.equal(sa[name], sb[name]), f"rank {rank}, step {step}, {name}"
    # one process cannot draw the ranks' dropout masks: the reference runs without dropout
    ref = _reference_without_dropout()
    for rank, mine in enumerate(dist_pool.run(_train_without_dropout, world_size=4, timeout=120)):
        for step, (r, m) in enumerate(zip(ref, mine)):
            for name, q in r.items():
                torch.testing.assert_close(m[name], q, **FP32, msg=lambda s, n=name: f"rank {rank} step {step} {n}: {s}")


def _no_dropout(model: _UsageLM) -> _UsageLM:
    model.drop.p = 0.0
    return model


def _train_without_dropout(steps: int = 3) -> list[dict[str, torch.Tensor]]:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_no_dropout(_UsageLM()), ctx, 3, bucket_mb=0.004, reshard_after_forward=2)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    rows, out = dp_rows(ctx), []
    for step in range(steps):
        sdp(_tokens(step, 8)[0][rows]).sum()  # dropped graph
        opt.zero_grad()
        for micro in range(2):
            idx, tgt = _tokens(step, micro)
            (_loss(sdp, idx[rows], tgt[rows]) / 2).backward()
        opt.step()
        out.append(sdp.full_state_dict())
    ctx.destroy()
    return out


def _reference_without_dropout(steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """One process, the whole batch: each rank's mean over its rows, averaged over 4 ranks."""
    model = _no_dropout(_UsageLM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(2):
            idx, tgt = _tokens(step, micro)
            (_loss(model, idx, tgt) / 2).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _traffic(reshard) -> tuple[dict, dict, int, int]:
    ctx = ParallelContext.from_world()
    model = zero3_model()
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    sdp = ShardedDataParallel(model, ctx, 3, bucket_mb=0.01, reshard_after_forward=reshard)
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.1)
    for step in range(2):
        sdp.comm_stats.reset()  # the wrap's checks, then the first step's
        x, y = zero3_batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[dp_rows(ctx)]), y[dp_rows(ctx)]).backward()
        opt.step()
    links = {op: sdp.comm_stats.bytes_per_link(2, op) for op in ("all_gather", "reduce_scatter", "all_reduce")}
    peak = sdp.memory_report()["peak_transient"]
    ctx.destroy()
    return links, sdp.comm_stats.summary(), psi, peak


def test_block_gathers_move_the_backward_all_gather_inside_each_machine(dist_pool) -> None:
    """2 machines x 2 ranks: flat ZeRO-3 sends all-gather 2Ψ + reduce-scatter Ψ over the dp group
    that spans both; with blocks of 2 the backward's Ψ stays on each machine."""
    for (flat, _, psi, peak_flat), (hier, summary, _, peak_hier) in zip(
        dist_pool.run(_traffic, True, world_size=4, timeout=60), dist_pool.run(_traffic, 2, world_size=4, timeout=60)
    ):
        assert flat["all_gather"] == {"within_machine": 0, "across_machines": 2 * psi, "unplaced": 0}
        assert hier["all_gather"] == {"within_machine": psi, "across_machines": psi, "unplaced": 0}
        assert hier["reduce_scatter"] == flat["reduce_scatter"] == {"within_machine": 0, "across_machines": psi, "unplaced": 0}
        assert hier["all_reduce"] == flat["all_reduce"]  # the flags of which params got a gradient
        blocks = [g for g in summary["all_gather"]["groups"] if g.startswith("shardkit_dp_cp_block")]
        assert len(blocks) == 1 and blocks[0] in ("shardkit_dp_cp_block[0, 1]", "shardkit_dp_cp_block[2, 3]")
        # the pieces: every unit's half is held from the end of forward into backward
        assert peak_hier >= psi // 2 and peak_hier > peak_flat, (peak_hier, peak_flat, psi)


def _whole_dp_block() -> list[tuple[str, str]]:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(zero3_model(), ctx, 3, reshard_after_forward=ctx.size("dp"))
    x, y = zero3_batch(0)
    nn.functional.mse_loss(sdp(x[dp_rows(ctx)]), y[dp_rows(ctx)]).backward()
    groups = sorted(sdp.comm_stats.summary()["all_gather"]["groups"])
    ctx.destroy()
    return groups


def test_a_block_of_the_whole_dp_group_is_flat_zero3(dist_pool) -> None:
    for groups in dist_pool.run(_whole_dp_block, world_size=2, timeout=60):
        assert len(groups) == 1 and "block" not in groups[0], groups  # every gather on the dp group


def _refused(reshard, stage: int) -> str:
    ctx = ParallelContext.from_world()
    try:
        ShardedDataParallel(zero3_model(), ctx, stage, reshard_after_forward=reshard)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ctx.destroy()
    return "accepted"


@pytest.mark.parametrize(
    ("reshard", "stage", "expected"),
    [
        (3, 3, "ValueError: reshard_after_forward=3"),  # not a divisor of dp 4
        (1, 3, "ValueError: reshard_after_forward=1"),
        (8, 3, "ValueError: reshard_after_forward=8"),
        (2, 2, "ValueError: reshard_after_forward applies to stage 3"),
        (2.0, 3, "TypeError: reshard_after_forward must be a bool or an int"),
    ],
)
def test_bad_block_sizes_are_refused_before_any_collective(dist_pool, reshard, stage: int, expected: str) -> None:
    for message in dist_pool.run(_refused, reshard, stage, world_size=4, timeout=60):
        assert message.startswith(expected), message


def _params_written_after_a_forward() -> list[dict[str, torch.Tensor]]:
    """A forward whose graph is dropped keeps pieces of the old values; the user then loads other
    parameters: the next step must see the loaded ones, never a piece kept before the load."""
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(zero3_model(), ctx, 3, bucket_mb=0.01, reshard_after_forward=2)
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.1)
    x, y = zero3_batch(0)
    sdp(x[dp_rows(ctx)]).sum()  # pieces of the initial values are kept, no backward comes
    new = {k: torch.full_like(v, 0.01 * i) for i, (k, v) in enumerate(zero3_model().state_dict().items())}
    sdp.load_full_state_dict(new)
    nn.functional.mse_loss(sdp(x[dp_rows(ctx)]), y[dp_rows(ctx)]).backward()
    opt.step()
    out = sdp.full_state_dict()
    ctx.destroy()
    return [out, new]


def test_parameters_loaded_after_a_forward_are_the_ones_gathered(dist_pool) -> None:
    for out, new in dist_pool.run(_params_written_after_a_forward, world_size=4, timeout=60):
        ref = zero3_model()
        ref.load_state_dict(new)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        x, y = zero3_batch(0)
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        for name, q in ref.state_dict().items():
            torch.testing.assert_close(out[name], q, **FP32)


def _after_a_raised_backward(reshard) -> tuple[int, dict[str, torch.Tensor]]:
    """A backward raises after the last unit's gradients were reduced (its pieces and the others'
    still held); the next step abandons it. The transient count must come back to 0, not below."""
    ctx = ParallelContext.from_world()
    torch.manual_seed(0)  # four units: when the third's backward starts the first still holds its piece
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, D), nn.Tanh())][:-1])
    sdp = ShardedDataParallel(model, ctx, 3, bucket_mb=0.01, reshard_after_forward=reshard)
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.1)
    x, y = zero3_batch(0)

    def boom(grad: torch.Tensor) -> None:
        raise RuntimeError("raised in backward")

    # raised at the third unit's output gradient: the last unit's gradients are reduced by then
    hook = sdp.module[4].register_forward_hook(lambda m, a, out: out.register_hook(boom) and None)
    loss = nn.functional.mse_loss(sdp(x[dp_rows(ctx)]), y[dp_rows(ctx)])
    hook.remove()
    with pytest.raises(RuntimeError, match="raised in backward"):
        loss.backward()
    opt.zero_grad()
    nn.functional.mse_loss(sdp(x[dp_rows(ctx)]), y[dp_rows(ctx)]).backward()
    opt.step()
    left, out = sdp._shards._transient, sdp.full_state_dict()
    ctx.destroy()
    return left, out


def test_a_backward_that_raised_leaves_no_piece_counted(dist_pool) -> None:
    flat = dist_pool.run(_after_a_raised_backward, True, world_size=4, timeout=60)
    blocks = dist_pool.run(_after_a_raised_backward, 2, world_size=4, timeout=60)
    for (left_flat, a), (left, b) in zip(flat, blocks):
        assert left_flat == left == 0
        assert all(torch.equal(a[k], b[k]) for k in a)
