"""Run by notebooks/07_context_parallel.ipynb (shown there in full); on its own:
torchrun --nproc-per-node 2 notebooks/scripts/cp_example.py OUT.json SEQ_LEN"""

import json, sys, torch
import torch.distributed as dist
import torch.nn.functional as F
from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT
from shardkit.parallel import parallelize
from shardkit.parallel.profiled_peak import profiled_peak_bytes as peak_bytes
from shardkit.parallel.context import context_parallel_attention, gather_sequence, gpt_cp_plan, shard_sequence

out_path, seq_len = sys.argv[1], int(sys.argv[2])
ctx = ParallelContext.from_env(backend="gloo", cp=2)  # 2 processes, both on the cp axis
rank = ctx.rank("cp")
out = {"seq_len": seq_len}


# 1. Attention over the shards equals attention over the whole sequence.
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, 64, 16, generator=g) for _ in range(3))
full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
for mode in ("ring", "ulysses"):
    part = context_parallel_attention(*(shard_sequence(t, ctx, dim=2) for t in (q, k, v)), ctx=ctx, mode=mode)
    out[f"{mode}_max_diff"] = float((gather_sequence(part, ctx, dim=2) - full).abs().max())


# 2. One training step of a long sequence: per-rank peak memory without cp (this rank runs the whole
#    sequence alone) and with cp = 2 (each rank holds half of it).
def model():
    torch.manual_seed(0)
    return TinyGPT(59, d_model=64, n_layers=2, n_heads=4, seq_len=seq_len)


x, y = torch.randint(59, (1, seq_len), generator=g), torch.randint(59, (1, seq_len), generator=g)
alone = model()  # cp = 1: the plain model, one rank holds the whole sequence


def step_alone():
    F.cross_entropy(alone(x).flatten(0, 1), y.flatten()).backward()


out["peak_cp1"] = peak_bytes(step_alone)
par = parallelize(model(), ctx, dp="ddp", cp={"plan": gpt_cp_plan(), "mode": "ring"})
out["peak_cp2"] = peak_bytes(lambda: par.forward_backward(x, y))

# 3. Train a few steps with cp = 2 and compare with the single-process model on the same sequences.
torch.manual_seed(0)
opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.1)
ref = model()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
out["losses"], out["ref_losses"] = [], []
for step in range(3):
    x, y = torch.randint(59, (1, seq_len), generator=g), torch.randint(59, (1, seq_len), generator=g)
    opt.zero_grad(set_to_none=True)
    out["losses"].append(float(par.forward_backward(x, y)))
    par.step(opt)
    ref_opt.zero_grad()
    loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    loss.backward()
    ref_opt.step()
    out["ref_losses"].append(float(loss.detach()))
out["comm"] = par.report().comm

if rank == 0:
    with open(out_path, "w") as f:
        json.dump(out, f)
dist.barrier()
ctx.destroy()
