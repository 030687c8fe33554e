"""Backward split into input (B) and weight (W) gradients (no processes), against one plain
``torch.autograd.grad`` over input and weights; and W does not re-run the input path."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from tolerances import FP32

from shardkit.parallel.pipeline.backward import backward_input, backward_weight


class _Count(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Count.calls += 1
        return g


class _Tied(nn.Module):  # one Linear applied twice: consumer nodes below one another
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(self.lin(torch.tanh(self.lin(x))))


class _OffPath(nn.Module):  # a weight whose own node is not on the way to x (joins at the add)
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.lin(x) + self.w * 2.0


def _mlp():
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6, bias=False), nn.GELU(), nn.Linear(6, 6))


@pytest.mark.parametrize("make", [_mlp, _Tied, _OffPath])
@pytest.mark.parametrize("scalar", [False, True])
def test_split_backward_matches_autograd(make, scalar):
    torch.manual_seed(0)
    mod = make()
    params = list(mod.parameters())
    x = torch.randn(4, 3, 6, requires_grad=True)
    y = mod(x)
    g = None if scalar else torch.randn_like(y)
    if scalar:
        y = (y**2).mean()
    want = torch.autograd.grad(y, [x, *params], grad_outputs=g, retain_graph=True)
    dx, work = backward_input(y, x, g, params)
    torch.testing.assert_close(dx, want[0], **FP32)
    dws = backward_weight(work)
    assert len(dws) == len(params)
    for got, ref in zip(dws, want[1:], strict=True):
        torch.testing.assert_close(got, ref, **FP32)
    assert work.output is None and work.captured == {}  # no re-walk fallback; freed


@pytest.mark.parametrize("make", [_mlp, _Tied, _OffPath])
def test_split_backward_accumulates_into_grad(make):
    """``accumulate=True`` adds W's gradients into ``.grad`` (twice: the sum of two passes)."""
    torch.manual_seed(0)
    mod = make()
    params = list(mod.parameters())
    x = torch.randn(4, 3, 6, requires_grad=True)
    g = torch.randn(4, 3, 6)
    want = torch.autograd.grad(mod(x), params, grad_outputs=g)
    for _ in range(2):
        y = mod(x)
        _, work = backward_input(y, x, g, params)
        assert backward_weight(work, accumulate=True) == ()
    for q, ref in zip(params, want, strict=True):
        torch.testing.assert_close(q.grad, 2 * ref, **FP32)
    assert x.grad is None  # only the weights were asked for


def test_weight_pass_does_not_rerun_the_input_path():
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    x = torch.randn(2, 6, requires_grad=True)
    y = mod[2](_Count.apply(mod[1](mod[0](x))))
    _Count.calls = 0
    backward_input(y, x, torch.ones_like(y), list(mod.parameters()))[1]
    assert _Count.calls == 1
    work = backward_input(mod[2](_Count.apply(mod[1](mod[0](x)))), x, torch.ones_like(y), list(mod.parameters()))[1]
    _Count.calls = 0
    backward_weight(work)
    assert _Count.calls == 0  # a re-walk from the output would pass through _Count again


def test_input_independent_output_gives_zero_dx():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    y = lin(torch.ones(2, 3))
    dx, work = backward_input(y, x, torch.ones_like(y), list(lin.parameters()))
    assert torch.equal(dx, torch.zeros_like(x))
    assert work.output is y  # the fallback: W from the output
    ref = torch.autograd.grad(lin(torch.ones(2, 3)), list(lin.parameters()), torch.ones_like(y))
    for got, want in zip(backward_weight(work), ref, strict=True):
        torch.testing.assert_close(got, want, **FP32)
