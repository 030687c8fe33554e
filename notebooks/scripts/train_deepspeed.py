"""Run by notebooks/06_from_deepspeed.ipynb (shown there in full); on its own: torchrun --nproc-per-node 2 notebooks/scripts/train_deepspeed.py ds_config.json OUT.json"""

import json, sys
import torch, transformers
from deepspeed import initialize

torch.distributed.init_process_group("gloo")  # CPU processes; on GPUs leave this to the engine
config = json.load(open(sys.argv[1]))
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(
    transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=32,
        vocab_size=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
)
engine, optimizer, _, scheduler = initialize(model=model, model_parameters=model.parameters(), config=config)
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
g = torch.Generator().manual_seed(1)
losses, lrs = [], []
for step in range(8):
    x = torch.randint(128, (4 * world, 32), generator=g)[4 * rank : 4 * (rank + 1)]  # this rank's rows
    loss = engine(input_ids=x, labels=x).loss  # the model's own labels= loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    lrs.append(engine.get_lr()[0])
if rank == 0:
    json.dump({"loss": losses, "lr": lrs}, open(sys.argv[2], "w"))
