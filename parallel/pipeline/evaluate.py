"""Forward-only evaluation through a pipeline: the whole batch, stage by stage, no schedule.

Evaluation has no backward to overlap with, so there is nothing for a schedule to order: the
batch goes through stage 0, 1, ..., S-1 as one micro-batch, each stage's owner receiving its
input (a shape message, then the tensor) from the previous stage's owner and sending its output
on. The last stage's owner computes the loss and broadcasts it over pp, so every pp rank
returns the same number — the loss the unsplit model gives on the same batch (eval mode, no
grad). Tags use ``p2p_tag`` with a micro-batch index past any training micro-batch, so an
evaluation can never match a training transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardkit.comm import broadcast

from .p2p import META_LEN, decode_meta, encode_meta, irecv, isend, p2p_tag

__all__ = ["evaluate_pipeline"]

_EVAL_MB = 1 << 20  # micro-batch index of evaluation transfers (training uses 0..m-1)


@torch.no_grad()
def evaluate_pipeline(
    stages: dict[int, torch.nn.Module],
    *,
    num_stages: int,
    rank: int,
    num_ranks: int,
    group: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], Any],
    inputs: torch.Tensor | None,
    targets: torch.Tensor | None,
    device: torch.device,
) -> float:
    """Mean loss of ``inputs``/``targets`` through the pipeline, on every pp rank (collective on pp).

    Args:
        stages: this rank's stages ``{stage index: module}`` (stage ``s`` on rank ``s % num_ranks``).
        num_stages: ``S``; rank, num_ranks, group: this rank on the pp group.
        loss_fn: the pipeline's loss (a mean, or a ``(sum, count)`` pair).
        inputs: ``[B, ...]`` on the first stage's rank; targets: ``[B, ...]`` on the last's.
        device: where the loss is broadcast from.

    Example:
        >>> pipe.evaluate(x, y)   # PipelineParallel's method calls this
        4.0123
    """
    was = {s: m.training for s, m in stages.items()}
    for m in stages.values():
        m.eval()
    try:
        x = inputs
        for s in range(num_stages):
            owner, prev = s % num_ranks, (s - 1) % num_ranks
            if owner != rank:
                continue
            if s > 0 and prev != rank:  # receive the shape, then the activation
                msg = torch.empty(META_LEN, dtype=torch.int64)
                irecv(msg, src=prev, tag=p2p_tag(s - 1, _EVAL_MB, False, num_stages), group=group).wait()
                _, shape, dtype = decode_meta(msg)
                x = torch.empty(shape, dtype=dtype, device=device)
                irecv(x, src=prev, tag=p2p_tag(s - 1, _EVAL_MB + 1, False, num_stages), group=group).wait()
            x = stages[s](x)
            nxt = (s + 1) % num_ranks
            if s + 1 < num_stages and nxt != rank:
                isend(encode_meta(x.shape, x.dtype), dst=nxt, tag=p2p_tag(s, _EVAL_MB, False, num_stages), group=group).wait()
                isend(x, dst=nxt, tag=p2p_tag(s, _EVAL_MB + 1, False, num_stages), group=group).wait()
        last = (num_stages - 1) % num_ranks
        loss = torch.zeros(1, dtype=torch.float32, device=device)
        if rank == last:
            out = loss_fn(x, targets)
            value = out[0] / out[1] if isinstance(out, tuple) else out
            loss.fill_(float(value))
        broadcast(loss, src=last, group=group)
        return float(loss)
    finally:
        for s, m in stages.items():
            m.train(was[s])
