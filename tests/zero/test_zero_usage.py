"""ZeRO used the way people use it, against independent references.

* An MoE layer whose experts some ranks never route to (HF Mixtral runs only the experts a token
  reached): stage 3 must not hang and must train like one process on the whole batch; an
  expert no rank reached in a step is not stepped (torch.optim skips a param without a grad),
  one reached on a single rank is stepped with the average.
* Stage 3 used outside ``sdp(...)``: ``sdp.module(x)`` and HF ``generate`` must give what the
  unsharded model gives, and ``state_dict()`` of a sharded submodule must not return zeros.

The references are the same model in one process on the whole global batch, with torch.optim,
from the same seed. SGD with momentum and weight decay makes "stepped or not" visible: a wrongly
stepped param moves by ``lr * (momentum * buf + wd * p)``, orders of magnitude above FP32.
"""

from __future__ import annotations

import shutil
import tempfile
from datetime import timedelta

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer
from tolerances import FP32

GLOBAL_BATCH = 8
D = 16
N_EXPERTS = 2
SGD = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
# a hang must fail the body quickly, well inside the harness timeout
COMM_TIMEOUT = timedelta(seconds=10)


class _MoE(nn.Module):
    """Top-1 mixture of experts that, like HF Mixtral, runs only the experts a token reached."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(N_EXPERTS))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel() == 0:  # no token here: the expert's params get no grad on this rank
                continue
            out = out.index_add(0, rows, expert(h[rows]))
        return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.moe = _MoE()

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.moe(torch.tanh(self.proj(h)), route))


class _MoEModel(nn.Module):
    """Embedding and head in the root unit, three MoE blocks (the default stage-3 units)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, route)
        return self.head(h)


def _rows(rank: int, world: int) -> slice:
    return slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)


def _batch(step: int, expert1_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets, and the route: expert 1 for the listed global rows, expert 0 elsewhere."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, D, generator=g), torch.randn(GLOBAL_BATCH, D, generator=g)
    route = torch.zeros(GLOBAL_BATCH, dtype=torch.long)
    route[expert1_rows] = 1
    return x, y, route


def _params(sdp: ShardedDataParallel) -> dict[str, torch.Tensor]:
    """Full parameters on every rank (stage 3 holds shards: gather them)."""
    if sdp.stage == 3:
        return sdp.full_state_dict()
    return {n: p.detach() for n, p in sdp.module.named_parameters()}


def _train_moe(stage: int, schedule: list[list[int]], offload: str | None = None) -> None:
    """Train on dp ranks and in one process; ``schedule[step]``: the global rows routed to
    expert 1 at that step. Compare every parameter after every step."""
    ctx = ParallelContext.from_world(timeout=COMM_TIMEOUT)
    rank, world = ctx.rank("dp"), ctx.size("dp")
    nvme_dir = tempfile.mkdtemp(prefix="shardkit-usage-") if offload == "nvme" else None
    sdp = ShardedDataParallel(_MoEModel(), ctx, stage, offload=offload, nvme_dir=nvme_dir)
    ref = _MoEModel()
    opt = ZeroOptimizer(sdp, torch.optim.SGD, **SGD)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    mine = _rows(rank, world)
    for step, expert1_rows in enumerate(schedule):
        x, y, route = _batch(step, expert1_rows)
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[mine], route[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x, route), y).backward()  # the mean over the global batch
        ref_opt.step()
        got = _params(sdp)
        for name, q in ref.named_parameters():
            torch.testing.assert_close(got[name], q.detach(), **FP32, msg=lambda m, n=name: f"{n}, step {step}: {m}")
    ctx.destroy()
    if nvme_dir is not None:
        shutil.rmtree(nvme_dir)


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage3_param_unused_on_one_rank_trains_like_single_process(dist_pool, world_size: int) -> None:
    """The experts 1 get a grad on the first rank only (step 0) and on the last
    rank only (step 1); their buckets used to launch at a rank-dependent point between the
    backward gathers, and every rank timed out in an all-gather."""
    schedule = [[0], [GLOBAL_BATCH - 1], [0, GLOBAL_BATCH - 1]]
    dist_pool.run(_train_moe, 3, schedule, world_size=world_size, timeout=90)


