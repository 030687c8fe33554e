"""The state of one pipeline step, and how its gradients are normalized and accumulated.

[Note: pipeline loss normalization]
The loss of a step is the token-weighted mean over the *global* batch: with micro-batch ``i``
holding ``n_i`` target elements and ``loss_fn`` returning their mean ``L_i``, the step's loss
is ``sum_i n_i L_i / sum_i n_i`` — exactly ``loss_fn(model(inputs), targets)`` of the
unsplit model for any ``m`` and ``pp``. If ``loss_fn`` returns a pair ``(loss_sum, count)``
(e.g. a summed cross-entropy and the number of non-ignored tokens), the loss is
``sum_i loss_sum_i / sum_i count_i``, still the global token mean, padding included correctly.
Backward seeds each micro-batch with its *sum* (``n_i L_i`` or ``loss_sum_i``); parameter
gradients accumulate in fp32 buffers over the micro-batches, and :meth:`~shardkit.parallel.pipeline.PipelineParallel.finalize`
divides them by the global count, which the last stage contributes to the step's closing
all-reduce over pp with the losses (one small all-reduce per step), then adds them to
``param.grad``. Gradients therefore never depend on how the batch was cut into micro-batches.

A mean-returning ``loss_fn`` over targets with ignored entries (``F.cross_entropy``'s
``ignore_index``) is a mean over the *valid* tokens, which ``n_i = y.numel()`` mis-weights:
micro-batches with more padding count too much, and an all-padding micro-batch's mean is
``0/0 = nan``, which poisons the step. That is why :func:`~shardkit.parallel.parallelize`'s
default losses (token cross-entropy, vocab-parallel cross-entropy) take the pair form under a
pipeline: ``(sum over valid tokens, number of valid tokens)``; an all-padding micro-batch then
adds ``(0, 0)``.

With data parallelism (``ctx``'s dp axis > 1, ``PipelineParallel(normalize_over_dp=True)`` as
:func:`~shardkit.parallel.parallelize` builds it) the dp replicas train other rows of the
global batch and the caller averages ``param.grad`` over dp (``ParallelModel``'s all-reduce,
ZeRO's reduce-scatter). Each replica's own count differs when the padding does, and an average of
per-replica means is not the token mean of the global batch. So finalize also sums the count
over dp (one more 16-byte all-reduce, on the dp group) and divides by ``N / dp``, ``N`` the
count of the whole global batch: the dp average then gives exactly ``sum of every token's
gradient / N``, the dense model's gradient on the global batch. The returned loss stays this
replica's own (its batch's token mean, what :meth:`~shardkit.parallel.pipeline.PipelineParallel.evaluate`
returns on the same batch).

[Note: fp16 loss scaling in the pipeline]
With ``step(..., loss_scale=S)`` the backward must see the magnitudes DeepSpeed's fp16 engines
give it — micro-batch ``i`` seeded with ``S * L_i / m`` (the mean loss, divided over the
accumulation) — not ``S * n_i L_i``: a sum over thousands of tokens would overflow fp16 that
many times sooner, and a static scale tuned on DeepSpeed would overflow every step. So the last
stage seeds ``loss_sum_i * S / (m * n_0)`` (``n_0``: micro-batch 0's count, known after its
forward, before any backward of every schedule), and :meth:`~shardkit.parallel.pipeline.PipelineParallel.finalize`
multiplies the sums by ``m * n_0 / sum_i n_i`` (1 when the micro-batches count alike) instead
of dividing by ``sum_i n_i``: ``param.grad`` then holds ``S`` times the global mean gradient,
still independent of how the batch was cut. Every activation gradient sent upstream is scaled
alike, so small fp16 gradients stay representable on every stage. The reported losses are not
scaled. The caller unscales and agrees the overflow over pp, dp and tp
(:class:`~shardkit.parallel.ParallelModel`: in its clip/step with ``dp="ddp"``, in the ZeRO
epilogue with ZeRO): a stage that skipped alone would leave the model half-updated. fp16
*parameters* (``model.half()``, DeepSpeed's fp16 mode) take the fp32-sum path of the next Note;
the sum is cast to fp16 once (an overflow there is an inf the caller sees).

[Note: accumulating in param.grad]
With fp32 parameters, a full backward (B) runs ``torch.autograd.backward(y, g, inputs=[x, *params])``
and lets autograd accumulate each micro-batch into ``param.grad`` (the step's own sums: the
caller's gradients are set aside at the start of :meth:`~shardkit.parallel.pipeline.PipelineParallel.step` and given back
after the loop, or on an error). AccumulateGrad adds each gradient the moment it is computed,
while it is still in cache, and frees it at once; returning every gradient of the micro-batch
from ``torch.autograd.grad`` and adding them afterwards was measured 20% slower on CPU (one
stage of 4 MLP blocks, 16.8M params, 8 micro-batches: 443 vs 519 ms min), the gap between our
pipeline and torch.distributed.pipelining's. Parameter hooks therefore fire once per
micro-batch, as in a plain accumulation loop. ZB-H1's weight-gradient action (W) accumulates
the same way (``backward_weight(..., accumulate=True)``). Other dtypes keep fp32 sums
(:meth:`StepState.accumulate`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["StepState"]


class StepState:
    """Tensors alive during one step, keyed by (stage, micro-batch).

    Example:
        >>> st = StepState(x_mbs, None, m=4)   # first stage: the micro-batches of the inputs
    """

    def __init__(self, x_mbs: list | None, y_mbs: list | None, m: int) -> None:
        self.x_mbs, self.y_mbs = x_mbs, y_mbs
        self.acts: dict = {}  # (s, i) -> input of stage s, received or handed over
        self.inputs: dict = {}  # (s, i) -> input kept for backward
        self.outputs: dict = {}  # (s, i) -> output (or loss sum) kept for backward
        self.grads: dict = {}  # (s, i) -> gradient of stage s's output
        self.to_send: dict = {}  # (kind, s, i) -> tensor to post
        self.w_pending: dict = {}  # (s, i) -> WeightWork for BW
        self.sends: list = []
        self.grad_acc: dict = {}  # param -> fp32 sum-form gradient
        self.stashed: dict = {}  # param -> the caller's .grad, set aside while autograd accumulates
        self.loss_sums: list = [None] * m  # last stage only: 0-dim tensors
        self.counts: list = [None] * m
        self.loss_scale: float | None = None  # S (fp16), or None: see [Note: fp16 loss scaling in the pipeline]
        self.seed: torch.Tensor | None = None  # S / (m * n_0), set at micro-batch 0's loss
        # this rank's compute raised (its transfers drained): the message every rank raises, and
        # the exception; see [Note: a stage failing mid-step] in transfers.py
        self.failure: str | None = None
        self.cause: Exception | None = None

    def set_aside_grads(self, params: Sequence[torch.Tensor]) -> None:
        """[Note: accumulating in param.grad] Before the loop: the caller's ``.grad`` of each param
        goes to ``stashed`` and ``.grad`` is cleared, so autograd accumulates this step's sums.

        Example:
            >>> st.set_aside_grads(pipe.parameters())
        """
        self.stashed = {q: q.grad for q in params}
        for q in self.stashed:
            q.grad = None

    def collect_grads(self) -> None:
        """[Note: accumulating in param.grad] After the loop: each param's ``.grad`` (this step's sum
        over micro-batches, accumulated by autograd) joins ``grad_acc``, and the caller's gradient
        goes back to ``.grad`` (:meth:`apply_grads` adds the step's mean to it). Also the way back
        after an error: nothing of a failed step reaches the caller's gradients.

        Example:
            >>> st.collect_grads()
        """
        for q, kept in self.stashed.items():
            if q.grad is not None:
                acc = self.grad_acc.get(q)
                self.grad_acc[q] = q.grad if acc is None else acc.add_(q.grad)
            q.grad = kept
        self.stashed = {}

    def give_back_grads(self) -> None:
        """After an error in the loop: the caller's gradients back, this step's partial sums dropped."""
        for q, kept in self.stashed.items():
            q.grad = kept
        self.stashed = {}

    def accumulate(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        """Add one micro-batch's parameter gradients into the step's fp32 sums (the path for
        non-fp32 params; fp32 params accumulate in ``.grad``, [Note: accumulating in param.grad]).

        The first micro-batch's gradient is copied into a new fp32 buffer, never kept: keeping it
        would also have to prove the gradient shares no storage with the tensors the autograd call
        was seeded with or returned (for ``y = x + p``, ``dp`` *is* the incoming gradient, which may
        still be in flight to another stage).

        Example:
            >>> st.accumulate(stage_params, torch.autograd.grad(y, stage_params, dy))
        """
        for q, g in zip(params, grads, strict=True):
            if g is None:
                continue
            acc = self.grad_acc.get(q)
            if acc is not None:
                acc.add_(g)
            else:
                self.grad_acc[q] = g.detach().to(torch.float32, copy=True)

    def apply_grads(self, counts: Sequence[float], m: int, norm: float) -> None:
        """Turn the step's sums into the global mean gradient (times the loss scale, if any) and add
        it to each param's ``.grad`` ([Note: pipeline loss normalization], [Note: fp16 loss scaling
        in the pipeline]).

        Args:
            counts: each micro-batch's target count, from the last stage.
            m: the number of micro-batches.
            norm: what the sums are divided by: this batch's count ``sum(counts)``, or with dp > 1
                the count over every dp replica's batch divided by dp (the caller averages over dp).

        Example:
            >>> st.apply_grads(counts=[96.0] * 4, m=4, norm=384.0)
        """
        # the seed was S / (m * n_0) with a loss scale, 1 (sum form) without
        factor = None if self.loss_scale is None else m * max(counts[0], 1.0) / norm
        for q, acc in self.grad_acc.items():
            if factor is None:
                acc.div_(norm)  # acc is this step's own fp32 buffer: divide in place, no new tensor
            elif factor != 1.0:
                acc.mul_(factor)
            g = acc if acc.dtype == q.dtype else acc.to(q.dtype)
            q.grad = g if q.grad is None else q.grad.add_(g)
