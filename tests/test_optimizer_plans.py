"""The cached step plans of the fused optimizers (see [Note: cached step plans])."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from shardkit.kernels import FusedAdamW, FusedLAMB, FusedSGD

# Which of 4 params get a grad at each step: the plan must be rebuilt whenever this changes,
# and params that skipped steps have their own (smaller) step count afterwards.
PATTERN = ["1111", "1111", "1010", "1010", "0111", "1111", "1111", "0001", "1111"]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (7, 16, 33, 1)]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g) for n in (7, 16, 33, 1)]


def _run(opt_cls, params, steps=PATTERN, **kw):
    opt = opt_cls(params, **kw)
    for step, mask in enumerate(steps):
        for p, g, on in zip(params, _grads(step), mask):
            p.grad = g.clone() if on == "1" else None
        opt.step()
    return opt


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("ours", "theirs", "kw"),
    [(FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
     (FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9))],
)  # fmt: skip
def test_changing_grad_presence_matches_torch(backend, ours, theirs, kw) -> None:
    a, b = _params(), _params()
    opt_a = _run(ours, a, backend=backend, **kw)
    opt_b = _run(theirs, b, **kw)
    torch.testing.assert_close([p.detach() for p in a], [p.detach() for p in b], rtol=1e-5, atol=1e-6)
    if ours is FusedAdamW:  # step counters diverged per param exactly as torch's did
        assert [float(opt_a.state[p]["step"]) for p in a] == [float(opt_b.state[p]["step"]) for p in b]


def test_lamb_steps_count_per_param_after_skips() -> None:
    params = _params()
    opt = _run(FusedLAMB, params)
    expected = [sum(m[i] == "1" for m in PATTERN) for i in range(4)]
    assert [float(opt.state[p]["step"]) for p in params] == expected


def test_deepcopy_and_pickle_continue_identically() -> None:
    a = _params()
    opt = _run(FusedAdamW, a, lr=1e-2)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    clone = FusedAdamW(b, lr=1e-2)
    clone.load_state_dict(pickle.loads(pickle.dumps(opt.state_dict())))
    twin = copy.deepcopy(opt)  # deep-copies its own params too
    for step in range(3):
        for params in (a, b, twin.param_groups[0]["params"]):
            for p, g in zip(params, _grads(50 + step)):
                p.grad = g.clone()
        opt.step(), clone.step(), twin.step()
    torch.testing.assert_close([p.detach() for p in b], [p.detach() for p in a], rtol=0, atol=0)
    torch.testing.assert_close([p.detach() for p in twin.param_groups[0]["params"]], [p.detach() for p in a], rtol=0, atol=0)


def test_saved_state_dict_loads_into_torch_and_step_is_per_param() -> None:
    a = _params()
    opt = _run(FusedAdamW, a, lr=1e-2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    steps = [float(loaded["state"][i]["step"]) for i in range(4)]
    assert steps == [float(opt.state[p]["step"]) for p in a]
    torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in a], lr=1e-2).load_state_dict(loaded)
