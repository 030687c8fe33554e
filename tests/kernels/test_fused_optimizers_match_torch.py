"""Fused optimizers against ``torch.optim`` (Adam, AdamW, SGD) and against written-out fp32
per-tensor references (Lion, LAMB), each through both executors: ``backend="triton"`` (the kernel
source, run by Triton's interpreter on CPU) and ``backend="torch"`` (the CPU fast path).

Covers multi-step training of a small model, master weights, launch counts, state_dict
interchange with torch in both directions, GradScaler, LR schedulers, tensor lr, param groups,
params without grads, and input validation. Property tests live in
``test_optimizer_properties.py``; tolerances in ``tolerances.py``.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from shardkit.kernels.fused_adam import FusedAdam, FusedAdamW
from shardkit.kernels.fused_lamb import FusedLAMB
from shardkit.kernels.fused_lion import FusedLion
from shardkit.kernels.fused_sgd import FusedSGD
from shardkit.kernels.runtime import count_launches
from tolerances import FP32, MASTER, assert_rounded_from, rounded_param
from optimizer_cases import DEFAULTS, PAIRS, loss_fn, make_model, train

BACKENDS = ("triton", "torch")


#: Triton kernels one launch group takes (LAMB: moments + norms, then apply)
KERNELS: dict[str, tuple[str, ...]] = {
    "adam": ("_adam_kernel",),
    "adamw": ("_adam_kernel",),
    "sgd": ("_sgd_kernel",),
    "lion": ("_lion_kernel",),
    "lamb": ("_lamb_moments_kernel", "_lamb_apply_kernel"),
}
NAMES = tuple(PAIRS)
# odd sizes, a 1-element and a 0-element tensor
SHAPES = [(13, 9), (9,), (5, 9), (5,), (1,), (0, 3)]


# ---- helpers ---------------------------------------------------------------------------------
def case_id(name: str, kw: dict[str, Any]) -> str:
    return "-".join([name] + [f"{k}={v}" for k, v in kw.items()]).replace(" ", "")


def make_pair(name: str, backend: str, seed: int = 0, **kw: Any):
    """(model, fused optimizer, reference model, reference optimizer), same initial weights."""
    fused_cls, ref_cls = PAIRS[name]
    model = make_model(seed)
    ref_model = copy.deepcopy(model)
    return model, fused_cls(model.parameters(), backend=backend, **kw), ref_model, ref_cls(ref_model.parameters(), **kw)


def assert_params_close(a: nn.Module, b: nn.Module, **tol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_close(p.detach(), q.detach(), **tol, msg=lambda m, name=name: f"{name}: {m}")


def assert_state_close(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer, **tol: float) -> None:
    """Same state keys (ignoring our ``master_param``) and values, param by param."""
    for p, q in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"]):
        ours = {k: v for k, v in opt.state[p].items() if k != "master_param"}
        theirs = ref.state[q]
        assert set(ours) == set(theirs)
        for key, value in theirs.items():
            assert_close(torch.as_tensor(ours[key]).float(), torch.as_tensor(value).float(), **tol)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def random_params(dtype: torch.dtype, seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def set_grads(params: list[torch.Tensor], step: int, dtype: torch.dtype | None = None) -> None:
    gen = torch.Generator().manual_seed(2000 + step)
    for p in params:
        g = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=dtype or p.dtype)
        if g.dtype != p.dtype:
            p.grad_dtype = g.dtype  # torch checks grad dtypes; e.g. fp32 grads for bf16 params
        p.grad = g


# ---- fp32 training against torch / the references ------------------------------------------
TRAIN_CASES = [
    ("adam", dict(lr=1e-2)),
    ("adam", dict(lr=1e-2, weight_decay=0.1)),
    ("adam", dict(lr=1e-2, amsgrad=True, maximize=True)),
    ("adam", dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, amsgrad=True)),
    ("adamw", dict(lr=1e-2)),
    ("adamw", dict(lr=1e-2, weight_decay=0.3, amsgrad=True)),
    ("adamw", dict(lr=1e-2, weight_decay=0.0, maximize=True)),
    ("sgd", dict(lr=0.05)),
    ("sgd", dict(lr=0.05, momentum=0.9)),
    ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.3)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd", dict(lr=0.05, weight_decay=0.1, maximize=True)),
    ("sgd", dict(lr=0.05, momentum=0.5, dampening=0.1, weight_decay=0.1, maximize=True)),
    ("lion", dict(lr=1e-3)),
    ("lion", dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.5, maximize=True)),
    ("lamb", dict(lr=1e-2)),
    ("lamb", dict(lr=1e-2, weight_decay=0.0)),  # not adapted (Apex's default): trust ratio 1
    ("lamb", dict(lr=1e-2, weight_decay=0.0, always_adapt=True)),
    ("lamb", dict(lr=1e-2, weight_decay=0.1, bias_correction=False, weight_norm_clip=(0.5, 1.0), maximize=True)),
    ("lamb", dict(lr=1e-2, weight_norm_clip=(0.0, float("inf")), max_trust_ratio=0.01)),  # the cap binds
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, kw", TRAIN_CASES, ids=[case_id(n, k) for n, k in TRAIN_CASES])
def test_training_matches_reference_fp32(backend: str, name: str, kw: dict) -> None:
    model, opt, ref_model, ref_opt = make_pair(name, backend, **kw)
    train(model, opt, 12)
    train(ref_model, ref_opt, 12)
    assert_params_close(model, ref_model, **FP32)
    assert_state_close(opt, ref_opt, **FP32)
    assert not torch.equal(model[0].weight, make_model()[0].weight)  # it did train


# ---- mixed precision: fp16/bf16 params with fp32 master weights --------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("grad_dtype", ["param", "fp32"])
def test_master_weights_track_fp32_reference(backend: str, name: str, dtype: torch.dtype, grad_dtype: str) -> None:
    fused_cls, ref_cls = PAIRS[name]
    params = random_params(dtype)
    ref = [nn.Parameter(p.detach().float()) for p in params]  # same (rounded) start
    opt = fused_cls(params, master_weights=True, backend=backend, **DEFAULTS[name])
    ref_opt = ref_cls(ref, **DEFAULTS[name])
    for step in range(10):
        set_grads(params, step, dtype if grad_dtype == "param" else torch.float32)
        for p, r in zip(params, ref):
            r.grad = p.grad.float()  # the reference sees exactly the (rounded) grads we see
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        state = opt.state[p]
        assert all(v.dtype == torch.float32 for k, v in state.items() if isinstance(v, torch.Tensor))
        assert_close(state["master_param"], r.detach(), **MASTER)
        assert_rounded_from(p.detach(), state["master_param"], interpreted=backend == "triton")
        assert_close(p.detach().float(), r.detach(), **rounded_param(dtype))


# ---- launch counts -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_one_launch_per_step_for_a_single_dtype_model(name: str) -> None:
    model, opt, *_ = make_pair(name, "triton", **DEFAULTS[name])
    for i in range(3):  # first steps (state creation, SGD's buffer init) included
        opt.zero_grad()
        loss_fn(model, i).backward()
        with count_launches() as launches:
            opt.step()
        assert dict(launches) == {k: 1 for k in KERNELS[name]}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("master_weights", [False, True])
def test_two_dtypes_take_two_launches(name: str, master_weights: bool) -> None:
    params = random_params(torch.float32) + random_params(torch.bfloat16, seed=1)
    opt = PAIRS[name][0](params, master_weights=master_weights, backend="triton", **DEFAULTS[name])
    set_grads(params, 0)
    with count_launches() as launches:
        opt.step()
    assert dict(launches) == {k: 2 for k in KERNELS[name]}


def test_lamb_group_without_adaptation_takes_one_launch() -> None:
    params = random_params(torch.float32)
    opt = FusedLAMB([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}], backend="triton")
    set_grads(params, 0)
    with count_launches() as launches:
        opt.step()
    assert dict(launches) == {"_lamb_moments_kernel": 2, "_lamb_apply_kernel": 1}


@pytest.mark.parametrize("name", NAMES)
def test_torch_backend_launches_no_triton_kernel(name: str) -> None:
    model, opt, *_ = make_pair(name, "torch", **DEFAULTS[name])
    loss_fn(model, 0).backward()
    with count_launches() as launches:
        opt.step()
    assert not launches


# ---- state_dict interchange with torch.optim -------------------------------------------------
ROUND_TRIP = [
    ("adamw", dict(lr=1e-2, weight_decay=0.1)),
    ("adam", dict(lr=1e-2, weight_decay=0.01, amsgrad=True)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("sgd", dict(lr=0.05)),  # no momentum: no state at all, as torch
]


def _save_load(state_dict: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, kw", ROUND_TRIP, ids=[case_id(n, k) for n, k in ROUND_TRIP])
@pytest.mark.parametrize("direction", ["fused_to_torch", "torch_to_fused"])
def test_state_dict_interchanges_with_torch(backend: str, name: str, kw: dict, direction: str) -> None:
    fused_cls, torch_cls = PAIRS[name]

    def build(cls: type, model: nn.Module) -> torch.optim.Optimizer:
        return cls(model.parameters(), backend=backend, **kw) if cls is fused_cls else cls(model.parameters(), **kw)

    src_cls, dst_cls = (fused_cls, torch_cls) if direction == "fused_to_torch" else (torch_cls, fused_cls)
    model = make_model()
    src = build(src_cls, model)
    train(model, src, 4)
    model2 = copy.deepcopy(model)
    dst = build(dst_cls, model2)
    dst.load_state_dict(_save_load(src.state_dict()))
    assert_state_close(dst, src, rtol=0, atol=0)
    train(model, src, 4, start=4)
    train(model2, dst, 4, start=4)
    assert_params_close(model2, model, **FP32)
    assert_state_close(dst, src, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_master_weight_state_survives_save_and_load_in_fp32(backend: str, name: str) -> None:
    fused_cls = PAIRS[name][0]
    params = random_params(torch.bfloat16)
    opt = fused_cls(params, master_weights=True, backend=backend, **DEFAULTS[name])
    for step in range(3):
        set_grads(params, step)
        opt.step()
    params2 = [nn.Parameter(p.detach().clone()) for p in params]
    opt2 = fused_cls(params2, master_weights=True, backend=backend, **DEFAULTS[name])
    opt2.load_state_dict(_save_load(opt.state_dict()))
    for p, p2 in zip(params, params2):
        assert opt2.state[p2].keys() == opt.state[p].keys()
        for key, value in opt.state[p].items():
            assert value.dtype == opt2.state[p2][key].dtype  # fp32 master and moments stay fp32
            assert torch.equal(value, opt2.state[p2][key]), key
    for step in range(3, 6):
        set_grads(params, step)
        set_grads(params2, step)
        opt.step()
        opt2.step()
    for p, p2 in zip(params, params2):
        assert torch.equal(p, p2)
        assert torch.equal(opt.state[p]["master_param"], opt2.state[p2]["master_param"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_state_dict_into_master_weights_starts_master_from_param(backend: str) -> None:
    params = random_params(torch.bfloat16)
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    set_grads(params, 0)
    torch_opt.step()
    params2 = [nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdamW(params2, lr=1e-2, master_weights=True, backend=backend)
    opt.load_state_dict(torch_opt.state_dict())
    for p in params2:
        assert opt.state[p]["exp_avg"].dtype == torch.float32
    set_grads(params2, 1)
    opt.step()
    for p in params2:
        assert opt.state[p]["master_param"].dtype == torch.float32
        assert_rounded_from(p.detach(), opt.state[p]["master_param"], interpreted=backend == "triton")


# ---- GradScaler --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("clip", [False, True], ids=["scaled", "unscale_then_clip"])
def test_grad_scaler_skips_overflow_and_matches_reference(backend: str, name: str, clip: bool) -> None:
    model, opt, ref_model, ref_opt = make_pair(name, backend, **DEFAULTS[name])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for i in range(6):
        before = snapshot(model, opt)
        for m, o, s in ((model, opt, scaler), (ref_model, ref_opt, ref_scaler)):
            o.zero_grad()
            s.scale(loss_fn(m, i)).backward()
            if i == 3:
                m[0].weight.grad[0, 0] = float("inf")
            if clip:  # the UNSCALED path: the scaler hands the optimizer no grad_scale
                s.unscale_(o)
                nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            s.step(o)
            s.update()
        if i == 3:  # skipped: params and state untouched, scale backed off
            for x, y in zip(before, snapshot(model, opt), strict=True):
                assert torch.equal(x, y)
            assert scaler.get_scale() == 2.0**9
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert_params_close(model, ref_model, **FP32)


# ---- LR schedulers, tensor lr, param groups, grads that are None ---------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_lr_scheduler_drives_the_lr(backend: str, name: str) -> None:
    model, opt, ref_model, ref_opt = make_pair(name, backend, **DEFAULTS[name])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.1)
    train(model, opt, 6, sched=sched)
    train(ref_model, ref_opt, 6, sched=ref_sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(DEFAULTS[name]["lr"] * 1e-3)
    assert_params_close(model, ref_model, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scheduled_lr_is_the_one_applied(backend: str) -> None:
    p = nn.Parameter(torch.zeros(5))
    opt = FusedSGD([p], lr=1.0, backend=backend)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
    for lr in (1.0, 0.25, 0.0625):
        before = p.detach().clone()
        p.grad = torch.ones(5)
        opt.step()
        sched.step()
        assert torch.equal(before - p.detach(), torch.full((5,), lr))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_tensor_lr(backend: str, name: str) -> None:
    kw = DEFAULTS[name]
    fused_cls, ref_cls = PAIRS[name]
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = fused_cls(model.parameters(), backend=backend, **dict(kw, lr=torch.tensor(kw["lr"])))
    ref_opt = ref_cls(ref_model.parameters(), **kw)
    train(model, opt, 5)
    train(ref_model, ref_opt, 5)
    assert_params_close(model, ref_model, **FP32)


#: a second group's hyper-parameters that differ from DEFAULTS in more than the lr
OTHER_GROUP = {
    "adam": dict(lr=3e-2, betas=(0.5, 0.9), amsgrad=False),
    "adamw": dict(lr=3e-2, weight_decay=0.5, eps=1e-4),
    "sgd": dict(lr=0.01, momentum=0.5, nesterov=False, dampening=0.5),
    "lion": dict(lr=3e-3, betas=(0.5, 0.9), weight_decay=0.0),
    "lamb": dict(lr=3e-2, weight_decay=0.0, always_adapt=True, max_trust_ratio=0.1),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_add_param_group_with_its_own_hyperparameters(backend: str, name: str) -> None:
    fused_cls, ref_cls = PAIRS[name]
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = fused_cls(model[0].parameters(), backend=backend, **DEFAULTS[name])
    ref_opt = ref_cls(ref_model[0].parameters(), **DEFAULTS[name])
    train(model, opt, 2)  # model[2] gets grads but is in no group yet: untouched
    train(ref_model, ref_opt, 2)
    assert torch.equal(model[2].weight, make_model()[2].weight)
    opt.add_param_group({"params": list(model[2].parameters()), **OTHER_GROUP[name]})
    ref_opt.add_param_group({"params": list(ref_model[2].parameters()), **OTHER_GROUP[name]})
    train(model, opt, 4, start=2)
    train(ref_model, ref_opt, 4, start=2)
    assert_params_close(model, ref_model, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_params_without_grad_are_skipped(backend: str, name: str) -> None:
    model, opt, ref_model, ref_opt = make_pair(name, backend, **DEFAULTS[name])
    frozen, ref_frozen = model[2].weight, ref_model[2].weight
    initial = frozen.detach().clone()
    for i in range(5):
        for m, o, f in ((model, opt, frozen), (ref_model, ref_opt, ref_frozen)):
            o.zero_grad()
            loss_fn(m, i).backward()
            if i < 2:
                f.grad = None  # frozen for two steps: later its state lags the others' (own launch group)
            o.step()
        if i < 2:
            assert torch.equal(frozen, initial)
            assert not opt.state[frozen]
    assert_params_close(model, ref_model, **FP32)


@pytest.mark.parametrize("name", NAMES)
def test_zero_grad(name: str) -> None:
    model, opt, *_ = make_pair(name, "torch", **DEFAULTS[name])
    loss_fn(model, 0).backward()
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # no grads: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_tensor_above_the_interpreter_block(backend: str, name: str) -> None:
    """One tensor of 2^16 + 17 elements: several programs per tensor (LAMB: atomics)."""
    fused_cls, ref_cls = PAIRS[name]
    p = nn.Parameter(torch.randn(65536 + 17, generator=torch.Generator().manual_seed(0)))
    r = nn.Parameter(p.detach().clone())
    opt, ref_opt = fused_cls([p], backend=backend, **DEFAULTS[name]), ref_cls([r], **DEFAULTS[name])
    for step in range(2):
        set_grads([p], step)
        r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert_close(p.detach(), r.detach(), **FP32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master"])
def test_cuda_compiled_kernels_match_torch_path(name: str, dtype: torch.dtype) -> None:
    """Compiled kernels: aligned and unaligned sizes, many programs per tensor, GPU atomics."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dtype) for s in [(1,), (4095,), (3072,), (10, 7), (1 << 16,)]]
    runs = {}
    for backend in BACKENDS:
        params = [nn.Parameter(t.cuda()) for t in init]
        opt = PAIRS[name][0](params, master_weights=True, backend=backend, **DEFAULTS[name])
        for step in range(3):
            set_grads(params, step)
            with count_launches() as launches:
                opt.step()
        assert dict(launches) == ({k: 1 for k in KERNELS[name]} if backend == "triton" else {})
        runs[backend] = (params, opt)
    (tri, tri_opt), (tor, tor_opt) = runs["triton"], runs["torch"]
    for p, q in zip(tri, tor):
        for key, value in tri_opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                assert_close(value, tor_opt.state[q][key], **FP32)
        if dtype == torch.float32:
            assert_close(p.detach(), q.detach(), **FP32)
        else:  # each param is its own master rounded once; the masters agree to FP32
            master = tri_opt.state[p]["master_param"]
            assert_rounded_from(p.detach(), master, interpreted=False)
            assert_close(q.detach().float(), master, **rounded_param(dtype))


