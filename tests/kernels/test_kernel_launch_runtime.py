"""Kernel runtime: device helpers under both executors, the launch device, fixed-order LAMB norms."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from shardkit.kernels import runtime
from shardkit.kernels.adam import adam_step
from shardkit.kernels.aot import compile_config, kernel_resources
from shardkit.kernels.lamb import _launch_moments, lamb_launch_config, lamb_reduce_block
from shardkit.kernels.runtime import count_launches, triton_helper, triton_kernel


@triton_helper
def _leaky(x, slope: tl.constexpr):
    return tl.where(x >= 0, x, slope * x)


@triton_helper
def _leaky_sum(x):
    return tl.sum(_leaky(x, 0.5), 0)  # a helper calling a helper and Triton's own @jit tl.sum


def _helper_kernel(x_ptr, y_ptr, total_ptr, n: tl.int32, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, _leaky(x, 0.5), mask=offs < n)
    tl.store(total_ptr, _leaky_sum(x))


_HELPER = triton_kernel(_helper_kernel)


def test_interpreted_kernel_calls_helpers_and_tl_sum() -> None:
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    y, total = torch.empty_like(x), torch.empty(1)
    with count_launches() as launches:
        _HELPER[(1,)](x, y, total, x.numel(), BLOCK=128)
    expected = torch.where(x >= 0, x, 0.5 * x)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    torch.testing.assert_close(total, expected.sum().reshape(1), rtol=1e-6, atol=1e-6)
    assert launches["_helper_kernel"] == 1
    # the swap of tl.sum for its interpreted form lasts for the launch only
    assert isinstance(tl.sum, JITFunction)
    # the module's own globals still name the helper objects (each executor bound a copy)
    assert isinstance(globals()["_leaky"], runtime.TritonHelper)


def test_compiled_kernel_inlines_helpers() -> None:
    cfg = dict(
        kernel=_HELPER,
        name="helper",
        constexprs={"BLOCK": 1024},
        num_warps=4,
        elements_per_program=1024,
        pointers={"x_ptr": "*fp32", "y_ptr": "*fp32", "total_ptr": "*fp32"},
        bytes_per_element=8,
    )
    res = kernel_resources(compile_config(cfg, 90), cfg)
    assert res["global_stores"]  # compiled, with both helpers and tl.sum resolved to JITFunctions
    bound = _HELPER.jit.fn.__globals__
    assert isinstance(bound["_leaky"], JITFunction) and isinstance(bound["_leaky_sum"], JITFunction)


def test_helper_refuses_host_calls() -> None:
    with pytest.raises(TypeError, match="device helper"):
        _leaky(torch.zeros(1), 0.5)


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor reporting ``cuda:1``, to drive the CUDA launch path on a machine without one."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 1)


def test_cuda_launch_runs_under_the_tensors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: launch device]: a launch on cuda:1 tensors enters torch.cuda.device(cuda:1).

    Triton launches on torch's current device and stream; the pointer tables live on the tensors'
    device. Before the fix the launch entered no device context (launched on cuda:0).
    """
    current: list[torch.device | None] = [None]
    seen: list[torch.device | None] = []

    @contextlib.contextmanager
    def fake_device(device: torch.device):
        previous, current[0] = current[0], torch.device(device)
        try:
            yield
        finally:
            current[0] = previous

    class FakeJIT:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(current[0])

    kernel = triton_kernel(_helper_kernel)
    kernel.__dict__["jit"] = FakeJIT()  # the cached compiled executor, replaced
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    x = torch.zeros(4).as_subclass(_FakeCudaTensor)
    assert x.device == torch.device("cuda", 1)
    kernel[(1,)](x, x, x, 4, BLOCK=4)
    assert seen == [torch.device("cuda", 1)]
    assert current[0] is None  # and left it


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_adam_on_second_gpu_matches_torch_backend() -> None:
    device = torch.device("cuda", 1)
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(n, device=device, generator=gen) for n in (1000, 4096, 50257)]
    grads = [torch.randn_like(p) for p in params]
    out = {}
    for backend in ("triton", "torch"):
        ps = [p.clone() for p in params]
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        with torch.cuda.device(0):  # the current device is NOT the tensors' device
            adam_step(
                ps,
                grads,
                ms,
                vs,
                [],
                [],
                step=1,
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                decoupled=True,
                amsgrad=False,
                maximize=False,
                backend=backend,
            )
        torch.cuda.synchronize(device)
        out[backend] = ps
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _fixed_order_norms(ws: list[np.ndarray], block: int, rblock: int) -> np.ndarray:
    """The kernel's reduction order, in numpy: per-chunk fp32 sums of BLOCK lanes (tail lanes 0),
    strided into RBLOCK lanes in chunk order, then one sum of the lanes."""
    out = []
    for w in ws:
        n_chunks = -(-w.size // block)
        padded = np.zeros(n_chunks * block, np.float32)
        padded[: w.size] = w
        partials = np.sum(padded.reshape(n_chunks, block) * padded.reshape(n_chunks, block), axis=1)
        lanes = np.zeros(rblock, np.float32)
        for i in range(0, n_chunks, rblock):
            chunk = np.zeros(rblock, np.float32)
            chunk[: min(rblock, n_chunks - i)] = partials[i : i + rblock]
            lanes = lanes + chunk
        out.append(np.sum(lanes))
    return np.array(out, np.float32)


def test_lamb_norms_are_reduced_in_fixed_order() -> None:
    """Per-tensor ||w||^2 equals the fixed-order reference bit for bit, and repeats exactly.

    Tensors of several chunks (the interpreter's BLOCK is 2^16) and more chunks than RBLOCK lanes
    exercise the strided lane loop.
    """
    gen = torch.Generator().manual_seed(0)
    sizes = [700_001, 70_000, 1]
    block, _ = lamb_launch_config(torch.device("cpu"), max(sizes))
    rblock = lamb_reduce_block(torch.device("cpu"))
    assert -(-sizes[0] // block) > rblock
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    results = []
    for _ in range(2):
        ps = [p.clone() for p in params]
        _, _, _, norms = _launch_moments(
            ps,
            grads,
            [torch.zeros_like(p) for p in ps],
            [torch.zeros_like(p) for p in ps],
            [],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.01,
            bc1=0.1,
            bc2_sqrt=0.001**0.5,
            adapt=True,
            maximize=False,
            grad_scale=None,
        )
        results.append(norms)
    w_sq = results[0][0::2].numpy()
    expected = _fixed_order_norms([p.numpy() for p in params], block, rblock)
    assert w_sq.view(np.int32).tolist() == expected.view(np.int32).tolist()
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))
    # and they are the norms (a wrong chunk grouping would fail this, whatever the order)
    ref = torch.stack([p.double().square().sum() for p in params]).float()
    torch.testing.assert_close(results[0][0::2], ref, rtol=1e-5, atol=0)


def test_pointer_table_is_reused_while_storage_stays_and_rebuilt_when_it_moves() -> None:
    """The launch table's device copy of the data pointers is built once per set of addresses
    (optimizer state and bucketed grads keep theirs from step to step) and holds the addresses of
    the tensors passed now whenever any of them moved (a grad re-allocated by zero_grad)."""
    params = [torch.randn(5), torch.randn(1030)]
    grads = [torch.randn(5), torch.randn(1030)]
    first = runtime.multi_tensor_table([params, grads], 1024)
    again = runtime.multi_tensor_table([params, grads], 1024)
    assert again.ptrs is first.ptrs
    moved = [grads[0], torch.randn(1030)]
    table = runtime.multi_tensor_table([params, moved], 1024)
    assert table.ptrs is not first.ptrs
    assert table.ptrs.tolist() == [[t.data_ptr() for t in params], [t.data_ptr() for t in moved]]
    assert table.aligned == all(t.data_ptr() % 16 == 0 for t in params + moved)
