"""``shardkit.deepspeed.utils.RepeatingLoader`` and ``shardkit.deepspeed.checkpointing``.

RepeatingLoader: the loader again from its start once exhausted (as DeepSpeed's, written out).
checkpoint(): the same outputs and gradients as calling the function directly, with dropout on
(the recomputation draws the same mask); configure() refuses what it does not offer, by name.
"""

from __future__ import annotations

import pytest
import torch


def test_repeating_loader_starts_the_loader_again() -> None:
    from shardkit.deepspeed.utils import RepeatingLoader

    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2)  # batches [0,1] [2,3] [4]
    it = iter(RepeatingLoader(loader))
    got = [next(it).tolist() for _ in range(7)]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4], [0, 1]]
    with pytest.raises(StopIteration):
        next(iter(RepeatingLoader([])))


def test_checkpoint_matches_the_direct_call_with_dropout_on() -> None:
    import shardkit.deepspeed as deepspeed

    block = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 8))
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    outputs = []
    for use_checkpoint in (False, True):
        block.zero_grad()
        x.grad = None
        torch.manual_seed(7)
        y = deepspeed.checkpointing.checkpoint(block, x) if use_checkpoint else block(x)
        y.square().sum().backward()
        outputs.append(y.detach())
        grads.append([x.grad.clone()] + [p.grad.clone() for p in block.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    for g1, g0 in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g1, g0, rtol=0, atol=0)


def test_configure_accepts_deepspeed_options_and_refuses_what_is_not_offered() -> None:
    from shardkit.deepspeed import checkpointing

    checkpointing.reset()
    assert not checkpointing.is_configured()
    checkpointing.configure(None, num_checkpoints=4, synchronize=False, profile=False)
    assert checkpointing.is_configured()
    for name in ("partition_activations", "checkpoint_in_cpu", "contiguous_checkpointing"):
        with pytest.raises(NotImplementedError, match=name):
            checkpointing.configure(None, **{name: True})
    checkpointing.reset()
