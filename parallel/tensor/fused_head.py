"""An LM head whose loss is formed chunk by chunk from its input: the wiring of
:func:`~shardkit.parallel.tensor.fused_linear_cross_entropy` into a model.

:func:`fuse_lm_head_loss` swaps a model's LM head (an ``nn.Linear``, or the
:class:`~shardkit.parallel.tensor.VocabParallelLMHead` a TP plan made) for a
:class:`FusedCrossEntropyHead` holding the same Parameter objects under the same names, so ties,
state dicts, checkpoints and optimizers see no change. Called directly the head still returns
logits (``generate``, evaluation code, a user's own loss all work). Two contexts change that:

* :func:`heads_compute_loss` (``parallelize``'s step and evaluation without a pipeline): the
  head's forward returns the loss of its input against the targets given to the context, and the
  model returns that 0-d loss where it returned logits;
* :func:`deferred_heads` (a pipeline's step): the head returns its input, the hidden states, and
  the last stage's loss function calls :meth:`FusedCrossEntropyHead.loss` on them.

Either way the ``[tokens, V/tp]`` logits never exist whole.

[Note: the fused head loss inside the head's forward]
Computing the loss inside the head's forward, rather than in a loss function after the model
returned, is what makes it work under ZeRO-3: the head's weight is gathered for exactly the
head's forward (and its backward), whichever unit holds it, and without gradients the units are
resharded as soon as their forward ends. With reduction "mean"/"sum" the loss's backward needs
no weight at all (the gradients are formed in the forward pass). A pipeline cannot hand each
micro-batch's targets to the head's forward, so it defers the head instead; ZeRO-3 does not
compose with pipelines, and the other dp strategies hold whole weights.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.comm import CommStats, ParallelContext

from .functions import copy_to_tp_region, gather_from_sequence_region
from .fused_linear_loss import fused_linear_cross_entropy
from .plan import VocabParallelLMHead
from .rng import set_tp_rng_stream

__all__ = ["FusedCrossEntropyHead", "deferred_heads", "fuse_lm_head_loss", "heads_compute_loss"]

#: module names :func:`fuse_lm_head_loss` takes for the LM head when none is given
HEAD_NAMES = ("lm_head", "head")


class FusedCrossEntropyHead(nn.Module):
    """An LM head ``logits = x Wᵀ (+ b)`` that can hand its input to a fused loss instead.

    Args:
        weight: ``[V/tp, d]`` (``[V, d]`` without tensor parallelism), shared with the head it
            replaces (and a tied embedding).
        bias: ``[V/tp]`` or None.
        vocab_size: the real ``V`` (rows past it are padding).
        ctx: the parallel context when the weight is a vocabulary shard over tp, else None.
        sequence_parallel: the input is this rank's sequence slice ``[b, s/tp, d]``.
        stats: optional CommStats (the head's and the loss's collectives).
        chunk_tokens: tokens per chunk of the fused loss (None: the default).

    Example:
        >>> head = fuse_lm_head_loss(model)                 # model.head / model.lm_head
        >>> with heads_compute_loss([head], y):
        ...     loss = model(x)                             # = F.cross_entropy(logits, y), 0-d
        >>> loss.backward()
        >>> model(x).shape                                  # outside: logits again
        torch.Size([4, 16, 50257])
    """

    def __init__(
        self,
        weight: nn.Parameter,
        *,
        bias: nn.Parameter | None = None,
        vocab_size: int,
        ctx: ParallelContext | None = None,
        sequence_parallel: bool = False,
        stats: CommStats | None = None,
        chunk_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.vocab_size, self.ctx, self.sequence_parallel, self.stats = vocab_size, ctx, sequence_parallel, stats
        #: the tp group the weight's vocabulary is split over (None: the whole vocabulary here)
        self.group = None if ctx is None else ctx.group("tp")
        self.chunk_tokens = chunk_tokens
        self.deferred = False
        self.armed: tuple[torch.Tensor, str] | None = None  # (targets, reduction): heads_compute_loss
        # what the last armed/deferred forward returned, weakly: the loss (and its graph) or the
        # hidden states are not kept alive past their step
        self._returned: weakref.ref | None = None

    @property
    def tp(self) -> int:
        return 1 if self.ctx is None else self.ctx.size("tp")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_returned"] = None  # a weak reference to one step's output: not part of the module
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` -> logits ``[..., V/tp]``; inside :func:`heads_compute_loss` the fp32 loss;
        inside :func:`deferred_heads`, ``x`` itself."""
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"{type(self).__name__}: input must have last dimension {self.weight.shape[1]}, got {tuple(x.shape)}"
            )
        if self.armed is not None:
            target, reduction = self.armed
            loss = self.loss(x, target, reduction=reduction)
            if self.tp > 1:
                set_tp_rng_stream(sharded=True)
            self._returned = weakref.ref(loss)
            return loss
        if self.deferred:
            if self.tp > 1:  # what follows is per-shard work: [Note: tensor-parallel RNG streams]
                set_tp_rng_stream(sharded=True)
            self._returned = weakref.ref(x)
            return x
        if self.tp == 1:
            return F.linear(x, self.weight, self.bias)
        group = self.ctx.group("tp")
        if self.sequence_parallel:
            y = F.linear(gather_from_sequence_region(x, group=group, stats=self.stats), self.weight, self.bias)
        else:
            y = F.linear(copy_to_tp_region(x, group=group, stats=self.stats), self.weight, self.bias)
        set_tp_rng_stream(sharded=True)
        return y

    def sum_and_count(self, out: Any, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, count of targets that are not -100)`` after checking that ``out`` is
        the sum this head formed (:meth:`check_returned`): the ``(sum, count)`` a loss over
        sequence shards all-reduces (``SequenceShardedLoss``) when the head ran armed with
        ``reduction="sum"``.

        Example:
            >>> with heads_compute_loss([head], y, reduction="sum"):
            ...     out = model(x)
            >>> total, count = head.sum_and_count(out, y)
        """
        self.check_returned(out)
        return out, (target != -100).sum()  # the armed forward's ignore_index: loss()'s default

    def check_returned(self, out: Any) -> None:
        """Raise unless ``out`` is what this head's last armed or deferred forward returned: a
        model that changes its logits after the head (logit scaling, soft-capping, a slice) would
        otherwise apply that change to the loss (or the hidden states), a wrong number without an
        error.

        Raises:
            ValueError: ``out`` is another tensor, naming the usual causes.
        """
        if self._returned is None or out is not self._returned():
            raise ValueError(
                "fused cross-entropy: the model did not return its LM head's output as is (it scales, soft-caps, "
                "slices or otherwise changes the logits after the head: Granite's logits_scaling, Gemma-2's "
                "final_logit_softcapping, Cohere's logit_scale...), so the fused loss cannot stand for the "
                "logits' loss; use fused_cross_entropy=False for this model"
            )

    def loss(
        self, hidden: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean", ignore_index: int = -100
    ) -> torch.Tensor:
        """The cross-entropy of this head's logits of ``hidden`` (what the deferred forward returned).

        Args:
            hidden: ``[..., d]`` (under sequence parallelism ``[..., s/tp, d]``).
            target: int64, ``hidden``'s leading shape (the whole sequence under sequence parallelism).
            reduction: ``"mean"`` over non-ignored targets, ``"sum"`` or ``"none"``.
            ignore_index: targets that add nothing.

        Returns:
            fp32 loss (see :func:`~shardkit.parallel.tensor.fused_linear_cross_entropy`).
        """
        if (
            not self.sequence_parallel
            and target.shape != hidden.shape[:-1]
            and target.numel() * hidden.shape[-1] == hidden.numel()
        ):
            target = target.reshape(hidden.shape[:-1])  # flat targets, as the unfused token loss takes them
        return fused_linear_cross_entropy(
            hidden,
            self.weight,
            target,
            ctx=self.ctx if self.tp > 1 else None,
            bias=self.bias,
            ignore_index=ignore_index,
            reduction=reduction,
            chunk_tokens=self.chunk_tokens,
            vocab_size=self.vocab_size,
            sequence_parallel=self.sequence_parallel,
            stats=self.stats,
        )


def fuse_lm_head_loss(model: nn.Module, name: str | None = None, *, chunk_tokens: int | None = None) -> FusedCrossEntropyHead:
    """Swap ``model``'s LM head for a :class:`FusedCrossEntropyHead` sharing its parameters.

    Args:
        model: the model, after tensor parallelism (if any) was applied.
        name: the head's module name; default: the one :class:`VocabParallelLMHead`, else the one
            ``nn.Linear`` named ``lm_head`` or ``head`` (at any depth, e.g. ``hf.lm_head``).
        chunk_tokens: the fused loss's chunk size (None: its default).

    Returns:
        The new head (already in ``model``).

    Raises:
        ValueError: no head, or more than one candidate (pass ``name``), or a module of another kind.

    Example:
        >>> head = fuse_lm_head_loss(model)                 # TinyGPT: model.head
        >>> model.head is head and head.weight is model.tok_emb.weight
        True
    """
    modules = dict(model.named_modules())
    if name is None:
        found = [n for n, m in modules.items() if isinstance(m, (VocabParallelLMHead, FusedCrossEntropyHead))]
        if not found:
            found = [n for n, m in modules.items() if n.rsplit(".", 1)[-1] in HEAD_NAMES and isinstance(m, nn.Linear)]
        if len(found) != 1:
            raise ValueError(
                f"fused cross-entropy: {'no' if not found else 'more than one'} LM head found in {type(model).__name__} "
                f"({found or 'no VocabParallelLMHead, no nn.Linear named ' + ' / '.join(HEAD_NAMES)}): name it"
            )
        name = found[0]
    if name not in modules or not name:
        raise ValueError(f"fused cross-entropy: {type(model).__name__} has no module {name!r}")
    old = modules[name]
    if isinstance(old, FusedCrossEntropyHead):
        return old
    if isinstance(old, VocabParallelLMHead):
        new = FusedCrossEntropyHead(
            old.weight,
            vocab_size=old.vocab_size,
            ctx=old.ctx,
            sequence_parallel=old.sequence_parallel,
            stats=old.stats,
            chunk_tokens=chunk_tokens,
        )
    elif isinstance(old, nn.Linear):
        new = FusedCrossEntropyHead(old.weight, bias=old.bias, vocab_size=old.out_features, chunk_tokens=chunk_tokens)
    else:
        raise ValueError(
            f"fused cross-entropy: module {name!r} is a {type(old).__name__}; the LM head must be an nn.Linear "
            "or a VocabParallelLMHead"
        )
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return new


@contextlib.contextmanager
def heads_compute_loss(
    heads: Iterable[FusedCrossEntropyHead], target: torch.Tensor, *, reduction: str = "mean"
) -> Iterator[None]:
    """Inside, each head's forward returns its loss against ``target`` instead of logits ([Note:
    the fused head loss inside the head's forward]).

    Args:
        heads: the heads (usually one).
        target: int64, the head input's leading shape (the whole sequence under sequence parallelism).
        reduction: as for :meth:`FusedCrossEntropyHead.loss`.

    Example:
        >>> with heads_compute_loss([head], y):
        ...     loss = model(x)
        ...     loss.backward()
    """
    heads = list(heads)
    before = [h.armed for h in heads]
    for h in heads:
        h.armed = (target, reduction)
    try:
        yield
    finally:
        for h, b in zip(heads, before):
            h.armed = b


@contextlib.contextmanager
def deferred_heads(heads: Iterable[FusedCrossEntropyHead]) -> Iterator[None]:
    """Inside, each head returns its input (the hidden states) for :meth:`FusedCrossEntropyHead.loss`.

    Example:
        >>> with deferred_heads([head]):
        ...     loss = head.loss(model(x), y)
        ...     loss.backward()
    """
    heads = list(heads)
    before = [h.deferred for h in heads]
    for h in heads:
        h.deferred = True
    try:
        yield
    finally:
        for h, b in zip(heads, before):
            h.deferred = b
