"""ZeRO++'s hpZ (``zero_optimization.zero_hpz_partition_size``) in a DeepSpeed script: the same
script under DeepSpeed 0.19.8 and under shardkit (only the import line changed) trains the same
losses on 4 ranks with blocks of 2, and each library really keeps secondary partitions (DeepSpeed:
every parameter has a ``ds_secondary_tensor`` after a forward; shardkit: the engine reports the
block size, and its backward gathers go to the block groups, as tests/zero/test_zero3_hierarchical_gathers.py
checks in detail). hpZ gathers the same values, so each run also equals its library without it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from deepspeed_scripts import run_script, with_shardkit

pytestmark = pytest.mark.slow  # four processes per run

SCRIPT = """\
import argparse, json
import torch
import transformers
import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
config = json.load(open(args.deepspeed_config))
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))
# a torch optimizer: DeepSpeed's own would JIT-build its CPU extension on a fresh checkout
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
g = torch.Generator().manual_seed(1)
losses, secondary = [], None
for step in range(5):
    x = torch.randint(128, (2 * world, 32), generator=g)[2 * rank : 2 * (rank + 1)]
    loss = engine(input_ids=x, labels=x).loss
    if secondary is None:  # DeepSpeed's secondary partitions exist between forward and backward
        secondary = sum(getattr(p, "ds_secondary_tensor", None) is not None for p in engine.module.parameters())
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    deepspeed.comm.all_reduce(mean)
    losses.append(mean.item() / world)
if rank == 0:
    json.dump({"loss": losses, "hpz": engine.zero_hpz_partition_size(), "ds_secondary": secondary}, open(args.out, "w"))
"""


def _config(hpz: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz},
    }


@pytest.mark.timeout(900)  # DeepSpeed JIT-builds its CPU communication op on a fresh checkout
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is the oracle")
def test_hpz_script_trains_like_deepspeed_with_hpz(tmp_path: Path) -> None:
    ours = run_script(with_shardkit(SCRIPT), tmp_path, "ours", _config(2), nproc=4)
    theirs = run_script(SCRIPT, tmp_path, "theirs", _config(2), nproc=4)
    assert theirs["ds_secondary"] > 0  # DeepSpeed's hpZ is on (on the CPU accelerator too)
    assert ours["hpz"] == theirs["hpz"] == 2
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)


def _engine_blocks() -> tuple[int, int, str]:
    import torch

    import shardkit
    from shardkit.comm import ParallelContext

    with ParallelContext.from_world() as ctx:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = shardkit.initialize(model=model, optimizer=optimizer, config=_config(2), ctx=ctx)
        group, place, block = engine.parallel.module._units.shards.secondary  # the ZeRO-3 wrapper's blocks
        loss = engine(torch.randn(2, 8)).square().mean()
        engine.backward(loss)
        engine.step()
        gathers = engine.parallel.module.comm_stats.summary()["all_gather"]["groups"]
        return block, place, ",".join(sorted(gathers))


def test_the_engine_builds_the_blocks_from_the_key(dist_pool) -> None:
    for rank, (block, place, groups) in enumerate(dist_pool.run(_engine_blocks, world_size=4, timeout=60)):
        assert (block, place) == (2, rank % 2)
        assert "shardkit_dp_cp_block" in groups, groups  # the backward gathered inside the block
