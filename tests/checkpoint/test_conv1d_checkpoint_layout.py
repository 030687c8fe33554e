"""A tensor-parallel Hugging Face GPT-2 checkpoint: its Conv1D weights (``[in, out]`` in the
model, ``[out, in]`` under the TP plan) come out of ``consolidate`` / ``fp32_state_dict`` in the
model's own layout, and a load into a run that holds them the other way round is refused by name
(square weights, such as ``attn.c_proj``, would otherwise load transposed without a shape error)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.comm import ParallelContext
from tolerances import FP32

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, n_positions=16, vocab_size=48,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _body(tmp: str) -> None:
    from shardkit.consolidate import consolidate, fp32_state_dict
    from shardkit.hf_models import LogitsOnly
    from shardkit.parallel import load_checkpoint, parallelize, save_checkpoint
    from shardkit.parallel.tensor import gather_state_dict
    from shardkit.hf_models import hf_tp_plan

    with ParallelContext.from_world(tp=dist.get_world_size()) as ctx:
        model = LogitsOnly(_gpt2())
        plan = hf_tp_plan("hf:gpt2", model)
        par = parallelize(model, ctx, tp_plan=plan, dp="none")
        opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
        x = torch.randint(48, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            opt.zero_grad()
            par.forward_backward(x, x)
            par.step(opt)
        save_checkpoint(tmp, par, opt)
        dense = gather_state_dict(par.module.state_dict(), plan, ctx)  # the plan's own way back
        if ctx.rank("tp") == 0:
            exported = fp32_state_dict(tmp)
            model_pt, _ = consolidate(tmp, f"{tmp}-export")
            consolidated = torch.load(model_pt)
            fresh = LogitsOnly(_gpt2())
            fresh.load_state_dict(consolidated, strict=False)  # every Conv1D key in its own shape
            for key, value in dense.items():
                assert exported[key].shape == value.shape == fresh.state_dict()[key].shape, key
                torch.testing.assert_close(exported[key], value, **FP32, msg=lambda m, key=key: f"{key}: {m}")
                torch.testing.assert_close(consolidated[key], value, rtol=0, atol=0)
            square = "hf.transformer.h.0.attn.c_proj.weight"
            assert not torch.equal(exported[square], exported[square].t())  # the test can tell
        # tp 1 holds Conv1D: the load names the keys instead of transposing square ones silently
    with ParallelContext.from_world(tp=1, dp=dist.get_world_size()) as ctx1:
        one = parallelize(LogitsOnly(_gpt2()), ctx1, dp="ddp")
        with pytest.raises(ValueError, match=r"c_attn\.weight.*Conv1D"):
            load_checkpoint(tmp, one, torch.optim.AdamW(one.parameters(), lr=1e-2))


def test_conv1d_weights_leave_the_checkpoint_in_the_models_layout(dist_pool, tmp_path):
    dist_pool.run(_body, str(tmp_path / "ckpt"), world_size=2, timeout=120)
