"""ZeRO with state the user touches: params written between steps, zero-size and frozen params in
checkpoints, steps skipped after clipping, a bad ``nvme_dir`` on one rank, groups added later.

Each test is a way people use ZeRO that the strategy's own tests did not try, checked against an independent reference: the offloaded optimizer (documented as
bitwise the device one), torch.optim on one process, or torch's own semantics.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.comm.handle import CommTimeoutError
from shardkit.parallel import load_checkpoint, save_checkpoint
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer

D = 32


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).to(dtype)


def _step(sdp: ShardedDataParallel, opt: ZeroOptimizer, ctx: ParallelContext, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    n, r = ctx.size("dp"), ctx.rank("dp")
    rows = slice(r * 8 // n, (r + 1) * 8 // n)
    dtype = next(sdp.module.parameters()).dtype
    opt.zero_grad()
    nn.functional.mse_loss(sdp(x[rows].to(dtype)).float(), y[rows]).backward()
    opt.step()


# ---- a write to the params between steps is kept ----------------------------------------
def _written_params_survive(stage: int, how: str) -> None:
    ctx = ParallelContext.from_world()
    finals = {}
    for offload in (None, "cpu"):  # the offload path refreshes its masters: the reference
        sdp = ShardedDataParallel(_model(torch.bfloat16), ctx, stage, bucket_mb=0.002, offload=offload)
        opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        _step(sdp, opt, ctx, 0)
        torch.manual_seed(7)
        new = {k: torch.randn_like(v) for k, v in sdp.module.state_dict().items()}
        if how == "load_state_dict":
            sdp.module.load_state_dict(new)
        else:  # p.copy_ under no_grad: an EMA swap, a user's re-initialisation
            with torch.no_grad():
                for name, p in sdp.module.named_parameters():
                    p.copy_(new[name])
        written = {k: v.clone() for k, v in sdp.module.state_dict().items()}
        assert all(torch.equal(written[k], new[k].to(written[k].dtype)) for k in new)
        _step(sdp, opt, ctx, 1)
        after = sdp.module.state_dict()
        for k in written:  # one step from the written values: a small move, not back to the old ones
            assert float((after[k].float() - written[k].float()).abs().max()) < 0.05, k
        finals[offload] = {k: v.clone() for k, v in after.items()}
    for k in finals[None]:
        assert torch.equal(finals[None][k], finals["cpu"][k]), f"{k}: differs from the offloaded optimizer"
    ctx.destroy()


@pytest.mark.parametrize("how", ["load_state_dict", "copy_"])
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_params_written_between_steps_are_kept(dist_pool, stage: int, how: str) -> None:
    dist_pool.run(_written_params_survive, stage, how, world_size=2, timeout=60)


# ---- zero-size and frozen params in checkpoints -----------------------------------------
class _WithOddParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(D, D)
        self.empty = nn.Parameter(torch.zeros(0))  # trainable, zero elements (e.g. a 0-row adapter)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(torch.tanh(self.a(x))) + self.empty.sum()


def _odd_params_to_optimize(model: nn.Module, which: str) -> list[nn.Parameter]:
    """``"trainable"``: the trainable params; ``"all"``: ``model.parameters()``, frozen included
    (torch.optim accepts them and never steps them)."""
    return [p for p in model.parameters() if which == "all" or p.requires_grad]


def _save_with_odd_params(path: str, which: str) -> dict[str, torch.Tensor]:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_WithOddParams(), ctx, 2)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, _odd_params_to_optimize(sdp.module, which), lr=1e-2)
    for step in range(2):
        _step(sdp, opt, ctx, step)
    save_checkpoint(path, sdp, opt)
    ctx.destroy()
    return {k: v.clone() for k, v in sdp.module.state_dict().items()}


@pytest.mark.parametrize("which", ["trainable", "all"])
def test_zero_checkpoint_with_zero_size_and_frozen_params_loads_without_zero(dist_pool, tmp_path, which: str) -> None:
    """Saved by ZeRO-2 on 2 ranks; loaded by one process into the plain module and a torch AdamW
    over the same params the ZeroOptimizer got (the trainable ones, or model.parameters() with
    the frozen ones, as torch.optim allows), and consolidated for torch alone."""
    from shardkit.consolidate import consolidate

    path = str(tmp_path / "ck")
    saved = dist_pool.run(_save_with_odd_params, path, which, world_size=2, timeout=60)[0]
    model = _WithOddParams()
    frozen_before = {k: v.clone() for k, v in model.frozen.state_dict().items()}
    for k, v in frozen_before.items():  # frozen params were members, never stepped
        assert torch.equal(saved[f"frozen.{k}"], v), k
    opt = torch.optim.AdamW(_odd_params_to_optimize(model, which), lr=1e-2)
    load_checkpoint(path, model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    model_pt, opt_pt = consolidate(path, tmp_path / "export")
    plain = _WithOddParams()
    plain.load_state_dict(torch.load(model_pt, weights_only=True))
    plain_opt = torch.optim.AdamW(_odd_params_to_optimize(plain, which), lr=1e-2)
    plain_opt.load_state_dict(torch.load(opt_pt, weights_only=True))
    assert float(plain_opt.state[plain.a.weight]["step"]) == 2


# ---- steps skipped after clipping do not grow the transient figure ----------------------
def _skipped_steps_memory() -> list[int]:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(), ctx, 2, bucket_mb=0.002, grad_dtype=torch.bfloat16)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-2)
    peaks = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, D, generator=g)
        opt.zero_grad()
        sdp(x).square().mean().backward()
        sdp.clip_grad_norm_(1.0)
        if step == 0:
            opt.step()  # one real step; then a run that skips it (a bad loss, a debugging loop)
        peaks.append(sdp.memory_report()["peak_transient"])
    ctx.destroy()
    return peaks


def test_skipped_steps_after_clipping_keep_the_transient_figure(dist_pool) -> None:
    for peaks in dist_pool.run(_skipped_steps_memory, world_size=2, timeout=60):
        assert len(set(peaks[1:])) == 1 and peaks[1] <= peaks[0], peaks


# ---- a constructor check failing on one rank fails on every rank, at once ----------------
def _nvme_dir_missing_on_one_rank(root: str) -> str:
    ctx = ParallelContext.from_world(timeout=timedelta(seconds=20))
    good = os.path.join(root, "nvme")
    os.makedirs(good, exist_ok=True)
    nvme_dir = good if ctx.global_rank == 0 else os.path.join(root, "not-there")
    try:
        sdp = ShardedDataParallel(_model(), ctx, 2, offload="nvme", nvme_dir=nvme_dir)
        ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-2)
    except CommTimeoutError as e:  # the hang this test exists for
        raise AssertionError(f"a collective timed out instead of an agreed error: {e}") from e
    except (ValueError, RuntimeError) as e:
        msg = str(e)
    else:
        raise AssertionError("no error")
    # tearing the groups down while a peer still reads the agreement's last bytes would turn its
    # ValueError into gloo's "connection closed": wait for every rank first, as a job would
    torch.distributed.barrier()
    ctx.destroy()
    return msg


def test_nvme_dir_missing_on_one_rank_raises_on_every_rank(dist_pool, tmp_path) -> None:
    msgs = dist_pool.run(_nvme_dir_missing_on_one_rank, str(tmp_path), world_size=2, timeout=60)
    assert "not-there" in msgs[1] and "nvme_dir" in msgs[1]
    assert "rank(s) [1]" in msgs[0] and "nvme_dir" in msgs[0], msgs[0]  # names the rank that failed


def _add_param_group() -> None:
    ctx = ParallelContext.from_world()
    model = _model()
    sdp = ShardedDataParallel(model, ctx, 2, bucket_mb=0.002)
    first, second = list(sdp.module[0].parameters()), list(sdp.module[2].parameters())
    opt = ZeroOptimizer(sdp, torch.optim.SGD, [{"params": first}], lr=0.1)
    ref = _model()
    ref_opt = torch.optim.SGD(list(ref[0].parameters()), lr=0.1)
    opt.add_param_group({"params": second, "lr": 0.05})  # e.g. progressive unfreezing's new group
    ref_opt.add_param_group({"params": list(ref[2].parameters()), "lr": 0.05})
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05]
    with pytest.raises(ValueError, match="already"):
        opt.add_param_group({"params": first})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    n, r = ctx.size("dp"), ctx.rank("dp")
    rows = slice(r * 8 // n, (r + 1) * 8 // n)
    opt.zero_grad()
    nn.functional.mse_loss(sdp(x[rows]), y[rows]).backward()
    opt.step()
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    for p, q in zip(sdp.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # SGD: the order's spread stays ~1 ulp
    ctx.destroy()


def test_add_param_group_steps_the_new_group_like_torch(dist_pool) -> None:
    dist_pool.run(_add_param_group, world_size=2, timeout=60)
