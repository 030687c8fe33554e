"""The engine's forward when ``sequence_parallel_size`` > 1: whole sequences in, this rank's tokens run.

[Note: the engine's forward over cp]
A DeepSpeed loop calls ``engine(input_ids=x, labels=x)`` (or ``engine(x)`` and forms its own
loss). With the sequence split over cp ranks (``sequence_parallel_size``), every cp rank of a
replica is handed the same whole batch (the DataLoader ``initialize`` returns splits over dp
only) and the engine keeps this rank's tokens (``shard_sequence`` in the config's layout):

* the token ids are ``input_ids=`` or the first positional argument, ``[batch, seq]``;
* ``labels=`` (a Hugging Face causal LM): the labels are shifted *before* the split (token ``i``'s
  target is token ``i + 1`` of the whole sequence, wherever it lives), the model runs on this
  rank's tokens without ``labels=``, and the loss returned is the replica's: the sum of token
  losses over every cp rank divided by the count of valid targets over every cp rank (or by
  ``num_items_in_batch`` when given), the value a one-process model reports. Its gradient is this
  rank's share × cp, since the dp strategies *average* over the dp × cp ranks
  ([Note: the loss over cp shards]). ``logits`` in the output are this rank's positions only;
* no ``labels=``: the logits are gathered to the whole sequence (differentiable; the gradient
  of this rank's part × cp, for the same reason), so a loss the script forms from them sees the
  whole sequence. That costs one whole ``[batch, seq, vocab]`` tensor per rank: pass ``labels=``
  where the model takes them;
* with ``fused_cross_entropy`` and ``labels=``, the LM head forms the sum of this rank's token
  losses from its hidden states (no logits at all: ``logits`` in the output is None), and that
  sum and the count of valid targets are reduced over cp as above;
* an ``attention_mask`` of ones is dropped (there is nothing to mask); any other mask, and
  ``position_ids``, are refused: the cp plan numbers each rank's tokens by their place in the
  whole sequence and its attention is causal over all of it. Pad on the right with ``-100``
  labels instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.comm import CommStats, ParallelContext
from shardkit.parallel.context import SequenceLayout, SequenceShardedLoss, gather_sequence
from shardkit.parallel.tensor.fused_head import FusedCrossEntropyHead, heads_compute_loss

__all__ = ["SequenceSplitForward"]

IGNORE_INDEX = -100  # Hugging Face's (and torch's) ignored label


def _token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's causal-LM loss before its division: the fp32 cross-entropy summed over the
    targets that are not -100, and their count."""
    t = targets.flatten()
    total = F.cross_entropy(logits.flatten(0, -2).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, (t != IGNORE_INDEX).sum()


class _ReplicaLoss(torch.autograd.Function):
    """Forward: the replica's loss (the value reported); backward: into this rank's share."""

    @staticmethod
    def forward(ctx: Any, for_backward: torch.Tensor, reported: torch.Tensor) -> torch.Tensor:
        return reported.to(for_backward.dtype).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"sequence_parallel_size > 1: the model returned a {type(out).__name__} with no logits; the engine "
            "splits the sequence of models that return logits (a tensor, a tuple starting with them, or an output "
            "with .logits)"
        )
    return logits


class SequenceSplitForward:
    """The engine's forward over this cp rank's tokens ([Note: the engine's forward over cp]).

    Args:
        ctx: the context (its cp axis, ``size("cp")`` > 1).
        layout: the config's ``context_parallel.layout``.
        stats: optional :class:`~shardkit.comm.CommStats` for the shape check, the loss's
            ``[sum, count]`` all-reduce and the logits' gather.
        fused_heads: the model's fused cross-entropy heads (``fused_cross_entropy``): a call
            with ``labels=`` takes its loss from them, with no logits formed.

    Example:
        >>> split = SequenceSplitForward(ctx, "zigzag")
        >>> out = split(model, (), {"input_ids": x, "labels": x})   # x: [B, S], the same on every cp rank
        >>> out.loss                                                # the whole sequence's mean loss
    """

    def __init__(
        self,
        ctx: ParallelContext,
        layout: SequenceLayout,
        stats: CommStats | None = None,
        fused_heads: list[FusedCrossEntropyHead] | None = None,
    ) -> None:
        self.ctx, self.layout, self.stats = ctx, layout, stats
        self.heads = list(fused_heads or [])
        how = self.heads[0].sum_and_count if self.heads else _token_loss_sum
        self.loss = SequenceShardedLoss(ctx, layout, how, stats=stats)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``module(*args, **kwargs)`` on this rank's tokens: its output with the replica's ``loss``
        (``labels=`` given) or with the whole sequence's logits (none given)."""
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels", None)
        items = kwargs.pop("num_items_in_batch", None)
        mask = kwargs.pop("attention_mask", None)
        if kwargs.get("position_ids") is not None:
            raise ValueError(
                "position_ids: not with sequence_parallel_size > 1 (the cp plan numbers each rank's tokens by their "
                "place in the whole sequence); drop them"
            )
        if isinstance(kwargs.get("input_ids"), torch.Tensor):
            tokens, where = kwargs["input_ids"], "input_ids"
        elif args and isinstance(args[0], torch.Tensor):
            tokens, where = args[0], 0
        else:
            raise ValueError(
                "sequence_parallel_size > 1: the engine splits the token ids, input_ids= or the first argument "
                "([batch, seq]); this call has neither"
            )
        targets = None
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.shape != tokens.shape:
                raise ValueError(
                    f"labels: [batch, seq] like the token ids {tuple(tokens.shape)}, got {getattr(labels, 'shape', labels)}"
                )
            # Hugging Face's shift, on the whole sequence: token i predicts label i + 1
            targets = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], IGNORE_INDEX)], dim=-1)
        x, y = self.loss.shard(tokens, targets)  # checks the cp ranks hold the same batch (collective)
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise ValueError(
                "attention_mask: with sequence_parallel_size > 1 only a mask of ones is taken (the attention is "
                "causal over the whole sequence); pad on the right and give the padded positions label -100"
            )
        if where == "input_ids":
            kwargs["input_ids"] = x
        else:
            args = (x, *args[1:])
        fused = y is not None and bool(self.heads)
        if fused:  # the head returns the sum of this rank's token losses in place of the logits
            with heads_compute_loss(self.heads, y, reduction="sum"):
                out = module(*args, **kwargs)
        else:
            out = module(*args, **kwargs)
        logits = _logits_of(out)
        if y is not None:
            for_backward, reported = self.loss(logits, y, divide_by=items)
            loss = _ReplicaLoss.apply(for_backward, reported)
            if isinstance(out, torch.Tensor):
                raise TypeError(
                    "labels= given but the model returned a tensor, not a Hugging Face output; call engine(x) and "
                    "form the loss from the logits it returns (the whole sequence's)"
                )
            if isinstance(out, tuple):  # return_dict=False: Hugging Face's order with labels
                return (loss, None, *out[1:]) if fused else (loss, *out)
            out["loss"] = loss
            if fused:
                out["logits"] = None  # none were formed
            return out
        cp = self.ctx.size("cp")
        if logits.requires_grad:  # the dp strategies average over dp × cp: this rank's share × cp
            logits.register_hook(lambda g: g * cp)
        full = gather_sequence(logits, self.ctx, dim=1, layout=self.layout, stats=self.stats)
        if isinstance(out, torch.Tensor):
            return full
        if isinstance(out, tuple):
            return (full, *out[1:])
        out["logits"] = full
        return out
