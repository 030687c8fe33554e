"""``deepspeed.pipe.PipelineModule`` under ``import shardkit.deepspeed as deepspeed``: a DeepSpeed
pipeline-parallel script (the style of DeepSpeed's ``pipeline_parallelism/train.py``) runs with
only its imports changed, and trains like DeepSpeed.

The script trains two PipelineModules on 2 gloo ranks (2 stages, fp32): an MLP of plain modules,
``LayerSpec``\\ s and a lambda cut by ``partition_method="parameters"``, fed by
``training_data=`` and ``engine.train_batch()`` (the loader read in order and repeated), and a
token model whose embedding and output head are one ``TiedLayerSpec`` on the first and last stage.
It runs once with DeepSpeed 0.19.8 (CPU accelerator) and once with the imports replaced; the
per-step losses must agree to fp32 accuracy. The argument errors are checked in this process:
each is raised before any process group exists.

No gradient clipping: DeepSpeed's fp32 pipeline (no ZeRO) clips by a norm of the first stage's
gradients only (``clip_grad_norm_`` counts a parameter on model-parallel rank 0, and its pipeline
grid's model-parallel group is the pipe group), where shardkit clips by the norm of every stage's
gradients, a tied weight counted once.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from deepspeed_scripts import run_script
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32

from shardkit.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

SCRIPT = """\
import argparse, json
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
from deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=5)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()


class Synthetic(torch.utils.data.Dataset):  # generated from a seed: 3 global batches, then repeated
    def __init__(self, n, seed, tokens=False):
        g = torch.Generator().manual_seed(seed)
        if tokens:
            self.x = torch.randint(0, 24, (n, 6), generator=g)
            self.y = (self.x * 5 + 3) % 24
        else:
            self.x = torch.randn(n, 16, generator=g)
            self.y = (self.x[:, :4].sum(1) > 0).long() + 2 * (self.x[:, 4] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def train(net, trainset, batch_fn=None):
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], training_data=trainset
    )
    if batch_fn is not None:
        engine.set_batch_fn(batch_fn)
    losses = [engine.train_batch().item() for step in range(args.steps)]
    grid = engine.grid
    return losses, [grid.get_stage_id(), grid.get_pipe_parallel_world_size(), grid.get_data_parallel_world_size()]


torch.manual_seed(0)
mlp = PipelineModule(
    layers=[nn.Linear(16, 32), nn.ReLU(), LayerSpec(nn.Linear, 32, 32), lambda x: torch.tanh(x),
            LayerSpec(nn.Linear, 32, 64), nn.ReLU(), LayerSpec(nn.Linear, 64, 4)],
    loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method="parameters")
mlp_losses, grid = train(mlp, Synthetic(24, seed=1), batch_fn=lambda batch: (2 * batch[0], batch[1]))

torch.manual_seed(1)
tied = PipelineModule(
    layers=[TiedLayerSpec("embed", nn.Embedding, 24, 16), LayerSpec(nn.Linear, 16, 16), nn.Tanh(),
            LayerSpec(nn.Linear, 16, 16), TiedLayerSpec("embed", nn.Embedding, 24, 16, forward_fn=lambda emb, h: h @ emb.weight.t())],
    loss_fn=lambda logits, y: F.cross_entropy(logits.reshape(-1, 24), y.reshape(-1)), num_stages=2, partition_method="uniform")
tied_losses, _ = train(tied, Synthetic(24, seed=2, tokens=True))
if deepspeed.comm.get_rank() == 0:
    out = {"mlp": mlp_losses, "mlp_parts": [int(b) for b in mlp.partitions()], "tied": tied_losses,
           "tied_parts": [int(b) for b in tied.partitions()], "grid": grid}
    json.dump(out, open(args.out, "w"))
