"""Run by notebooks/03_zero.ipynb (shown there in full); on its own: torchrun --nproc-per-node 2 notebooks/scripts/zero_example.py OUT.json"""

import json, sys, torch
from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.models import TinyGPT, lm_loss
from shardkit.parallel import ShardedDataParallel, ZeroOptimizer
from shardkit.parallel.zero import plan_memory

ctx = ParallelContext.from_env(backend="gloo")  # 2 processes: dp = 2
runs = {}
for name, stage, offload in [("ZeRO-1", 1, None), ("ZeRO-2", 2, None), ("ZeRO-3", 3, None), ("ZeRO-3 + cpu offload", 3, "cpu")]:
    torch.manual_seed(0)
    model = TinyGPT(59, d_model=64, n_layers=4, n_heads=4, seq_len=32)
    plan = plan_memory(model, dp=2, stage=stage, offload=offload)  # before wrapping: the user's model
    sdp = ShardedDataParallel(model, ctx, stage=stage, offload=offload)
    opt = ZeroOptimizer(sdp, FusedAdamW, lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randint(59, (4, 32), generator=gen), torch.randint(59, (4, 32), generator=gen)
        loss = lm_loss(sdp(x), y)
        loss.backward()
        sdp.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    runs[name] = {
        "measured": sdp.memory_report(),
        "planned": plan.memory_report(),
        "loss": float(loss),
        "params": sum(p.numel() for p in model.parameters()),
    }
if ctx.rank("dp") == 0:
    json.dump(runs, open(sys.argv[1], "w"))
ctx.destroy()  # with the default group from_env created: gloo's threads joined before exit
