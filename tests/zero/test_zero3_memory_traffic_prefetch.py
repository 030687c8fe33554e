"""ZeRO-3: bytes and traffic per rank against the formulas, prefetch order, and the cases users hit.

Formulas: docs/reference.md, "ZeRO memory and communication" (stage 3: (b + g + K)Ψ/N bytes,
3Ψ communication per step in the paper's units). The models' tensors are multiples of 64
elements, so the flat buckets carry no padding at dp 2 and 4.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.comm import CommStats, ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel import DynamicLossScaler
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer, paper_comm_bytes
from zero3_models import D, GLOBAL_BATCH, assert_matches_replica, dp_rows, zero3_batch, zero3_model
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32


def _step(sdp, opt, ctx, x, y, dtype=torch.float32) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(sdp(x[dp_rows(ctx)].to(dtype)).float(), y[dp_rows(ctx)]).backward()
    opt.step()


# (param dtype, grad dtype) -> bytes per rank for Ψ params on N ranks, Adam m and v in fp32
FORMULAS = {
    (torch.float32, torch.float32): lambda P, N: 16 * P / N,
    (torch.bfloat16, torch.bfloat16): lambda P, N: (2 + 2 + 12) * P / N,  # the paper's (2 + 2 + K)Ψ/N
    (torch.bfloat16, torch.float32): lambda P, N: (2 + 4 + 12) * P / N,  # fp32 reduction (default)
}


def _memory_matches_formula(dtype: torch.dtype, grad_dtype: torch.dtype, reshard: bool) -> dict:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(zero3_model(dtype), ctx, 3, bucket_mb=0.01, grad_dtype=grad_dtype, reshard_after_forward=reshard)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-3)
    _step(sdp, opt, ctx, *zero3_batch(0), dtype=dtype)
    report = sdp.memory_report()
    psi, n = sum(p.numel() for p in sdp.module.parameters()), ctx.size("dp")
    assert report["model_state"] == pytest.approx(FORMULAS[(dtype, grad_dtype)](psi, n), rel=0.02), report
    assert report["params"] == psi * dtype.itemsize // n  # the shard only
    assert report["grads"] == psi * grad_dtype.itemsize // n
    unit = (D * D + D) * dtype.itemsize  # one Linear gathered
    # transient: the unit running plus the next one prefetched; without resharding every unit
    # is gathered by the end of forward
    assert report["peak_transient"] >= (3 if not reshard else 2) * unit, report
    ctx.destroy()
    return report


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_fp32_model_state_is_16_psi_over_n(dist_pool, world_size: int, reshard: bool) -> None:
    dist_pool.run(_memory_matches_formula, torch.float32, torch.float32, reshard, world_size=world_size, timeout=60)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_zero3_bf16_params_bytes_match_the_paper(dist_pool, grad_dtype: torch.dtype) -> None:
    dist_pool.run(_memory_matches_formula, torch.bfloat16, grad_dtype, True, world_size=4, timeout=60)


def _comm_per_step(reshard: bool) -> int:
    ctx = ParallelContext.from_world()
    psi_bytes = sum(p.numel() * p.element_size() for p in zero3_model().parameters())
    sdp = ShardedDataParallel(zero3_model(), ctx, 3, bucket_mb=0.01, reshard_after_forward=reshard)
    opt = ZeroOptimizer(sdp, FusedAdamW, lr=1e-3)
    _step(sdp, opt, ctx, *zero3_batch(0))
    sdp.comm_stats.reset()  # drop the wrap-time checks
    _step(sdp, opt, ctx, *zero3_batch(1))
    summary = sdp.comm_stats.summary()
    assert set(summary) == {"reduce_scatter", "all_gather", "all_reduce"}, summary  # no all-gather after the step either
    # the one all-reduce: which params got a gradient on some rank, one fp32 flag per param
    # ([Note: params without a gradient are not stepped] in zero/flat_shards.py)
    flags = summary.pop("all_reduce")
    assert (flags["calls"], flags["bytes"]) == (1, 4 * len(list(sdp.module.parameters()))), flags
    assert summary["reduce_scatter"]["bytes"] == psi_bytes
    assert summary["all_gather"]["bytes"] == (2 if reshard else 1) * psi_bytes  # forward (+ backward)
    ctx.destroy()
    return paper_comm_bytes(summary) // psi_bytes


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_comm_per_step_is_three_psi(dist_pool, world_size: int) -> None:
    """ZeRO paper units: all-gather Ψ forward + Ψ backward + reduce-scatter Ψ = 3Ψ (1.5x DDP);
    ``reshard_after_forward=False`` skips the backward gathers: 2Ψ."""
    assert dist_pool.run(_comm_per_step, True, world_size=world_size, timeout=60) == [3] * world_size
    assert dist_pool.run(_comm_per_step, False, world_size=world_size, timeout=60) == [2] * world_size


class _LoggedStats(CommStats):
    """CommStats that also logs each collective, in issue order, into a shared list."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def record(self, op, group, nbytes) -> None:
        super().record(op, group, nbytes)
        self.log.append(op)