@pytest.mark.parametrize(("stage", "offload"), [(1, None), (2, None), (3, None), (2, "cpu"), (3, "nvme")])
def test_param_unused_on_every_rank_is_not_stepped(dist_pool, stage: int, offload: str | None) -> None:
    """At step 1 no rank routes a token to expert 1, so torch.optim leaves those
    params (and their momentum) alone; steps 0 and 2 reach it on one rank only, which must step it
    with the average (the other rank's zeros included). Offload steps its own shard params on the
    host (cpu) or per bucket from files (nvme): the same rule."""
    schedule = [[0], [], [GLOBAL_BATCH - 1], []]
    dist_pool.run(_train_moe, stage, schedule, offload, world_size=2, timeout=90)


def _no_backward_leaves_params_alone(stage: int) -> None:
    """A step with no backward since zero_grad: torch.optim steps nothing (every grad is None)."""
    ctx = ParallelContext.from_world(timeout=COMM_TIMEOUT)
    sdp = ShardedDataParallel(_MoEModel(), ctx, stage)
    opt = ZeroOptimizer(sdp, torch.optim.SGD, **SGD)
    x, y, route = _batch(0, [0])
    mine = _rows(ctx.rank("dp"), ctx.size("dp"))
    nn.functional.mse_loss(sdp(x[mine], route[mine]), y[mine]).backward()
    opt.step()
    before = {k: v.clone() for k, v in _params(sdp).items()}
    state = {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items()}
    opt.zero_grad()
    opt.step()
    for name, p in _params(sdp).items():
        assert torch.equal(p, before[name]), name
    assert all(torch.equal(s["momentum_buffer"], state[id(p)]) for p, s in opt.state.items())
    ctx.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_without_backward_steps_nothing(dist_pool, stage: int) -> None:
    dist_pool.run(_no_backward_leaves_params_alone, stage, world_size=2, timeout=90)


# ---- stage 3 outside sdp(...) ------------------------------------------------------------------
VOCAB, SEQ = 61, 12


def _hf_model(family: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.GPT2LMHeadModel  # lm_head.weight is transformer.wte.weight: the root unit
    else:  # grouped-query attention, untied head
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
            eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg)


def _blocks(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _direct_calls_match(family: str) -> None:
    ctx = ParallelContext.from_world(timeout=COMM_TIMEOUT)
    rank, world = ctx.rank("dp"), ctx.size("dp")
    sdp, ref = ShardedDataParallel(_hf_model(family), ctx, 3), _hf_model(family)
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    mine = _rows(rank, world)
    # one training step first: the values the direct calls must see are the updated shards
    sdp(ids[mine], labels=ids[mine]).loss.backward()
    opt.step()
    opt.zero_grad()
    ref(ids, labels=ids).loss.backward()
    ref_opt.step()

    sdp.module.eval(), ref.eval()
    with torch.no_grad():
        want = ref(ids[:2]).logits
        torch.testing.assert_close(sdp.module(ids[:2]).logits, want, **FP32)  # the module itself
        torch.testing.assert_close(sdp(ids[:2]).logits, want, **FP32)
    prompt = ids[:2, :4]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(sdp.module.generate(prompt, **kw), ref.generate(prompt, **kw), rtol=0, atol=0)
    # and with grad: a direct call trains like sdp(...)
    sdp.module.train(), ref.train()
    sdp.module(ids[mine], labels=ids[mine]).loss.backward()
    opt.step()
    ref_opt.zero_grad()
    ref(ids, labels=ids).loss.backward()
    ref_opt.step()
    full = sdp.full_state_dict()
    for name, q in ref.named_parameters():
        torch.testing.assert_close(full[name], q.detach(), **FP32, msg=lambda m, n=name: f"{n}: {m}")
    # outside forward a sharded submodule holds only placeholders: its state_dict refuses, the
    # full one (collective) has its values under its prefix
    with pytest.raises(RuntimeError, match="full_state_dict"):
        _blocks(sdp.module)[0].state_dict()
    with pytest.raises(RuntimeError, match="full_state_dict"):
        sdp.module.state_dict()
    prefix = "transformer.h.0." if family == "gpt2" else "model.layers.0."
    for key, value in _blocks(ref)[0].state_dict().items():
        torch.testing.assert_close(full[prefix + key], value, **FP32)
    ctx.destroy()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_stage3_module_called_directly_and_generate_match_the_unsharded_model(dist_pool, family: str) -> None:
    """Only ShardedDataParallel.forward used to gather the root unit, so
    ``sdp.module(x)`` and ``generate`` ran on freed placeholders and returned other values, and a
    block's ``state_dict()`` returned zeros, with nothing raised."""
    dist_pool.run(_direct_calls_match, family, world_size=2, timeout=120)
