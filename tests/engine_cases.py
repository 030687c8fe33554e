"""The tiny GPT-2, MLP, batches and DeepSpeed configs shared by the engine tests (test_engine_parallel.py, test_checkpoint_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from tolerances import ADAM_EPS_ACROSS_ORDERS


transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MICRO, GAS, STEPS, CLIP, LR = 96, 12, 2, 2, 5, 0.5, 0.1


# ---- tensor_parallel ---------------------------------------------------------------------------
def tiny_gpt2(seed: int = 0):
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB,  # 96 % 2 == 0, 95 would pad
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)  # tied lm_head / wte


def tp_config(stage: int, tp: int) -> dict:
    # SGD, not Adam: GPT-2's key bias has a ~0 gradient (softmax ignores a per-row shift) whose
    # rounding noise Adam's m / sqrt(v) blows up to lr-sized steps (see test_tensor_parallel_hf)
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"size": tp, "plan": "auto"},
    }


def gpt2_batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(VOCAB, (MICRO, SEQ), generator=g)


def dense_gpt2_run() -> tuple[dict, list[float], list[float]]:
    """One process, plain torch: the dense GPT-2, HF's labels= loss, SGD + momentum, clipping;
    ``(state_dict, losses per micro-batch, norms per step)``."""
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(GAS):
            x = gpt2_batch(step, micro)
            loss = model(input_ids=x, labels=x).loss
            (loss / GAS).backward()
            losses.append(float(loss))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return model.state_dict(), losses, norms


# ---- pipeline ----------------------------------------------------------------------------------
P_MICRO, P_GAS, P_IN, P_CLASSES = 4, 4, 8, 5


def pp_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(P_IN, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, P_CLASSES)
    )  # fmt: skip


def pp_config(stage: int = 0, **pipeline) -> dict:
    return {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": P_MICRO,
        "gradient_accumulation_steps": P_GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": ADAM_EPS_ACROSS_ORDERS}},
        "pipeline": {"stages": 2, **pipeline},
    }


def pp_micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(P_MICRO, P_IN, generator=g), torch.randint(P_CLASSES, (P_MICRO,), generator=g)) for _ in range(P_GAS)]
