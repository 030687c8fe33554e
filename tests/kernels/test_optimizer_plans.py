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
    [(FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)), (FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9))],
)
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


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("ours", [FusedAdamW, FusedSGD])
def test_dense_non_contiguous_params_match_torch(backend, ours) -> None:
    """channels_last and transposed params (dense, not contiguous), incl. a grad of another layout."""
    kw = dict(lr=1e-2, weight_decay=0.1) if ours is FusedAdamW else dict(lr=1e-2, momentum=0.9)
    theirs = torch.optim.AdamW if ours is FusedAdamW else torch.optim.SGD
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(2, 3, 4, 5, generator=g), torch.randn(6, 7, generator=g)]

    def make():
        return [
            torch.nn.Parameter(base[0].clone().to(memory_format=torch.channels_last)),
            torch.nn.Parameter(base[1].clone().t().contiguous().t()),
        ]

    a, b = make(), make()
    opt_a, opt_b = ours(a, backend=backend, **kw), theirs(b, **kw)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=g) for p in a]  # contiguous: layout differs from a[0]
        for params, opt in ((a, opt_a), (b, opt_b)):
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            opt.step()
    torch.testing.assert_close([p.detach() for p in a], [p.detach() for p in b], rtol=1e-5, atol=1e-6)
    assert a[0].is_contiguous(memory_format=torch.channels_last)


def test_resized_param_raises_instead_of_corrupting_memory() -> None:
    p = torch.nn.Parameter(torch.ones(1024))
    opt = FusedAdamW([p])
    p.grad = torch.ones(1024)
    opt.step()
    p.data = torch.ones(4096)
    p.grad = torch.ones(4096)
    with pytest.raises(ValueError, match="exp_avg.*1024 elements.*4096"):
        opt.step()


def test_replaced_param_and_reset_state_are_noticed() -> None:
    a = _params()
    opt = _run(FusedAdamW, a, steps=["1111"], lr=1e-2)
    q = torch.nn.Parameter(torch.zeros(7))
    opt.param_groups[0]["params"][0] = q  # in-place replacement in the same list
    q.grad = torch.ones(7)
    opt.step()
    assert not torch.equal(q.detach(), torch.zeros(7))  # the new param was stepped
    opt.state = __import__("collections").defaultdict(dict)  # "reset the moments" idiom
    opt.step()  # re-initialises state like torch.optim
    assert float(opt.state[q]["step"]) == 1.0


@pytest.mark.parametrize("offset", [10, 1000])
def test_load_state_dict_with_non_sequential_ids_keeps_fp32_master(offset: int) -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(33).to(torch.bfloat16)) for _ in range(2)]
    opt = FusedAdamW(a, lr=1e-2, master_weights=True)
    for p in a:
        p.grad = torch.randn(33).to(torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    sd = {
        "state": {k + offset: v for k, v in sd["state"].items()},
        "param_groups": [dict(g, params=[i + offset for i in g["params"]]) for g in sd["param_groups"]],
    }
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt2 = FusedAdamW(b, lr=1e-2, master_weights=True)
    opt2.load_state_dict(sd)
    assert {k: v.dtype for k, v in opt2.state[b[0]].items() if k != "step"} == dict.fromkeys(
        ("exp_avg", "exp_avg_sq", "master_param"), torch.float32
    )
    for params, o in ((a, opt), (b, opt2)):
        for p in params:
            p.grad = torch.ones(33, dtype=torch.bfloat16)
        o.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_sync_master_weights_after_writing_params() -> None:
    p = torch.nn.Parameter(torch.zeros(16, dtype=torch.bfloat16))
    opt = FusedAdamW([p], lr=1e-3, weight_decay=0.0, master_weights=True)
    p.grad = torch.ones(16, dtype=torch.bfloat16)
    opt.step()
    with torch.no_grad():
        p.fill_(5.0)
    opt.sync_master_weights()
    opt.step()
    assert torch.allclose(p.float(), torch.full((16,), 5.0 - 1e-3), atol=0.02)  # continues from 5.0


def _conv_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Tanh(), torch.nn.Conv2d(4, 2, 3))
    return net.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_channels_last_sgd_momentum_survives_replans_and_state_dict(backend) -> None:
    """Momentum must be created in the param's layout, or a re-plan (a step with
    a grad-less param, load_state_dict) permutes it and the exported state_dict is scrambled."""
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    ours, ref = _conv_net(), _conv_net()
    opt, ref_opt = FusedSGD(ours.parameters(), backend=backend, **kw), torch.optim.SGD(ref.parameters(), **kw)

    def step(i: int, model: torch.nn.Module, o: torch.optim.Optimizer) -> None:
        g = torch.Generator().manual_seed(200 + i)
        x = torch.randn(2, 3, 7, 7, generator=g).to(memory_format=torch.channels_last)
        o.zero_grad()
        (model(x) ** 2).mean().backward()
        if i == 2:
            model[2].bias.grad = None  # one grad-less param: the step re-plans every launch group
        o.step()

    def check() -> None:
        torch.testing.assert_close(list(ours.parameters()), list(ref.parameters()), rtol=1e-5, atol=1e-6)
        ours_sd, ref_sd = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        for k in ref_sd:
            torch.testing.assert_close(ours_sd[k]["momentum_buffer"], ref_sd[k]["momentum_buffer"], rtol=1e-5, atol=1e-6)

    for i in range(5):
        step(i, ours, opt)
        step(i, ref, ref_opt)
        check()
    # round trip through a checkpoint into a fresh FusedSGD (load_state_dict re-plans too)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt = FusedSGD(ours.parameters(), backend=backend, **kw)
    opt.load_state_dict(torch.load(buf))
    for i in range(5, 8):
        step(i, ours, opt)
        step(i, ref, ref_opt)
        check()
    assert ours[0].weight.is_contiguous(memory_format=torch.channels_last)