def _prefetch_order(forward_prefetch: bool = True) -> tuple[list, list]:
    ctx = ParallelContext.from_world()
    log: list = []
    sdp = ShardedDataParallel(  # one bucket per unit
        zero3_model(), ctx, 3, bucket_mb=1.0, stats=_LoggedStats(log), forward_prefetch=forward_prefetch
    )
    for name in ("0", "2", "4"):  # after the wrap: these run after its pre-forward hooks
        sdp.module.get_submodule(name).register_forward_hook(lambda m, a, o, n=name: log.append(f"ran {n}"))
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.1)
    seen = []
    for step in range(2):
        log.clear()
        sdp._units.gather_log.clear()
        _step(sdp, opt, ctx, *zero3_batch(step))
        seen.append((list(log), list(sdp._units.gather_log)))
    ctx.destroy()
    return seen


def test_zero3_prefetch_issues_the_next_gather_before_the_current_unit_runs(dist_pool) -> None:
    for (first, _), (second, gathers) in dist_pool.run(_prefetch_order, world_size=2, timeout=60):
        # first step: no order recorded yet, each unit gathers itself just before it runs
        assert first[:6] == ["all_gather", "ran 0", "all_gather", "ran 2", "all_gather", "ran 4"], first
        # then: the root's pre-forward prefetches unit 0, and each unit's pre-forward the next
        # one, so the gather of unit k+1 is issued before unit k runs
        assert second[:6] == ["all_gather", "all_gather", "ran 0", "all_gather", "ran 2", "ran 4"], second
        forward, backward = gathers[:3], gathers[3:]
        assert forward == [("0", "prefetch"), ("2", "prefetch"), ("4", "prefetch")], gathers
        # backward: unit 4 is gathered when its outputs get their grad, units 2 and 0 prefetched
        assert [n for n, _ in backward] == ["4", "2", "0"] and all(w == "prefetch" for _, w in backward[1:]), gathers


def test_zero3_without_forward_prefetch_gathers_each_unit_just_before_it_runs(dist_pool) -> None:
    """forward_prefetch=False (FSDP2's default): one gathered unit at a time in forward."""
    for _, (second, gathers) in dist_pool.run(_prefetch_order, False, world_size=2, timeout=60):
        assert second[:6] == ["all_gather", "ran 0", "all_gather", "ran 2", "all_gather", "ran 4"], second
        assert gathers[:3] == [("0", "forward"), ("2", "forward"), ("4", "forward")], gathers


def _fp16_overflow_on_one_rank() -> tuple[bool, float]:
    ctx = ParallelContext.from_world()
    scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1)
    sdp = ShardedDataParallel(zero3_model(torch.float16), ctx, 3, loss_scaler=scaler)
    opt = ZeroOptimizer(sdp, FusedAdamW, lr=1e-2)
    before = sdp.full_state_dict()
    x, y = zero3_batch(0)
    opt.zero_grad()
    if ctx.rank("dp") == ctx.size("dp") - 1:  # one element of one rank's gradient overflows
        hook = sdp.module[0].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    scaler.scale_loss(nn.functional.mse_loss(sdp(x[dp_rows(ctx)].half()).float(), y[dp_rows(ctx)])).backward()
    if ctx.rank("dp") == ctx.size("dp") - 1:
        hook.remove()
    norm = sdp.clip_grad_norm_(1.0)
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1 and torch.isinf(norm)  # on EVERY rank
    after = sdp.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing stepped
    assert scaler.scale == 2.0**7
    opt.zero_grad()
    scaler.scale_loss(nn.functional.mse_loss(sdp(x[dp_rows(ctx)].half()).float(), y[dp_rows(ctx)])).backward()
    opt.step()
    assert not opt.last_step_skipped
    assert any(not torch.equal(sdp.full_state_dict()[k], v) for k, v in before.items())
    ctx.destroy()
    return opt.last_step_skipped, scaler.scale


