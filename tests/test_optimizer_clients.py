"""The fused optimizers as real clients use them (issue 6, "What real clients hit").

``torch.compile(opt.step)``; state_dict interchange with ``torch.optim`` that keeps the target's
fast-path flags; ``master_weights=True`` noticing params written by the user; and Hugging Face
GPT-2 / Llama models built from tiny configs (no download) trained against ``torch.optim.AdamW``.
"""

from __future__ import annotations


import pytest
import torch
from torch.testing import assert_close

from test_optimizers import DEFAULTS, PAIRS, loss_fn, make_model, train
from tolerances import FP32


# ---- torch.compile(opt.step) ----------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion", "lamb"])
def test_compiled_step_matches_eager(backend: str, name: str) -> None:
    """It used to crash inside inductor (the CPU path's private fused ops); now the update runs
    eagerly behind a graph break, so params match the eager optimizer exactly."""
    import torch._dynamo

    torch._dynamo.reset()  # a fresh cache: never the recompile-limit fallback to eager
    fused_cls = PAIRS[name][0]
    model, eager_model = make_model(), make_model()
    opt = fused_cls(model.parameters(), backend=backend, **DEFAULTS[name])
    eager = fused_cls(eager_model.parameters(), backend=backend, **DEFAULTS[name])
    step = torch.compile(opt.step, fullgraph=False)
    for i in range(4):
        if i < 2:
            opt.zero_grad()
            loss_fn(model, i).backward()
            step()
        else:  # with a closure, as LBFGS-style callers pass one

            def closure(i: int = i) -> torch.Tensor:
                opt.zero_grad()
                loss = loss_fn(model, i)
                loss.backward()
                return loss

            assert torch.isfinite(step(closure))
        train(eager_model, eager, 1, start=i)
        # the update itself is eager: bitwise equal; a compiled closure's forward/backward is
        # inductor code (other op order), so grads and everything after differ by fp32 rounding
        tol = dict(rtol=0, atol=0) if i < 2 else FP32
        assert_close(list(model.parameters()), list(eager_model.parameters()), **tol)
