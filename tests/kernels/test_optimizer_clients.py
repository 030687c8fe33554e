"""The fused optimizers as real clients use them.

``torch.compile(opt.step)``; state_dict interchange with ``torch.optim`` that keeps the target's
fast-path flags; ``master_weights=True`` noticing params written by the user; and Hugging Face
GPT-2 / Llama models built from tiny configs (no download) trained against ``torch.optim.AdamW``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from optimizer_cases import DEFAULTS, PAIRS, loss_fn, make_model, train
from tolerances import FP32, MASTER, rounded_param


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


# ---- state_dict interchange keeps the target's implementation ---------------------------------
FLAGS = ("fused", "foreach", "capturable", "differentiable")
INTERCHANGE = [
    ("adam", dict(lr=1e-2, weight_decay=0.01), "_fused_adam_"),
    ("adamw", dict(lr=1e-2, weight_decay=0.1), "_fused_adamw_"),
    ("sgd", dict(lr=0.05, momentum=0.9), "_fused_sgd_"),
]


def _flags(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: g[k] for k in FLAGS if k in g} for g in opt.param_groups]


def _ops_run(fn: Any) -> set[str]:
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.function_events}


@pytest.mark.parametrize("name, kw, fused_op", INTERCHANGE, ids=[n for n, _, _ in INTERCHANGE])
@pytest.mark.parametrize("direction", ["fused_to_torch", "torch_to_fused"])
def test_state_dict_interchange_keeps_the_targets_fast_path(name: str, kw: dict, fused_op: str, direction: str) -> None:
    """torch's load_state_dict takes group flags from the saved dict: ours must not switch a
    ``torch.optim.AdamW(fused=True)`` target to its for-loop path (it did: saved ``fused=None``)."""
    fused_cls, torch_cls = PAIRS[name]

    def build(cls: type, model: nn.Module) -> torch.optim.Optimizer:
        return cls(model.parameters(), backend="torch", **kw) if cls is fused_cls else cls(model.parameters(), fused=True, **kw)

    src_cls, dst_cls = (fused_cls, torch_cls) if direction == "fused_to_torch" else (torch_cls, fused_cls)
    model = make_model()
    src = build(src_cls, model)
    train(model, src, 3)
    model2 = copy.deepcopy(model)
    dst = build(dst_cls, model2)
    before = _flags(dst)
    dst.load_state_dict(copy.deepcopy(src.state_dict()))
    assert _flags(dst) == before
    if dst_cls is torch_cls:  # and the target really runs its fused kernel
        assert f"aten::{fused_op}" in _ops_run(lambda: train(model2, dst, 1, start=3))
        train(model, src, 1, start=3)
    train(model, src, 3, start=4)
    train(model2, dst, 3, start=4)
    assert_close(list(model2.parameters()), list(model.parameters()), **FP32)
    # and the way back: a second load into the source class keeps the source's flags too
    src_flags = _flags(src)
    src.load_state_dict(dst.state_dict())
    assert _flags(src) == src_flags


# ---- master weights notice params written by the user -----------------------------------------
def _write(how: str, model: nn.Module, opt: torch.optim.Optimizer, weights: dict[str, torch.Tensor]) -> None:
    if how == "copy_":
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])
    elif how == "load_state_dict":  # a rollback to a checkpoint
        model.load_state_dict(weights)
    elif how == "opt_then_model_load":  # the optimizer's state first: the weights still win
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        model.load_state_dict(weights)
    elif how == "data_assign":  # an EMA swap through .data: new storage
        for n, p in model.named_parameters():
            p.data = weights[n].clone()
    else:  # in place through .data moves no version counter: the documented sync call
        for n, p in model.named_parameters():
            p.data.copy_(weights[n])
        opt.sync_master_weights()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("how", ["copy_", "load_state_dict", "opt_then_model_load", "data_assign", "data_copy_then_sync"])
def test_master_weights_continue_from_weights_the_user_wrote(backend: str, name: str, how: str) -> None:
    """With ``master_weights=True`` a user's write to the params used to be silently undone by the
    next step (it continued from the old fp32 master). Reference: torch.optim on fp32 copies,
    restarted from the same written weights with its moments kept."""
    fused_cls, ref_cls = PAIRS[name]
    model = make_model().to(torch.bfloat16)
    ref = make_model().float()
    ref.load_state_dict(model.state_dict())  # same (rounded) start
    opt = fused_cls(model.parameters(), master_weights=True, backend=backend, **DEFAULTS[name])
    ref_opt = ref_cls(ref.parameters(), **DEFAULTS[name])
    gen = torch.Generator().manual_seed(7)

    def step() -> None:
        for p, r in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            r.grad = p.grad.float()  # the reference sees exactly the (rounded) grads we see
        opt.step()
        ref_opt.step()

    for _ in range(3):
        step()
    written = {n: torch.randn(p.shape, generator=gen).to(torch.bfloat16) for n, p in model.named_parameters()}
    _write(how, model, opt, written)
    ref.load_state_dict(written)
    assert all(torch.equal(p.float(), written[n].float()) for n, p in model.named_parameters())
    for _ in range(3):
        step()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert_close(opt.state[p]["master_param"], r.detach(), **MASTER)
        assert_close(p.detach().float(), r.detach(), **rounded_param(torch.bfloat16))


def _bf16_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        gen = torch.Generator().manual_seed(300 + i)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        opt.step()


def test_loaded_masters_are_kept_when_the_model_is_loaded_first() -> None:
    """The usual resume order (model, then optimizer) keeps the checkpoint's fp32 masters: a
    rollback in a live optimizer continues exactly as a fresh optimizer resumed from the files."""
    model = make_model().to(torch.bfloat16)
    opt = PAIRS["adamw"][0](model.parameters(), master_weights=True, lr=1e-2)
    _bf16_steps(model, opt, range(2))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    _bf16_steps(model, opt, range(2, 4))  # move on, then roll back
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    _bf16_steps(model, opt, range(2, 3))
    model2 = make_model().to(torch.bfloat16)
    model2.load_state_dict(ckpt["model"])
    opt2 = PAIRS["adamw"][0](model2.parameters(), master_weights=True, lr=1e-2)
    opt2.load_state_dict(ckpt["opt"])
    _bf16_steps(model2, opt2, range(2, 3))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])
        # and that master is not the bf16 param: the checkpoint's fp32 precision was kept
    assert any(not torch.equal(opt.state[p]["master_param"], p.float()) for p in model.parameters())


# ---- Hugging Face models built from tiny configs (no download) --------------------------------
def _hf_model(kind: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":  # tied input/output embeddings: one param in two places
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=32,
        )
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).train()


def _hf_loss(model: nn.Module) -> torch.Tensor:
    # one fixed batch: its loss must fall within a few steps, whatever the initialisation
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(500))
    return model(input_ids=ids, labels=ids).loss


def _hf_train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, step: Any = None) -> list[float]:
    """``steps`` steps on fixed random tokens; ``step`` replaces ``opt.step`` (a compiled one)."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _hf_loss(model)
        loss.backward()
        (step or opt.step)()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_fp32_matches_torch_fused_adamw(kind: str) -> None:
    """FusedAdamW (the path a CPU user gets) vs ``torch.optim.AdamW(fused=True)`` on the whole
    param list of a real model: embeddings (GPT-2's tied to the head), norms, biases, GQA."""
    from shardkit.kernels import FusedAdamW

    model, ref = _hf_model(kind), _hf_model(kind)
    kw = dict(lr=1e-3, weight_decay=0.1)
    losses = _hf_train(model, FusedAdamW(model.parameters(), **kw), 5)
    ref_losses = _hf_train(ref, torch.optim.AdamW(ref.parameters(), fused=True, **kw), 5)
    assert losses[-1] < losses[0]  # it trains
    assert_close(losses, ref_losses, **FP32)
    assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), **FP32)