def test_zero3_fp16_overflow_on_one_rank_skips_the_step_everywhere(dist_pool) -> None:
    assert len(set(dist_pool.run(_fp16_overflow_on_one_rank, world_size=2, timeout=60))) == 1


def _bf16_master() -> None:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(zero3_model(torch.bfloat16), ctx, 3, bucket_mb=0.01)
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    ref = zero3_model(torch.bfloat16).float()  # fp32 replica from the same bf16-representable weights
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for sb in sdp.sharded_buckets:
        assert sb.master.dtype == torch.float32 and sb.local_param_shard().dtype == torch.bfloat16
        assert sb.reduced_shard.dtype == torch.float32  # fp32 reduction by default
    for step in range(3):
        x, y = zero3_batch(step)
        _step(sdp, opt, ctx, x, y, torch.bfloat16)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x.bfloat16().float()), y).backward()
        ref_opt.step()
        # the fp32 master follows the fp32 replica within bf16's forward/backward error, and the
        # bf16 params are the master rounded (not a drifting bf16 copy)
        for sb in sdp.sharded_buckets:
            torch.testing.assert_close(sb.local_param_shard(), sb.master.bfloat16(), rtol=0, atol=0)
    full = sdp.full_state_dict()
    for k, q in ref.state_dict().items():
        torch.testing.assert_close(full[k].float(), q, rtol=0.05, atol=0.02)  # bf16 compute: ~2^-8 per op
    ctx.destroy()


def test_zero3_bf16_params_keep_an_fp32_master(dist_pool) -> None:
    dist_pool.run(_bf16_master, world_size=2, timeout=60)


class _TiedLM(nn.Module):
    """TinyGPT's shape: embedding tied to the head (root), blocks in a ModuleList (units)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.head = nn.Linear(D, 32)  # its bias keeps the head a unit under wrap={..., nn.Linear}
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _train_lm(wrap, model_fn, loss_of, steps: int = 5, reshard: bool = True) -> list[str]:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(model_fn(), ctx, 3, bucket_mb=0.004, wrap=wrap, reshard_after_forward=reshard)
    ref = model_fn()
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(steps):
        inp, tgt = loss_of(step)
        rows = dp_rows(ctx)
        opt.zero_grad()
        nn.functional.mse_loss(sdp(inp[rows]).float(), tgt[rows]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(inp).float(), tgt).backward()
        ref_opt.step()
        assert_matches_replica(sdp, ref, step)
    names = [u.name for u in sdp._units.units]
    ctx.destroy()
    return names


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 32, (GLOBAL_BATCH, 6), generator=g), torch.randn(GLOBAL_BATCH, 6, 32, generator=g)


def _tied(cross_units: bool) -> list[str]:
    wrap = {nn.Embedding, nn.Linear} if cross_units else None
    return _train_lm(wrap, _TiedLM, _tokens)


def _tied_is_held_once(cross_units: bool) -> None:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_TiedLM(), ctx, 3, wrap={nn.Embedding, nn.Linear} if cross_units else None)
    root = sdp._units.units[0]
    w = sdp.module.emb.weight
    held = [sb for u in sdp._units.units for sb in u.buckets if any(q is w for q in sb.grad_bucket.params)]
    assert len(held) == 1 and held[0] in root.buckets  # once, in the root unit
    ctx.destroy()


@pytest.mark.reduction_order
@pytest.mark.parametrize("cross_units", [False, True])
def test_zero3_tied_weights_trains_like_one_process(dist_pool, cross_units: bool) -> None:
    """Embedding = head: in the root unit (default wrap: both already there; wrap by class: the
    embedding and the head are units of their own and the shared weight moves to the root)."""
    names = dist_pool.run(_tied, cross_units, world_size=2, timeout=60)[0]
    # the embedding unit owned only the shared weight: it moved to the root, the unit is dropped
    assert names == (["", "blocks.0", "blocks.1", "head"] if cross_units else ["", "blocks.0", "blocks.1"])
    dist_pool.run(_tied_is_held_once, cross_units, world_size=2, timeout=60)


class _Twice(nn.Module):
    """Block 0 runs twice in one forward; block 2 is never used; block 1 has an unused param."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.blocks[1].unused = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.blocks[0](x))
        x = torch.tanh(self.blocks[1](x))
        return self.blocks[0](x)