"""

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.0,  # see the module docstring
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
    "steps_per_print": 1000,
}

SHARDKIT_IMPORTS = {
    "import deepspeed\n": "import shardkit.deepspeed as deepspeed\n",
    "from deepspeed.pipe import": "from shardkit.deepspeed.pipe import",
}


def _run(script: str, tmp_path: Path, name: str) -> dict:
    return run_script(script, tmp_path, name, CONFIG)


def _fp32_close(ours: list[float], theirs: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(900)  # DeepSpeed JIT-builds its CPU communication op on a fresh checkout
def test_a_deepspeed_pipeline_script_trains_like_deepspeed(tmp_path: Path) -> None:
    """One test for both models of the script (one 2-rank run per library; separate tests would
    each start the runs again on another pytest-xdist worker).

    The MLP: plain modules, LayerSpecs and a lambda, DeepSpeed's "parameters" cut (4 + 3 layers,
    where shardkit's own "params" split would give 3 + 4), the training data read in order and
    repeated (24 samples, 8 per step: steps 4-5 read the start again); a ``set_batch_fn`` that
    doubles the inputs, and the engine's ``grid`` (rank 0: stage 0 of 2, one data-parallel rank).

    The tied model: one TiedLayerSpec key on stage 0 (the embedding) and stage 1 (the head,
    through forward_fn): one value (stage 0's), gradients summed over both stages."""
    script = SCRIPT
    for theirs, ours in SHARDKIT_IMPORTS.items():
        assert theirs in script
        script = script.replace(theirs, ours)
    ours = _run(script, tmp_path, "shardkit_run")
    assert len(ours["mlp"]) == 5 and ours["mlp_parts"] == [0, 4, 7]
    assert ours["grid"] == [0, 2, 1]
    assert ours["mlp"][3] < ours["mlp"][0]  # step 4 reads step 1's batch again, after 3 updates
    assert ours["tied_parts"] == [0, 3, 5] and len(ours["tied"]) == 5
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (the bench extra): the differential half needs it")
    theirs = _run(SCRIPT, tmp_path, "deepspeed_run")
    assert ours["mlp_parts"] == theirs["mlp_parts"] and ours["grid"] == theirs["grid"]
    _fp32_close(ours["mlp"], theirs["mlp"])  # the batch function ran alike
    _fp32_close(ours["tied"], theirs["tied"])


# ---- 2 ranks of the session pool: against one process --------------------------------------------
def _tied_net() -> PipelineModule:
    torch.manual_seed(3)
    head = TiedLayerSpec("embed", nn.Embedding, 24, 16, forward_fn=lambda emb, h: h @ emb.weight.t())
    layers = [
        TiedLayerSpec("embed", nn.Embedding, 24, 16),
        LayerSpec(nn.Linear, 16, 16),
        nn.Tanh(),
        LayerSpec(nn.Linear, 16, 16),
        head,
    ]
    return PipelineModule(
        layers,
        num_stages=2,
        partition_method="uniform",
        loss_fn=lambda logits, y: F.cross_entropy(logits.reshape(-1, 24), y.reshape(-1)),
    )


def _token_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [(x, (x * 5 + 3) % 24) for x in (torch.randint(0, 24, (4, 6), generator=g) for _ in range(2))]


def _tied_checkpointed_body() -> dict:
    import shardkit.deepspeed as deepspeed
    from shardkit.comm import ParallelContext
    from shardkit.parallel.pipeline import is_checkpointed

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": ADAM_EPS_ACROSS_ORDERS}},
        "pipeline": {"activation_checkpoint_interval": 2, "seed_layers": False},  # DeepSpeed's keys
    }
    with ParallelContext.from_world(pp=2) as ctx:
        net = _tied_net()
        engine, *_ = deepspeed.initialize(model=net, config=config, ctx=ctx, model_parameters=net.parameters())
        blocks = [b for stage in engine.module for b in stage]
        # stages [0, 3) | [3, 5): runs [0, 1], [2] | [3, 4]; the Tanh alone has nothing to recompute
        assert [bool(is_checkpointed(b)) for b in blocks] == ([True, False] if ctx.rank("pp") == 0 else [True])
        losses = [float(engine.train_batch(iter(_token_batches(step)))) for step in range(4)]
        engine.close()
    dense = _tied_net()  # one process: the unsplit module, the tie one Parameter
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS_ACROSS_ORDERS)
    ref = []
    for step in range(4):
        x, y = (torch.cat(t) for t in zip(*_token_batches(step), strict=True))
        loss = dense.loss_fn(dense(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref.append(float(loss))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), **FP32)
    return {"losses": losses}


