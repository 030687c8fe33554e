"""``shardkit.deepspeed.ops.adam``: DeepSpeed's optimizer names mean what they mean in DeepSpeed.

DeepSpeed's ``FusedAdam`` defaults to ``adam_w_mode=True`` (decoupled decay, torch's AdamW) and
``adam_w_mode=False`` is Adam with L2 decay (torch's Adam); ``DeepSpeedCPUAdam`` likewise with
``adamw_mode``. Each is stepped next to the torch optimizer it must equal, on the same grads. At
ZeRO-2 through ``initialize``, a built ``FusedAdam(adam_w_mode=False)`` keeps its L2 mode when it
is rebuilt on the shards.
"""

from __future__ import annotations

import pytest
import torch

from tolerances import FP32


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (5,), (33,))]


def _step_both(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, a: list, b: list) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p, q in zip(a, b, strict=True):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()


@pytest.mark.parametrize(
    ("name", "mode_kwarg", "mode", "reference"),
    [
        ("FusedAdam", None, None, torch.optim.AdamW),  # the default: decoupled
        ("FusedAdam", "adam_w_mode", True, torch.optim.AdamW),
        ("FusedAdam", "adam_w_mode", False, torch.optim.Adam),
        ("DeepSpeedCPUAdam", None, None, torch.optim.AdamW),
        ("DeepSpeedCPUAdam", "adamw_mode", False, torch.optim.Adam),
    ],
)
def test_deepspeed_adam_names_follow_deepspeed_defaults(
    name: str, mode_kwarg: str | None, mode: bool | None, reference: type
) -> None:
    from shardkit.deepspeed.ops import adam

    a, b = _params(), _params()
    kwargs = {mode_kwarg: mode} if mode_kwarg else {}
    ours = getattr(adam, name)(a, lr=1e-2, weight_decay=0.1, **kwargs)
    theirs = reference(b, lr=1e-2, weight_decay=0.1)
    _step_both(ours, theirs, a, b)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, **FP32)


def test_bias_correction_off_is_refused_by_name() -> None:
    from shardkit.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    with pytest.raises(NotImplementedError, match="bias_correction=False"):
        FusedAdam(_params(), bias_correction=False)
    with pytest.raises(NotImplementedError, match="fp32_optimizer_states=False"):
        DeepSpeedCPUAdam(_params(), fp32_optimizer_states=False)


def _l2_fused_adam_at_zero2() -> list[float]:
    import torch.distributed as dist

    import shardkit
    from shardkit.deepspeed.ops.adam import FusedAdam

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    reference.load_state_dict(model.state_dict())
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
    }
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, adam_w_mode=False)
    engine, rebuilt, _, _ = shardkit.initialize(model=model, optimizer=opt, config=config)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, weight_decay=0.1)  # L2, one process, whole batch
    gen = torch.Generator().manual_seed(5)
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(3):
        x, y = torch.randn(4 * world, 8, generator=gen), torch.randn(4 * world, 2, generator=gen)
        rows = slice(4 * rank, 4 * rank + 4)
        engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    full = engine.full_state_dict()
    for key, want in reference.state_dict().items():
        torch.testing.assert_close(full[key], want, rtol=1e-5, atol=1e-6)
    return [float(v) for v in full["0.weight"].flatten()[:3]]


def test_a_built_l2_fused_adam_keeps_its_mode_when_rebuilt_on_zero2_shards(dist_pool) -> None:
    out = dist_pool.run(_l2_fused_adam_at_zero2, world_size=2, timeout=120)
    assert out[0] == out[1]
