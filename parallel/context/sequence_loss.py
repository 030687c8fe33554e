"""The loss of a batch whose sequences are split over cp: every token weighs the same.

[Note: the loss over cp shards]
Each cp rank holds ``S/cp`` tokens of every sequence, with their targets (shifted *before*
sharding, so token ``i``'s target is token ``i+1`` of the full sequence wherever it lives). A
mean over each rank's own valid tokens would weigh a rank's tokens by how many of its targets
are ``ignore_index``; instead every rank divides its *sum* by the count over the whole
replica: one all-reduce of ``[sum, count]`` (8 bytes) over cp gives ``S`` and ``N``, the
replica's loss is ``S / N`` (what is reported, the same on every cp rank) and rank ``r``'s
share ``s_r / N`` sums over cp to it. The gradient of the replica is the sum of the shares'
gradients over cp; the dp strategies *average* over the dp_cp group (``dp * cp`` ranks), so
the backward runs on ``cp * s_r / N`` and the average is the mean over dp of the replicas' sums
over cp. A batch with no valid target counts ``N = 1`` (loss 0, no gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardkit.comm import CommStats, ParallelContext, all_reduce

from .sequence_layout import SequenceLayout, check_sequence_length, shard_sequence

__all__ = ["SequenceShardedLoss"]

LossAndCount = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SequenceShardedLoss:
    """Shards a batch's sequences over cp and forms the loss of [Note: the loss over cp shards].

    Args:
        ctx: the context (its cp axis).
        layout: how sequences are split ([Note: sequence layouts]).
        loss_and_count: ``(output, targets) -> (sum of token losses, count of valid targets)``.
        stats: optional :class:`~shardkit.comm.CommStats` for the ``[sum, count]`` all-reduce.

    Example:
        >>> split = SequenceShardedLoss(ctx, "zigzag", token_cross_entropy_sum)
        >>> x, y = split.shard(inputs, targets)              # [B, S] -> [B, S/cp]
        >>> for_backward, loss = split(model(x), y)
        >>> for_backward.backward()                          # then average grads over dp_cp
    """

    def __init__(
        self, ctx: ParallelContext, layout: SequenceLayout, loss_and_count: LossAndCount, stats: CommStats | None = None
    ) -> None:
        self.ctx, self.layout, self.loss_and_count, self.stats = ctx, layout, loss_and_count, stats

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This cp rank's tokens of ``[B, S, ...]`` inputs and ``[B, S]`` targets.

        Raises:
            ValueError: the cp ranks hold batches of different shapes (on every cp rank alike), ``S``
                does not split over cp in the layout (the message says what to pad to), or the
                targets' sequence length differs from the inputs'.
        """
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
            raise ValueError("inputs: context parallelism splits dim 1 of [batch, seq, ...] inputs")
        self._check_same_batch(inputs)  # first: the checks below then decide alike on every cp rank
        check_sequence_length(inputs.shape[1], self.ctx.size("cp"), self.layout)
        if targets is not None and (targets.dim() < 2 or targets.shape[1] != inputs.shape[1]):
            raise ValueError(
                f"targets: context parallelism needs [batch, seq] targets aligned with the inputs' {inputs.shape[1]} "
                f"tokens, got shape {tuple(targets.shape)}"
            )
        x = shard_sequence(inputs, self.ctx, dim=1, layout=self.layout)
        y = None if targets is None else shard_sequence(targets, self.ctx, dim=1, layout=self.layout)
        return x, y

    def replica_loss(self, total: float, count: float, device: torch.device) -> torch.Tensor:
        """``S / N`` from this rank's token-loss sum and count (one all-reduce over cp): for a
        pipeline, whose loss function already normalizes its gradients over dp × cp.

        Example:
            >>> split.replica_loss(*pipe.last_loss_sum_count, device=ctx.device)
            tensor(4.0123)
        """
        both = torch.tensor([total, count], dtype=torch.float64, device=device)
        all_reduce(both, group=self.ctx.group("cp"), stats=self.stats)
        return (both[0] / both[1].clamp(min=1.0)).float()

    def _check_same_batch(self, inputs: torch.Tensor) -> None:
        """Every cp rank must hold the same full batch: one 16-byte all-reduce of its shape over cp,
        so ranks handed different data raise the same ``ValueError`` instead of exchanging blocks
        of different sizes (or of the same size but other tokens)."""
        b, s = inputs.shape[0], inputs.shape[1]
        shape = torch.tensor([b, s, -b, -s], dtype=torch.int64, device=inputs.device)
        all_reduce(shape, group=self.ctx.group("cp"), op="max", stats=self.stats)
        if shape[0] != -shape[2] or shape[1] != -shape[3]:
            raise ValueError(
                f"inputs: the cp ranks of a replica must get the same full batch (each keeps its tokens); this "
                f"rank has [{b}, {s}], the cp group between [{-int(shape[2])}, {-int(shape[3])}] and "
                f"[{int(shape[0])}, {int(shape[1])}]"
            )

    def shard_if_held(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """:meth:`shard` for a pipeline rank, which holds the inputs (first stage), the targets
        (last stage), both or neither; each is ``[B, S, ...]`` and checked as :meth:`shard` does.

        Example:
            >>> x, y = split.shard_if_held(None, targets)          # a last stage that is not the first
        """
        x = None if inputs is None else self.shard(inputs, None)[0]
        y = None if targets is None else self.shard(targets, None)[0]
        if inputs is not None and targets is not None and targets.shape[:2] != inputs.shape[:2]:
            raise ValueError(f"targets: shape {tuple(targets.shape)} does not match the inputs' {tuple(inputs.shape[:2])}")
        return x, y

    def __call__(
        self, output: torch.Tensor, targets: torch.Tensor, *, divide_by: float | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(for_backward, loss)``: ``cp * s_r / N`` (differentiable) and ``S / N`` (detached, fp32).

        Args:
            output, targets: this rank's output and targets (``loss_and_count``'s arguments).
            divide_by: ``N`` itself instead of the replica's count of valid targets (Hugging
                Face's ``num_items_in_batch``: the count over every micro-batch of a step).
        """
        total, count = self.loss_and_count(output, targets)
        both = torch.stack([total.detach().float(), count.to(total.device).float()])
        all_reduce(both, group=self.ctx.group("cp"), stats=self.stats)
        n = both[1].clamp(min=1.0) if divide_by is None else torch.as_tensor(divide_by, device=both.device).float()
        return total * (self.ctx.size("cp") / n), (both[0] / n).detach()