def test_tied_checkpointed_pipeline_module_equals_one_process(dist_pool) -> None:  # noqa: ANN001
    """The tie's gradient summed over both stages and clipped with the tie counted once, with the
    config's DeepSpeed ``pipeline.activation_checkpoint_interval`` recomputing runs of 2 layers."""
    out = dist_pool.run(_tied_checkpointed_body, world_size=2, timeout=120)
    assert out[0] == out[1]


# ---- in this process: no collective ---------------------------------------------------------------
def _mlp(**kwargs: object) -> PipelineModule:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), LayerSpec(nn.Linear, 16, 16), lambda x: x * 2, LayerSpec(nn.Linear, 16, 4)]
    return PipelineModule(layers=layers, **{"num_stages": 2, "loss_fn": nn.CrossEntropyLoss(), **kwargs})


def test_the_module_runs_unsplit_and_cuts_as_deepspeed() -> None:
    """forward runs the layers in order; the cuts are DeepSpeed's (partition_balanced: least
    heaviest-minus-lightest stage, ties to later cuts; partition_uniform)."""
    net = _mlp()
    x = torch.randn(3, 8)
    layer = net.get_submodule  # registered as DeepSpeed registers them: by layer index
    torch.testing.assert_close(net(x), layer("4")(2 * layer("2")(torch.relu(layer("0")(x)))))
    assert len(list(net.parameters())) == 6
    assert net.partitions() == [0, 2, 5] and net.pipeline_blocks()[1] == [2, 3]  # 144 | 272 + 68 parameters
    assert _mlp(partition_method="uniform").partitions() == [0, 3, 5]
    assert _mlp(partition_method="type:linear").partitions() == [0, 4, 5]  # Linears 2 + 1, ties to the later cut
    from shardkit.deepspeed.pipe import _partition_balanced

    # written out from deepspeed.runtime.utils.partition_balanced (0.19.8)
    assert _partition_balanced([10, 1, 1, 1, 10], 2) == [0, 3, 5]
    assert _partition_balanced([5, 0, 5, 0, 5, 0, 5], 3) == [0, 4, 6, 7]
    assert _partition_balanced([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5, 6]


def test_specs_are_built_from_deepspeed_random_state() -> None:
    """Stage 1's specs are built from the state after the parameter count, as on DeepSpeed's
    stage-1 rank; tied keys share their tied attributes only."""
    torch.manual_seed(0)
    counted = [LayerSpec(nn.Linear, 4, 4).build() for _ in range(3)]  # _count_layer_params
    stage1 = nn.Linear(4, 4)
    torch.manual_seed(0)
    net = PipelineModule([LayerSpec(nn.Linear, 4, 4)] * 3, num_stages=2)  # cut [0, 2, 3]
    assert net.partitions() == [0, 2, 3]
    torch.testing.assert_close(net.get_submodule("2").weight, stage1.weight)
    assert not torch.equal(net.get_submodule("2").weight, counted[2].weight)
    tied = PipelineModule([TiedLayerSpec("h", nn.Linear, 4, 4), nn.Tanh(), TiedLayerSpec("h", nn.Linear, 4, 4)], num_stages=2)
    first, last = tied.pipeline_blocks()[0][0], tied.pipeline_blocks()[0][2]
    assert first.weight is last.weight and first.bias is not last.bias  # DeepSpeed ties "weight" only
    with pytest.raises(TypeError, match="tied_weight_attr 'nope'"):
        PipelineModule([TiedLayerSpec("h", nn.Linear, 4, 4, tied_weight_attr="nope"), nn.Tanh()], num_stages=2)


def test_activation_checkpoint_interval_groups_each_stage() -> None:
    """Runs of k layers from each stage's first; runs holding parameters recompute (gradients unchanged)."""
    from shardkit.parallel.pipeline import is_checkpointed

    net = _mlp(activation_checkpoint_interval=2)
    blocks, sizes = net.pipeline_blocks()
    assert sizes == [1, 2] and [len(b) for b in blocks] == [2, 2, 1]  # stages [0, 2) and [2, 5)
    assert [bool(is_checkpointed(b)) for b in blocks] == [True, True, True]
    assert [
        bool(is_checkpointed(b))
        for b in _mlp(activation_checkpoint_interval=2, checkpointable_layers=["ReLU"]).pipeline_blocks()[0]
    ] == [False] * 3
    x = torch.randn(3, 8)
    y = nn.Sequential(*blocks)(x).sum()
    y.backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x).sum().backward()
    for g, p in zip(grads, net.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)


CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.mark.parametrize(
    ("make", "config", "kwargs", "error", "match"),
    [
        (lambda: _mlp(), {**CFG, "pipeline": {"stages": 4}}, {}, ValueError, r"pipeline.stages=4.*num_stages=2"),
        (lambda: _mlp(), {**CFG, "pipeline": {"partition": "layers"}}, {}, ValueError, r"pipeline.partition.*partition_method"),
        (lambda: _mlp(), {**CFG, "pipeline": {"virtual_stages": 2}}, {}, ValueError, r"pipeline.virtual_stages"),
        (lambda: _mlp(), CFG, {"loss_fn": nn.MSELoss()}, ValueError, r"loss_fn: model is a PipelineModule"),
        (lambda: _mlp(), CFG, {"blocks": list}, ValueError, r"blocks: model is a PipelineModule"),
        (lambda: _mlp(num_stages=1), CFG, {}, ValueError, r"num_stages=1"),
        # a one-process world (no torchrun): 2 stages do not divide it
        (lambda: _mlp(), CFG, {}, ValueError, r"PipelineModule\(num_stages=2\)"),
    ],
)
def test_initialize_refuses_before_any_collective(make, config, kwargs, error, match) -> None:  # noqa: ANN001
    import shardkit.deepspeed as deepspeed

    had_world = dist.is_initialized()  # another test of this worker may have left a one-process world
    net = make()
    with pytest.raises(error, match=match):
        deepspeed.initialize(model=net, config=config, model_parameters=net.parameters(), **kwargs)
    assert dist.is_initialized() == had_world  # no process group made (and so no collective)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"partition_method": "best"}, ValueError, r"partition_method='best'"),
        ({"partition_method": "type:conv"}, ValueError, r"partition_method='type:conv' matches no layer"),
        ({"partition_method": "type:("}, ValueError, r"partition_method='type:\('"),
        ({"num_stages": None}, ValueError, r"num_stages is required"),
        ({"num_stages": 6}, ValueError, r"num_stages=6 but layers has 5"),
        ({"activation_checkpoint_interval": -1}, ValueError, r"activation_checkpoint_interval"),
        ({"loss_fn": "ce"}, TypeError, r"loss_fn"),
    ],
)
def test_pipeline_module_arguments_are_checked(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _mlp(**kwargs)
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        PipelineModule([nn.Linear(2, 2), 3], num_stages=1)
    with pytest.raises(TypeError, match="typename"):
        LayerSpec(len)


def _iterator_kept_and_eval_in_between() -> tuple[list[float], list[float], list[str]]:
    """DeepSpeed's train_batch keeps the iterator it was given and sets training mode itself."""
    import itertools

    import shardkit.deepspeed as deepspeed
    from shardkit.comm import ParallelContext

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
    results = []
    errors = []
    for keep in (True, False):
        with ParallelContext.from_world(pp=2) as ctx:
            net = _tied_net()
            engine, *_ = deepspeed.initialize(model=net, config=config, ctx=ctx, model_parameters=net.parameters())
            data = itertools.chain.from_iterable(_token_batches(step) for step in range(3))
            losses = [float(engine.train_batch(data))]
            engine.eval()
            val = float(engine.eval_batch(iter(_token_batches(9))))
            # the second and third steps: no iterator (kept from the first call), or the same one again
            losses += [float(engine.train_batch() if keep else engine.train_batch(data)) for _ in range(2)]
            if keep:
                for bad in ({"compute_loss": False}, {"num_micro_batches": 1}):
                    try:
                        engine.eval_batch(iter(_token_batches(9)), **bad)
                    except ValueError as e:
                        errors.append(str(e))
            engine.close()
            results.append(losses + [val])
    return results[0], results[1], errors


def test_train_batch_keeps_its_iterator_and_sets_training_mode_itself(dist_pool) -> None:  # noqa: ANN001
    for kept, passed, errors in dist_pool.run(_iterator_kept_and_eval_in_between, world_size=2, timeout=120):
        assert kept == passed  # train_batch() read on where train_batch(data) left off
        assert len(errors) == 2 and "compute_loss" in errors[0] and "num_micro_batches" in errors[1]