# ---- validation ------------------------------------------------------------------------------
BAD_ARGS = (
    [
        (FusedSGD, dict(lr=-0.1), ValueError, "lr"),
        (FusedSGD, dict(lr=torch.tensor([0.1, 0.2])), ValueError, "lr"),
        (FusedSGD, dict(momentum=-0.5), ValueError, "momentum"),
        (FusedSGD, dict(weight_decay=-1.0), ValueError, "weight_decay"),
        (FusedSGD, dict(nesterov=True), ValueError, "nesterov"),
        (FusedSGD, dict(momentum=0.9, dampening=0.1, nesterov=True), ValueError, "nesterov"),
        (FusedSGD, dict(differentiable=True), ValueError, "differentiable"),
        (FusedAdam, dict(lr=-1e-3), ValueError, "lr"),
        (FusedAdam, dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
        (FusedAdam, dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
        (FusedAdam, dict(eps=-1e-8), ValueError, "eps"),
        (FusedAdamW, dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (FusedAdamW, dict(lr=float("nan")), ValueError, "lr"),
        (FusedLion, dict(lr=-1e-4), ValueError, "lr"),
        (FusedLion, dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\]"),
        (FusedLion, dict(weight_decay=-1.0), ValueError, "weight_decay"),
        (FusedLAMB, dict(eps=-1.0), ValueError, "eps"),
        (FusedLAMB, dict(betas=(-0.1, 0.9)), ValueError, r"betas\[0\]"),
        (FusedLAMB, dict(weight_norm_clip=(1.0, 0.5)), ValueError, "weight_norm_clip"),
        (FusedLAMB, dict(weight_norm_clip=(-1.0, 1.0)), ValueError, "weight_norm_clip"),
        (FusedLAMB, dict(weight_norm_clip=1.0), ValueError, "weight_norm_clip"),
        (FusedLAMB, dict(max_trust_ratio=0.0), ValueError, "max_trust_ratio"),
    ]
    + [(cls, dict(backend="cuda"), ValueError, "backend") for cls, _ in PAIRS.values()]
    + [(cls, dict(master_weights="yes"), TypeError, "master_weights") for cls, _ in PAIRS.values()]
)


@pytest.mark.parametrize("cls, kw, exc, match", BAD_ARGS, ids=[f"{c.__name__}-{list(k)[0]}" for c, k, _, _ in BAD_ARGS])
def test_bad_arguments_are_named(cls: type, kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        cls([nn.Parameter(torch.zeros(3))], **kw)


@pytest.mark.parametrize("name", NAMES)
def test_bad_param_groups_and_params(name: str) -> None:
    cls = PAIRS[name][0]
    with pytest.raises(TypeError, match="complex"):
        cls([nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="dtype"):
        cls([torch.zeros(3, dtype=torch.float64, requires_grad=True)])
    opt = cls([nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": -1.0})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_bad_grads_and_layouts_at_step(backend: str, name: str) -> None:
    cls = PAIRS[name][0]
    p = nn.Parameter(torch.zeros(4, 3))
    p.grad = torch.eye(4, 3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        cls([p], backend=backend).step()
    q = nn.Parameter(torch.zeros(4, 6)[:, ::2])  # strided view: not dense (a permutation would be)
    q.grad = torch.ones(4, 3)
    with pytest.raises(ValueError, match="dense"):
        cls([q], backend=backend).step()
