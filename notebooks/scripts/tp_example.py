"""Run by notebooks/04_tensor_parallel.ipynb (shown there in full); on its own: torchrun --nproc-per-node 2 notebooks/scripts/tp_example.py OUT.json"""

import json, sys, torch
import torch.nn.functional as F
from torch import nn
from shardkit.comm import CommStats, ParallelContext
from shardkit.models import TinyGPT
from shardkit.parallel import ColumnParallelLinear, RowParallelLinear, parallelize
from shardkit.parallel.tensor import gpt_plan, vocab_parallel_cross_entropy

ctx = ParallelContext.from_env(backend="gloo", tp=2)  # 2 processes, both on the tp axis
rank, tp = ctx.rank("tp"), ctx.size("tp")
out = {}

# 1. A Megatron MLP: column-parallel up-projection, row-parallel down-projection.
torch.manual_seed(0)
up, down = nn.Linear(16, 64), nn.Linear(64, 16)  # the dense layers, same on every rank
stats = CommStats()
col = ColumnParallelLinear(16, 64, ctx=ctx, stats=stats)
row = RowParallelLinear(64, 16, ctx=ctx, stats=stats)
with torch.no_grad():  # rank r keeps the r-th slice
    col.weight.copy_(up.weight.chunk(tp, 0)[rank])
    col.bias.copy_(up.bias.chunk(tp, 0)[rank])
    row.weight.copy_(down.weight.chunk(tp, 1)[rank])
    row.bias.copy_(down.bias)
x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
out["mlp_max_diff"] = float((row(F.gelu(col(x))) - down(F.gelu(up(x)))).abs().max())
out["mlp_comm"] = stats.summary()

# 2. The vocab-parallel cross-entropy on this rank's logits shard vs F.cross_entropy on the full logits.
logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(2))
target = torch.randint(100, (32,), generator=torch.Generator().manual_seed(3))
shard = logits.chunk(tp, -1)[rank]
out["ce"] = [
    float(vocab_parallel_cross_entropy(shard, target, ctx=ctx, label_smoothing=0.1)),
    float(F.cross_entropy(logits, target, label_smoothing=0.1)),
]

# 3. TinyGPT through parallelize: the TP plan, the vocab-parallel loss, the global-norm clip.
torch.manual_seed(0)
model = TinyGPT(59, d_model=32, n_layers=2, n_heads=4, seq_len=16)
par = parallelize(model, ctx, tp_plan=gpt_plan())
opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3, momentum=0.9)
gen = torch.Generator().manual_seed(3)
losses = []
for step in range(5):
    x, y = torch.randint(59, (8, 16), generator=gen), torch.randint(59, (8, 16), generator=gen)
    opt.zero_grad(set_to_none=True)
    losses.append(float(par.forward_backward(x, y)))
    par.clip(0.3)
    par.step(opt)
out["losses"] = losses
out["params_per_rank"] = sum(p.numel() for p in par.parameters())
if rank == 0:
    json.dump(out, open(sys.argv[1], "w"))
ctx.destroy()  # with the default group from_env created: gloo's threads joined before exit