@pytest.mark.reduction_order
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_module_called_twice_and_unused_params(dist_pool, reshard: bool, world_size: int) -> None:
    """Gathered again for its second call (its saved tensors read the same storage); its grads
    of both calls summed before one reduce-scatter; unused params get zeros (SGD: no move)."""
    dist_pool.run(_train_lm, None, _Twice, zero3_batch, 4, reshard, world_size=world_size, timeout=60)


def _frozen() -> None:
    ctx = ParallelContext.from_world()

    def build() -> nn.Module:
        m = zero3_model()
        m[0].requires_grad_(False)  # a unit with only frozen params
        m[2].bias.requires_grad_(False)  # a unit with both
        return m

    sdp, ref = ShardedDataParallel(build(), ctx, 3, bucket_mb=0.01), build()
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-2, eps=ADAM_EPS_ACROSS_ORDERS)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, eps=ADAM_EPS_ACROSS_ORDERS)
    for step in range(3):
        x, y = zero3_batch(step)
        _step(sdp, opt, ctx, x, y)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        assert_matches_replica(sdp, ref, step)
    assert all(p.grad is None for p in sdp.module.parameters() if not p.requires_grad)
    n = ctx.size("dp")
    trainable = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    everything = sum(p.numel() for p in ref.parameters())
    report = sdp.memory_report()
    assert report["grads"] == 4 * trainable // n
    assert report["params"] == 4 * everything // n  # frozen params are sharded too
    assert sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step") == 2 * trainable // n
    ctx.destroy()


def test_zero3_frozen_params_get_no_grad_or_optimizer_memory(dist_pool) -> None:
    dist_pool.run(_frozen, world_size=2, timeout=60)


