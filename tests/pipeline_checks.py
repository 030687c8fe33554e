"""Shared checks for the pipeline tests: a pipeline's stage gradients against a dense model's."""

from __future__ import annotations

import torch
from torch import nn
from tolerances import FP32


def assert_stage_grads_match(pipe, blocks: list[nn.Module], ref: nn.Sequential, what: str = "") -> None:
    """Every block this rank's stages hold has the gradients of the same block of ``ref`` (the
    single-process model run on the same batch), at fp32 tolerance.

    Example:
        >>> assert_stage_grads_match(pipe, blocks, nn.Sequential(*ref_blocks), "step 0")
    """
    for s in pipe.stages:
        for j in pipe.stage_blocks[s]:
            for got, want in zip(blocks[j].parameters(), ref[j].parameters(), strict=True):
                torch.testing.assert_close(got.grad, want.grad, **FP32, msg=f"{what} block {j}".strip())
