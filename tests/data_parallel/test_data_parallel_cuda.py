"""DataParallel over NCCL on 2 GPUs vs a single-process reference (``make test-gpu``).

The gloo tests (tests/data_parallel/test_data_parallel_trains_like_one_process.py) run the CPU path; this one runs what production
runs: NCCL, CUDA tensors, the compiled Triton flatten/copy-back kernels, the fused fp16 unscale,
and the training loop's strategy interface. Skipped cleanly with fewer than 2 GPUs.

Each rank trains on its half of a global batch; inside the same rank, the same steps on the
whole batch in one process (no communication) are the reference, so every rank asserts.
"""

from __future__ import annotations

import hashlib
import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tolerances import FP32

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

WORLD = 2
STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    # odd sizes on purpose: slots that are not multiples of 16 elements, a bias of 1000
    return nn.Sequential(nn.Linear(33, 1000), nn.GELU(), nn.Linear(1000, 7)).to(device)


def _worker(rank: int, port: int, grad_buckets: str, fp16: bool, queue: mp.SimpleQueue) -> None:
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank)
        )
        from shardkit.comm import ParallelContext
        from shardkit.parallel import DynamicLossScaler
        from shardkit.parallel.strategy import make_strategy

        ctx = ParallelContext.from_env(backend="nccl")  # sets cuda:LOCAL_RANK
        device = torch.device("cuda", rank)

        def run(name: str, rows: slice) -> tuple[nn.Module, list[bool], float | None]:
            scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1) if fp16 else None
            options = {"grad_buckets": grad_buckets, "bucket_mb": 0.05} if name == "ddp" else {}
            strategy = make_strategy(name, ctx=ctx if name == "ddp" else None, loss_scaler=scaler, **options)
            model = strategy.wrap(_model(device))
            # SGD: linear in the gradient, so fp32 summation-order differences stay at rounding
            # level (Adam's g / sqrt(v) amplifies them wherever a gradient is near zero)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            stepped = []
            for step in range(STEPS):
                g = torch.Generator(device=device).manual_seed(step)
                x = torch.randn(8 * WORLD, 33, device=device, generator=g)
                y = torch.randn(8 * WORLD, 7, device=device, generator=g)
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x[rows]), y[rows])
                if fp16 and step == 1 and (name == "none" or rank == WORLD - 1):
                    loss = loss * float("inf")  # one rank overflows: every rank must skip
                strategy.backward(loss)
                strategy.clip(1.0)
                stepped.append(strategy.step(opt))
            return model, stepped, strategy.report(opt).loss_scale

        ddp, ddp_stepped, ddp_scale = run("ddp", slice(8 * rank, 8 * rank + 8))
        ref, ref_stepped, ref_scale = run("none", slice(None))
        assert ddp_stepped == ref_stepped and ddp_scale == ref_scale
        for p, r in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p, r, **FP32)
        # a digest, not tensors: small enough for the pipe while the parent is still joining
        flat = torch.cat([p.detach().flatten() for p in ddp.parameters()]).cpu().numpy()
        queue.put((rank, None, hashlib.sha256(flat.tobytes()).hexdigest()))
        ctx.destroy()  # from_env created the default group: destroyed with it
    except BaseException:  # reported to the test process, which fails with this traceback
        queue.put((rank, traceback.format_exc(), None))


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scaler"])
@pytest.mark.parametrize("grad_buckets", ["copy", "view"])
def test_nccl_data_parallel_matches_single_process(grad_buckets: str, fp16: bool) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, grad_buckets, fp16, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)  # a hang fails the test instead of the run
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} did not finish in 240 s"
    results = {}
    while not queue.empty():
        rank, error, digest = queue.get()
        assert error is None, f"rank {rank} failed:\n{error}"
        results[rank] = digest
    assert sorted(results) == list(range(WORLD))
    assert results[0] == results[1]  # replicas bitwise identical