def _no_sync() -> int:
    """Two micro-batches per step (the first under no_sync) equal one step on the whole batch."""
    ctx = ParallelContext.from_world()
    sdp, ref = ShardedDataParallel(zero3_model(), ctx, 3, bucket_mb=0.01), zero3_model()
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    n = ctx.size("dp")
    half = [slice(ctx.rank("dp") * 4 // n + 4 * k, (ctx.rank("dp") + 1) * 4 // n + 4 * k) for k in (0, 1)]
    for step in range(3):
        x, y = zero3_batch(step)
        opt.zero_grad()
        with sdp.no_sync():
            nn.functional.mse_loss(sdp(x[half[0]]), y[half[0]]).div(2).backward()
        # accumulated into the sharded gradient: no full gradient is left anywhere
        assert all(p.grad is None for p in sdp.module.parameters())
        assert sdp.memory_report()["grads"] == 4 * sum(p.numel() for p in ref.parameters()) // n
        nn.functional.mse_loss(sdp(x[half[1]]), y[half[1]]).div(2).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        assert_matches_replica(sdp, ref, step)
    ctx.destroy()
    return 0


@pytest.mark.reduction_order
def test_zero3_no_sync_accumulates_into_the_sharded_gradient(dist_pool) -> None:
    dist_pool.run(_no_sync, world_size=2, timeout=60)


def _state_dict_round_trip() -> None:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(zero3_model(), ctx, 3, bucket_mb=0.01)
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    _step(sdp, opt, ctx, *zero3_batch(0))
    full = sdp.full_state_dict(rank0_only=True)
    assert (full == {}) == (ctx.rank("dp") != 0)  # every rank gathers, only rank 0 keeps
    ref = zero3_model()
    torch.manual_seed(1)
    other = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    sdp.load_full_state_dict(other)  # writes each rank's shards
    ref.load_state_dict(other)
    assert_matches_replica(sdp, ref, -1)
    with pytest.raises(ValueError, match="missing keys"):
        sdp.load_full_state_dict({})
    ctx.destroy()


def test_zero3_state_dict_round_trip(dist_pool) -> None:
    dist_pool.run(_state_dict_round_trip, world_size=2, timeout=60)


def test_zero3_eval_under_no_grad_frees_every_unit(dist_pool) -> None:
    dist_pool.run(_eval_no_grad, world_size=2, timeout=60)


def _eval_no_grad() -> None:
    ctx = ParallelContext.from_world()
    sdp, ref = ShardedDataParallel(zero3_model(), ctx, 3, reshard_after_forward=False), zero3_model()
    with torch.no_grad():
        torch.testing.assert_close(sdp(zero3_batch(0)[0]), ref(zero3_batch(0)[0]), **FP32)
    assert all(sb.flat_param.untyped_storage().nbytes() == 0 for sb in sdp.sharded_buckets)
    ctx.destroy()


def _read_params_between_steps() -> None:
    """Freed params keep their shape and can be read (an arbitrary value) without touching freed
    memory: before the placeholders, ``p.sum()`` or ``p in params`` read a 0-byte storage (a
    segfault); an in-place write raises instead of corrupting anything."""
    ctx = ParallelContext.from_world()
    ref = zero3_model()
    sdp = ShardedDataParallel(zero3_model(), ctx, 3)
    opt = ZeroOptimizer(sdp, FusedAdamW, lr=1e-2)
    x, y = zero3_batch(0)
    _step(sdp, opt, ctx, x, y)
    params = list(sdp.module.parameters())
    assert [tuple(p.shape) for p in params] == [tuple(p.shape) for p in ref.parameters()]
    assert [p.dim() for p in params] == [p.dim() for p in ref.parameters()]  # e.g. decay groups by dim()
    for p in params:
        assert p.untyped_storage().nbytes() <= p.element_size()  # not a view of a freed buffer
        float(p.detach().sum())
        with pytest.raises(RuntimeError):
            p.data.add_(1.0)
    torch.stack([p.detach().float().sum() for p in params]).sum()  # elementwise compare/sum reads
    # a state_dict of the placeholders would be a model of zeros that loads cleanly: refused
    for call in (sdp.module.state_dict, sdp.state_dict):
        with pytest.raises(RuntimeError, match="full_state_dict"):
            call()
    _step(sdp, opt, ctx, x, y)  # the next step gathers them back
    ctx.destroy()


def test_zero3_params_are_readable_placeholders_between_steps(dist_pool) -> None:
    dist_pool.run(_read_params_between_steps, world_size=2, timeout=60)


def _diverged(extra_forward: bool) -> str:
    """Rank 1 runs one more forward (or its units in another order); with check_sync every rank
    raises the same error naming both ranks' positions, instead of mis-pairing the gathers."""
    ctx = ParallelContext.from_world()
    # forward prefetch on: the changed order below changes which unit rank 1 prefetches
    sdp = ShardedDataParallel(zero3_model(), ctx, 3, check_sync=True, forward_prefetch=True)
    x, y = zero3_batch(0)
    try:
        if ctx.rank("dp") == 1:
            if extra_forward:
                sdp(x[dp_rows(ctx)])  # an extra forward only this rank runs
            else:
                sdp._units._last_order = list(reversed(sdp._units._last_order))
                sdp._units._order = list(reversed(sdp._units.units))  # another unit order next time
        out = sdp(x[dp_rows(ctx)])
        nn.functional.mse_loss(out, y[dp_rows(ctx)]).backward()
        if not extra_forward:
            sdp(x[dp_rows(ctx)])
    except RuntimeError as exc:
        return str(exc)
    finally:
        ctx.destroy()
    return "no error"


@pytest.mark.parametrize("extra_forward", [True, False])
def test_zero3_check_sync_names_diverged_ranks_on_every_rank(dist_pool, extra_forward: bool) -> None:
    messages = dist_pool.run(_diverged, extra_forward, world_size=2, timeout=60)
    for m in messages:
        assert "diverged" in m and "rank 0:" in m and "rank 1:" in m, messages
    assert messages[0] == messages[1]


class _Boxed(nn.Module):
    """A block whose output is a plain dataclass (not a pytree): its backward cannot be hooked."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        from dataclasses import dataclass

        @dataclass
        class Out:
            h: torch.Tensor

        return Out(torch.tanh(self.lin(x.h if hasattr(x, "h") else x)))


def _opaque_output() -> str:
    ctx = ParallelContext.from_world()
    torch.manual_seed(0)
    model = nn.Sequential(_Boxed(), _Boxed(), _Boxed())
    sdp = ShardedDataParallel(model, ctx, 3)
    try:
        sdp(torch.randn(4, D))
    except ValueError as exc:
        return str(exc)
    finally:
        ctx.destroy()
    return "no error"


def test_zero3_unit_with_an_opaque_output_is_a_clear_error(dist_pool) -> None:
    """Before: a RuntimeError deep in backward (a saved parameter read from a freed storage)."""
    for message in dist_pool.run(_opaque_output, world_size=2, timeout=60):
        assert "unit '0'" in message and "register_dataclass" in message, message
