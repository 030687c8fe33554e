"""fp16/bf16 params *without* master weights: FusedAdamW / FusedSGD / FusedLion vs torch's math.

The contract of this mode (``kernels/adam.py`` etc.): params and optimizer state are stored in
the param dtype; each step upcasts them to fp32, applies the optimizer's fp32 math, and writes
every stored tensor (param *and* moments) back rounded once to its dtype.

The reference is built from that contract and torch alone, step by step from identical state:
before every step the reference takes our stored (fp16/bf16) param and state, upcast to fp32,
runs ``torch.optim.AdamW`` / ``torch.optim.SGD`` (Lion: its written-out formula, torch.optim has
none) on them in fp32, and rounds the results to the param dtype. Ours must land on the same
fp16/bf16 value or its neighbour (``tolerances.assert_lowp_step_close``). Comparing one step at
a time keeps the bound one ulp (no drift feeds back), and comparing the *state* as well as the
params catches a moment that is computed but never written back (then it stays zero/stale).

Why not ``torch.optim`` stepping the fp16/bf16 tensors themselves: it rounds every intermediate
(``buf = round(round(m * buf) + round(g + wd * p))``), which is not this mode's contract, and
under cancellation it lands several ulps from the once-rounded result (measured: FusedSGD vs
``torch.optim.SGD`` in bf16, 3.4e-5 apart on a value of 5.6e-3), so no tolerance from
``tests/tolerances.py`` would hold; AdamW happened to stay within a few ulps.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.kernels import FusedAdamW, FusedLion, FusedSGD
from tolerances import assert_lowp_step_close

STEPS = 4
SHAPES = [(5, 7), (33,), (1,), (130,)]  # odd sizes, a scalar-ish one, one above small blocks

ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
SGD = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
LION = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _ours(name: str, params: list[torch.nn.Parameter], backend: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return FusedAdamW(params, **ADAM, backend=backend)
    if name == "sgd":
        return FusedSGD(params, **SGD, backend=backend)
    return FusedLion(params, **LION, backend=backend)


STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "lion": ("exp_avg",)}


def _reference_step(name: str, step: int, params: list[torch.Tensor], grads: list[torch.Tensor], state: list[dict]):
    """One step of torch's fp32 math from the given low-precision param/state, rounded once.

    Returns (new params, new state) in the param dtype.
    """
    dtype = params[0].dtype
    w = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    for p, g in zip(w, grads):
        p.grad = g.float()
    if name == "lion":
        b1, b2 = LION["betas"]
        new_p, new_s = [], []
        for p, g, s in zip(w, grads, state):
            m = s["exp_avg"].float() if s else torch.zeros_like(p)
            g = g.float()
            c = b1 * m + (1 - b1) * g
            new_p.append((p.detach() * (1 - LION["lr"] * LION["weight_decay"]) - LION["lr"] * torch.sign(c)).to(dtype))
            new_s.append({"exp_avg": (b2 * m + (1 - b2) * g).to(dtype)})
        return new_p, new_s
    opt = torch.optim.AdamW(w, **ADAM) if name == "adamw" else torch.optim.SGD(w, **SGD)
    for p, s in zip(w, state):
        if s:  # from the second step on: our state, upcast
            opt.state[p] = {k: v.float().clone() for k, v in s.items() if k != "step"}
            if name == "adamw":
                opt.state[p]["step"] = torch.tensor(float(step - 1))
    opt.step()
    new_s = [{k: opt.state[p][k].to(dtype) for k in STATE_KEYS[name]} for p in w]
    return [p.detach().to(dtype) for p in w], new_s


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_lowp_without_master_matches_torch_step_by_step(name: str, dtype: torch.dtype, backend: str) -> None:
    params = _params(dtype)
    opt = _ours(name, params, backend)
    for step in range(1, STEPS + 1):
        grads = _grads(step, dtype)
        before = [p.detach().clone() for p in params]
        state_before = [
            {k: v.detach().clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} if opt.state[p] else {}
            for p in params
        ]
        exp_params, exp_state = _reference_step(name, step, before, grads, state_before)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, p in enumerate(params):
            assert p.dtype == dtype
            assert_lowp_step_close(p.detach(), exp_params[i], before[i])
            for key in STATE_KEYS[name]:
                got = opt.state[p][key]
                assert got.dtype == dtype, (key, got.dtype)  # no master: state in the param dtype
                prev = state_before[i].get(key)
                assert_lowp_step_close(got, exp_state[i][key], prev)
