"""Kernel-time breakdown of the fused loss vs linear + vocab_parallel_cross_entropy at one shape.

python perf/cuda/fused_ce_profile.py 4096 262144 4096 [chunk_tokens]
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from shardkit.comm import ParallelContext
from shardkit.parallel.tensor import fused_linear_cross_entropy, vocab_parallel_cross_entropy


def main() -> None:
    T, V, d = (int(x) for x in sys.argv[1:4])
    chunk = int(sys.argv[4]) if len(sys.argv) > 4 else None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    dev = torch.device("cuda")
    h = torch.randn(T, d, device=dev).bfloat16().requires_grad_()
    w = (torch.randn(V, d, device=dev) / d**0.5).bfloat16().requires_grad_()
    t = torch.randint(V, (T,), device=dev)
    with ParallelContext.from_world(tp=1) as ctx:
        fns = {
            "fused": lambda: fused_linear_cross_entropy(h, w, t, chunk_tokens=chunk),
            "vp": lambda: vocab_parallel_cross_entropy(F.linear(h, w), t, ctx=ctx, vocab_size=V),
        }
        for name, fn in fns.items():
            for _ in range(3):
                h.grad = w.grad = None
                fn().backward()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
                for _ in range(5):
                    h.grad = w.grad = None
                    fn().backward()
                torch.cuda.synchronize()
            print("=====", name)
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
