"""Forward-only evaluation through a pipeline: the whole batch, stage by stage, no schedule.

Evaluation has no backward to overlap with, so there is nothing for a schedule to order: the
batch goes through stage 0, 1, ..., S-1 as one micro-batch, each stage's owner receiving its
input (a shape message, then the tensor) from the previous stage's owner and sending its output
on. The last stage's owner computes the loss and broadcasts it over pp, so every pp rank
returns the same number — the loss the unsplit model gives on the same batch (eval mode, no
grad). Tags use ``p2p_tag`` with a micro-batch index past any training micro-batch, so an
evaluation can never match a training transfer.

[Note: a failing evaluation]
A stage (or the loss) that raises on one rank must not leave the others waiting for a message
that never comes (they would block until the group's timeout). As in the shape exchange
([Note: the shape exchange] in :mod:`~shardkit.parallel.pipeline.shapes`), the failed stage's
owner sends a "failed at stage s" shape message instead of its output, the stages after it pass
it on without running, and the loss broadcast carries the outcome with the loss (no message
more on success). On a failure the failed stage's owner then broadcasts its message and every
pp rank raises the same ``ValueError``; nothing is left in flight, so the next evaluate or step
runs. Every message lives on the context's device: NCCL carries CUDA tensors only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardkit.comm import broadcast

from .p2p import META_LEN, decode_meta, encode_meta, irecv, isend, p2p_tag
from .shapes import broadcast_text

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
) -> tuple[float, float]:
    """``(loss sum, token count)`` of ``inputs``/``targets`` through the pipeline, on every pp rank
    (collective on pp); a mean-form ``loss_fn`` counts as ``(mean, 1)``.

    Args:
        stages: this rank's stages ``{stage index: module}`` (stage ``s`` on rank ``s % num_ranks``).
        num_stages: ``S``; rank, num_ranks, group: this rank on the pp group.
        loss_fn: the pipeline's loss (a mean, or a ``(sum, count)`` pair).
        inputs: ``[B, ...]`` on the first stage's rank; targets: ``[B, ...]`` on the last's.
        device: the context's device: every message (shapes, loss, error text) lives there.

    Raises:
        ValueError: on every pp rank, naming the stage (or the loss) that raised on its owner and
            that exception (see [Note: a failing evaluation]).

    Example:
        >>> total, count = evaluate_pipeline(...)   # PipelineParallel.evaluate returns total / count
        >>> total / count
        4.0123
    """
    was = {s: m.training for s, m in stages.items()}
    for m in stages.values():
        m.eval()
    try:
        failed, message, cause = -1, "", None  # the first failed stage; its owner's text and exception
        x, value, count = inputs, 0.0, 1.0
        for s in range(num_stages):
            owner, prev = s % num_ranks, (s - 1) % num_ranks
            if owner != rank:
                continue
            if s > 0 and prev != rank:  # receive the shape (or an upstream failure), then the activation
                msg = torch.empty(META_LEN, dtype=torch.int64, device=device)
                irecv(msg, src=prev, tag=p2p_tag(s - 1, _EVAL_MB, False, num_stages), group=group).wait()
                failed, shape, dtype = decode_meta(msg)
                if failed < 0:
                    x = torch.empty(shape, dtype=dtype, device=device)
                    irecv(x, src=prev, tag=p2p_tag(s - 1, _EVAL_MB + 1, False, num_stages), group=group).wait()
            meta = None
            if failed < 0:
                try:
                    x = stages[s](x)
                    if s == num_stages - 1:
                        out = loss_fn(x, targets)
                        value, count = (float(out[0]), float(out[1])) if isinstance(out, tuple) else (float(out), 1.0)
                    elif not isinstance(x, torch.Tensor):
                        raise TypeError(f"a stage must return one tensor, got {type(x).__name__}")
                    else:
                        meta = encode_meta(x.shape, x.dtype)  # raises for a dtype/rank it cannot carry
                except Exception as exc:  # noqa: BLE001 - reported on every rank below
                    step = "the loss on its output and targets" if s == num_stages - 1 else "its forward"
                    failed, cause = s, exc
                    message = f"pipeline evaluate: stage {s} (pp rank {rank}) failed in {step}: {type(exc).__name__}: {exc}"
            nxt = (s + 1) % num_ranks
            if s + 1 < num_stages and nxt != rank:
                if meta is None:
                    meta = encode_meta(None, None, failed_stage=failed)
                isend(meta.to(device), dst=nxt, tag=p2p_tag(s, _EVAL_MB, False, num_stages), group=group).wait()
                if failed < 0:
                    isend(x, dst=nxt, tag=p2p_tag(s, _EVAL_MB + 1, False, num_stages), group=group).wait()
        # [Note: a failing evaluation]: the outcome rides with the loss, from the last stage
        last = (num_stages - 1) % num_ranks
        result = torch.tensor([float(failed), value, count], dtype=torch.float64, device=device)
        broadcast(result, src=last, group=group)
        failed = int(result[0])
        if failed >= 0:
            text = broadcast_text(message, src=failed % num_ranks, rank=rank, group=group, device=device)
            raise ValueError(text) from cause
        return float(result[1]), float(result[2])
    finally:
        for s, m in stages.items():
            m.train(was[s])
