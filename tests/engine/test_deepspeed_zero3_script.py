"""A ZeRO-3 fine-tuning script in the style of DeepSpeed-Chat's SFT step runs under shardkit with
only the import line changed, and trains and exports like DeepSpeed 0.19.8 itself.

The script builds its model under ``zero.Init``, re-initializes the head on rank 0 inside
``zero.GatheredParameters(modifier_rank=0)`` (every rank must train rank 0's values), trains with
``initialize``'s engine at ZeRO-3, reads the head's full weights in a read-only
``GatheredParameters`` block, saves a checkpoint and exports it with
``deepspeed.utils.zero_to_fp32`` (the function DeepSpeed's ``zero_to_fp32.py`` runs). It also
reads the engine's ``tput_timer``, ``monitor`` and ``_zero3_consolidated_16bit_state_dict()``.
The two runs must agree: per-step losses, the head's norm and every exported tensor's sum to fp32
accuracy.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from deepspeed_scripts import run_script, with_shardkit

SCRIPT = """\
import argparse, json, os
import torch
import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--ckpt", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
ds_config = json.load(open(args.deepspeed_config))

with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32)
    )
with deepspeed.zero.GatheredParameters(list(model[3].parameters()), modifier_rank=0):
    if rank == 0:  # a fresh head, as SFT scripts re-initialize it; the others must get it
        torch.manual_seed(5)
        model[3].weight.data.normal_(std=0.05)
        model[3].bias.data.zero_()

engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
g = torch.Generator().manual_seed(1 + rank)
losses = []
for step in range(5):
    tokens = torch.randint(0, 32, (4, 6), generator=g)
    logits = engine(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    deepspeed.comm.all_reduce(mean)
    losses.append(mean.item() / world)
    if engine.monitor.enabled:
        engine.monitor.write_events([("Train/loss", losses[-1], engine.global_samples)])

with deepspeed.zero.GatheredParameters(list(engine.module[3].parameters())):
    head_norm = engine.module[3].weight.double().norm().item()
consolidated = engine._zero3_consolidated_16bit_state_dict()
engine.save_checkpoint(args.ckpt)
deepspeed.comm.barrier()
facts = {
    "losses": losses,
    "head_norm": head_norm,
    "samples_per_sec": engine.tput_timer.avg_samples_per_sec(),
    "consolidated": sorted(consolidated) if rank == 0 else None,
    "recovery_script": os.path.isfile(os.path.join(args.ckpt, "zero_to_fp32.py")),
}
if rank == 0:
    state = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(args.ckpt)
    facts["exported"] = {k: [str(v.dtype), v.double().sum().item()] for k, v in state.items()}
    json.dump(facts, open(args.out, "w"))
"""

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.0, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_zero3_fine_tuning_script_runs_and_exports_like_deepspeed(tmp_path: Path) -> None:
    ours = run_script(with_shardkit(SCRIPT), tmp_path, "shardkit_sft", CONFIG, ["--ckpt", str(tmp_path / "ours")])
    assert len(ours["losses"]) == 5 and ours["losses"][-1] < ours["losses"][0]
    assert ours["samples_per_sec"] > 0 and ours["recovery_script"]
    names = ["0.weight", "1.bias", "1.weight", "3.bias", "3.weight"]
    assert ours["consolidated"] == names
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (the bench extra): the differential half needs it")
    theirs = run_script(SCRIPT, tmp_path, "deepspeed_sft", CONFIG, ["--ckpt", str(tmp_path / "theirs")])
    assert theirs["recovery_script"] and theirs["consolidated"] == names
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-7)
    assert ours["head_norm"] == pytest.approx(theirs["head_norm"], rel=1e-5)
    assert ours["exported"].keys() == theirs["exported"].keys()
    for name, (dtype, total) in theirs["exported"].items():
        assert ours["exported"][name][0] == dtype, name
        assert ours["exported"][name][1] == pytest.approx(total, rel=1e-5, abs=1e-5), name
