"""Run by notebooks/02_data_parallel.ipynb (shown there in full); on its own: torchrun --nproc-per-node 2 notebooks/scripts/ddp_example.py OUT.json"""

import json, sys, torch
from torch import nn
from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel import DataParallel

# the model stays on CPU, so gloo explicitly: on a GPU machine the default would be NCCL
ctx = ParallelContext.from_env(backend="gloo")  # reads torchrun's environment
rank, world = ctx.rank("dp"), ctx.size("dp")
torch.manual_seed(0)
model = DataParallel(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)), ctx, bucket_mb=0.01)
opt = FusedAdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)  # the global batch
mine = slice(rank * 64 // world, (rank + 1) * 64 // world)  # this rank's rows
for step in range(20):
    opt.zero_grad()
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    opt.step()
if rank == 0:
    out = dict(
        params=[p.detach().flatten().tolist() for p in model.parameters()],
        buckets=model.bucket_bytes,
        comm=model.comm_stats.summary(),
    )
    json.dump(out, open(sys.argv[1], "w"))
ctx.destroy()
