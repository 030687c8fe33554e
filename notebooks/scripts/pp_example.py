"""Run by notebooks/05_pipeline.ipynb (shown there in full); on its own: torchrun --nproc-per-node 2 notebooks/scripts/pp_example.py OUT.json"""

import json, sys, torch
from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT, gpt_blocks
from shardkit.parallel import parallelize

ctx = ParallelContext.from_env(backend="gloo", pp=2)  # 2 processes: two pipeline stages
runs = {}
for schedule in sys.argv[2:]:  # each schedule from the same init
    torch.manual_seed(0)
    model = TinyGPT(59, d_model=32, n_layers=4, n_heads=4, seq_len=16, tie_embeddings=False)
    par = parallelize(model, ctx, pp={"schedule": schedule, "microbatches": 4}, blocks=gpt_blocks)
    opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    losses = []
    for step in range(5):
        x, y = torch.randint(59, (8, 16), generator=gen), torch.randint(59, (8, 16), generator=gen)
        opt.zero_grad(set_to_none=True)
        losses.append(float(par.forward_backward(x, y)))  # every micro-batch through both stages
        par.clip(0.3)  # global norm: both stages' grads
        par.step(opt)
    runs[schedule] = {"losses": losses, "stage_blocks": [list(r) for r in par.pipeline.stage_blocks]}
    par.close()
if ctx.rank("pp") == 0:
    json.dump(runs, open(sys.argv[1], "w"))
ctx.destroy()  # with the default group from_env created: gloo's threads joined before exit