def test_hf_gpt2_compiled_step_matches_eager() -> None:
    import torch._dynamo

    from shardkit.kernels import FusedAdamW

    torch._dynamo.reset()
    model, ref = _hf_model("gpt2"), _hf_model("gpt2")
    opt, ref_opt = FusedAdamW(model.parameters(), lr=1e-3), FusedAdamW(ref.parameters(), lr=1e-3)
    _hf_train(model, opt, 3, step=torch.compile(opt.step))
    _hf_train(ref, ref_opt, 3)
    assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_bf16_master_weights_track_fp32_reference(kind: str) -> None:
    """bf16 params with fp32 masters vs ``torch.optim.AdamW`` on fp32 copies fed the same (bf16)
    grads: masters within :data:`tolerances.MASTER`, params one rounding away (``rounded_param``)."""
    from shardkit.kernels import FusedAdamW

    model = _hf_model(kind, torch.bfloat16)
    ref = _hf_model(kind)
    ref.load_state_dict(model.state_dict())  # same (rounded) start
    kw = dict(lr=1e-3, weight_decay=0.1)
    opt = FusedAdamW(model.parameters(), master_weights=True, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **kw)
    pairs = list(zip(model.parameters(), ref.parameters()))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = _hf_loss(model)
        loss.backward()
        losses.append(loss.item())
        for p, r in pairs:
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    assert losses[-1] < losses[0]
    for p, r in pairs:
        assert_close(opt.state[p]["master_param"], r.detach(), **MASTER)
        assert_close(p.detach().float(), r.detach(), **rounded_param(torch.bfloat16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_master_weights_of_sibling_views_in_two_groups_are_not_reset(backend: str) -> None:
    """Params that are views of one tensor share its version counter: the optimizer's own write to
    one launch group must not look like a user write to the other (which would reset that group's
    fp32 master from the bf16 param every step and lose every sub-ulp update)."""
    from shardkit.kernels import FusedAdamW

    base = torch.ones(64, dtype=torch.bfloat16)
    a, b = nn.Parameter(base[:32]), nn.Parameter(base[32:])
    opt = FusedAdamW([{"params": [a]}, {"params": [b]}], lr=1e-4, master_weights=True, backend=backend)
    ref = torch.ones(32, dtype=torch.float32, requires_grad=True)  # the fp32 path the master follows
    ref_opt = torch.optim.AdamW([ref], lr=1e-4)
    for _ in range(20):
        a.grad, b.grad, ref.grad = torch.ones_like(a), torch.ones_like(b), torch.ones(32)
        opt.step()
        ref_opt.step()
    for p in (a, b):
        assert_close(opt.state[p]["master_param"], ref.detach(), **MASTER)
        assert_close(p.float(), ref.detach().to(torch.bfloat16).float(), rtol=0, atol=0)
