"""The "zero1"/"zero2"/"zero3" strategies behind the training loop's one interface.

``shardkit train --strategy zero*`` steps bitwise like parallelize() by hand
(tests/cli/test_train_builds_through_parallelize.py), and its command line runs ZeRO-2 and ZeRO-3
end to end in tests/cli/test_train_faults.py and test_train_multinode.py.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.comm import ParallelContext
from shardkit.data import ALPHABET
from shardkit.kernels import FusedAdamW
from shardkit.models import TinyGPT, lm_loss
from shardkit.parallel import DynamicLossScaler
from shardkit.parallel.strategy import make_strategy
from shardkit.parallel.zero import ZeroOptimizer
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32

VOCAB = len(ALPHABET)


def _tiny_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, d_model=32, n_layers=2, n_heads=4, seq_len=16)  # tied embedding / head


def _strategy_body(name: str, steps: int, fp16: bool) -> list[float]:
    """Each rank trains its half of the global batch through ``name``; "none" on the whole batch
    in this process is the reference (decay/no-decay groups and clipping as the loop does)."""
    world = torch.distributed.get_world_size()
    with ParallelContext.from_world() as ctx:
        rank = ctx.rank("dp")

        def run(sname: str, ctx_: ParallelContext | None, rows: slice) -> tuple[torch.nn.Module, list]:
            scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1) if fp16 else None
            strategy = make_strategy(sname, ctx=ctx_, loss_scaler=scaler)
            model = strategy.wrap(_tiny_model())
            decay = [p for p in model.parameters() if p.dim() >= 2]
            no_decay = [p for p in model.parameters() if p.dim() < 2]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
            opt = strategy.make_optimizer(FusedAdamW, groups, lr=1e-2, eps=ADAM_EPS_ACROSS_ORDERS)
            stepped = []
            for step in range(steps):
                for group in opt.param_groups:
                    group["lr"] = 1e-2 / (step + 1)  # the loop's schedule path reaches the shard optimizer
                x = torch.randint(VOCAB, (4 * world, 16), generator=torch.Generator().manual_seed(step))
                opt.zero_grad(set_to_none=True)
                loss = lm_loss(model(x[rows]), x[rows])
                hook = None
                if step == 1 and fp16 and (sname == "none" or rank == world - 1):
                    # an overflow on ONE rank, in one row of one gradient (before any reduction)
                    first = next(model.parameters())
                    hook = first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
                strategy.backward(loss)
                if hook is not None:
                    hook.remove()
                strategy.clip(0.5)
                stepped.append(strategy.step(opt))
            return model, [stepped, strategy.report(opt), opt]

        zero, (z_stepped, z_report, z_opt) = run(name, ctx, slice(4 * rank, 4 * rank + 4))
        ref, (ref_stepped, ref_report, _) = run("none", None, slice(None))
        assert isinstance(z_opt, ZeroOptimizer)
        assert z_stepped == ref_stepped
        assert z_report.skipped_steps == ref_report.skipped_steps == (1 if fp16 else 0)
        assert z_report.loss_scale == ref_report.loss_scale
        assert z_report.comm["reduce_scatter"]["bytes"] > 0 and z_report.comm["all_gather"]["bytes"] > 0
        # full tensors (stage 3 holds only shards between steps; stages 1-2 copy their params)
        full = zero.full_state_dict()
        for k, r in ref.state_dict().items():
            torch.testing.assert_close(full[k], r, **FP32, msg=lambda m, k=k: f"{k}: {m}")
        return [float(v.sum()) for v in full.values()]


@pytest.mark.reduction_order
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scaler"])
@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_zero_strategy_matches_single_process_on_the_global_batch(dist_pool, name: str, fp16: bool) -> None:
    results = dist_pool.run(_strategy_body, name, 4, fp16, world_size=2, timeout=120)
    assert results[0] == results[1]  # replicas identical
