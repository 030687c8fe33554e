"""checkpoint_blocks without pipelining: gradients bit-identical to the plain model (fp32, CPU,
dropout included), fewer and smaller saved activations (counted with saved_tensors_hooks),
CPU-offloaded block inputs, block selection and state_dict/deepcopy unchanged."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from pipeline_models import V, gpt_blocks
from torch import nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from shardkit.parallel.pipeline import checkpoint_blocks, is_checkpointed


class Dropped(nn.Module):
    """A GPT block followed by dropout: recomputation must replay the same mask."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block, self.drop = block, nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.block(x))


def _model(seed: int = 0) -> nn.Sequential:
    blocks = gpt_blocks(3, seed=seed)
    return nn.Sequential(blocks[0], *[Dropped(b) for b in blocks[1:-1]], blocks[-1])


def _run(model: nn.Module, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    x = torch.randint(0, V, (4, 5))
    out = model(x)
    (out.square().mean()).backward()
    return out.detach(), {k: q.grad.clone() for k, q in model.named_parameters()}


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("which", [None, 2, [1, 3], lambda i, b: isinstance(b, Dropped)])
def test_gradients_bit_identical(offload, which):
    want_out, want = _run(_model())
    model = _model()
    picked = checkpoint_blocks(model, offload_to_cpu=offload, which=which)
    assert picked and all(is_checkpointed(b) == ("cpu" if offload else True) for b in picked)
    got_out, got = _run(model)
    assert torch.equal(got_out, want_out)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _saved(model: nn.Module) -> tuple[int, int]:
    """(count, bytes) of the non-parameter tensors autograd saves in the outermost hooks."""
    params = {q.data_ptr() for q in model.parameters()}
    n = [0, 0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            n[0] += 1
            n[1] += t.numel() * t.element_size()
        return t

    torch.manual_seed(1)
    x = torch.randint(0, V, (4, 5))
    with saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return n[0], n[1]


def test_saves_only_block_inputs():
    plain = _saved(_model())
    model = _model()
    checkpoint_blocks(model)
    # the five checkpointed blocks save their inputs only: the int64 token ids, four fp32 [4, 5, 8]
    assert _saved(model) == (5, 4 * 5 * 8 + 4 * 4 * 5 * 8 * 4)
    assert plain[0] > 10 * 4 and plain[1] > 10 * (4 * 5 * 8 * 4), plain
    some = _model()
    checkpoint_blocks(some, which=[1])
    assert 5 < _saved(some)[0] < plain[0]


def test_offload_keeps_inputs_on_cpu():
    model = _model()
    checkpoint_blocks(model, offload_to_cpu=True)
    assert _saved(model) == (0, 0), "the inputs go through save_on_cpu, inside the outer hooks"
    packed: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Spy(saved_tensors_hooks):
        def __init__(self, **kw) -> None:
            real = save_on_cpu(**kw)

            def pack(t):
                out = real.pack_hook(t)
                packed.append((t, out[1]))
                return out

            super().__init__(pack, real.unpack_hook)

    with mock.patch("shardkit.parallel.activation_checkpointing.save_on_cpu", Spy):
        _, got = _run(model)
    assert len(packed) == 5  # one input per block: ids, then four activations
    for src, kept in packed:
        assert kept.device.type == "cpu" and kept.data_ptr() != src.data_ptr() and torch.equal(kept, src)
    _, want = _run(_model())
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_selection_and_model_forms():
    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(2, 2)
            self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(5)])

    gpt = GPT()
    assert checkpoint_blocks(gpt, which=2) == [gpt.layers[0], gpt.layers[2], gpt.layers[4]]
    assert not is_checkpointed(gpt.emb) and not is_checkpointed(gpt.layers[1])
    seq = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    assert checkpoint_blocks(list(seq), which=[-1]) == [seq[2]]
    with pytest.raises(ValueError, match="model_or_blocks: Linear holds no nn.ModuleList"):
        checkpoint_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"which: block indices \[3\] out of range for 3 blocks"):
        checkpoint_blocks(seq, which=[3])
    with pytest.raises(ValueError, match="which=0"):
        checkpoint_blocks(seq, which=0)
    with pytest.raises(TypeError, match="offload_to_cpu must be a bool"):
        checkpoint_blocks(seq, offload_to_cpu="yes")


def test_state_dict_and_deepcopy_unchanged():
    model = _model()
    keys = list(model.state_dict())
    checkpoint_blocks(model)
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)
    assert all(is_checkpointed(b) for b in twin[:-1])
    with torch.no_grad():
        for q in twin.parameters():
            q.zero_()
    # the copy's forward runs the copy's (zeroed) weights, not the original's
    x = torch.randint(0, V, (2, 5))
    assert torch.count_nonzero(twin(x)) == 0 and torch.count_nonzero(model(x)) > 0
