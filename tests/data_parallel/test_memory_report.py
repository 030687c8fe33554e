"""The replicated memory report against bytes written out by hand: each storage once, masters apart."""

from __future__ import annotations

import torch
from torch import nn

from shardkit.kernels import FusedAdamW
from shardkit.parallel.memory_report import replicated_memory_report, storage_bytes
from shardkit.parallel.strategy import report_memory


def test_views_of_one_bucket_count_once_and_masters_are_their_own_category() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 4).to(torch.bfloat16)  # 32 + 4 bf16 params: 72 bytes
    bucket = torch.zeros(40, dtype=torch.bfloat16)  # grads live in a flat bucket, as in DataParallel
    layer.weight.grad = bucket[:32].view(4, 8)
    layer.bias.grad = bucket[32:36]
    opt = FusedAdamW(layer.parameters(), lr=1e-3, master_weights=True, backend="torch")
    opt.step()
    mem = replicated_memory_report(layer.parameters(), opt, grad_buffers=[bucket])
    assert mem["params"] == 36 * 2
    assert mem["grads"] == 40 * 2  # the bucket once, its padding included; the grads are views of it
    assert mem["master_params"] == 36 * 4  # fp32 masters
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert mem["optimizer_state"] == sum(m.numel() * m.element_size() for m in moments) + storage_bytes(
        s["step"] for s in opt.state.values()
    )
    assert mem["model_state"] == mem["params"] + mem["grads"] + mem["master_params"] + mem["optimizer_state"]
    assert report_memory(mem) == {
        "params": 72,
        "grads": 80,
        "optimizer_state": mem["optimizer_state"] + 36 * 4,
    }


def test_no_optimizer_and_no_grads() -> None:
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))]
    mem = replicated_memory_report(params)
    assert (mem["params"], mem["grads"], mem["master_params"], mem["optimizer_state"]) == (12 + 32, 0, 0, 0)
    assert storage_bytes([params[0][:1], params[0], None, "not a tensor"]) == 12
