"""One executor for every pipeline schedule: :class:`PipelineParallel`.

The schedule (:func:`~shardkit.parallel.pipeline.schedules.build_schedule`) is data; this module
runs this rank's action list over point-to-point transfers on the pp group. Each action is a
named phase under a profiler label ``shardkit::pipeline_<phase>``.

[Note: pipeline loss normalization]
The loss of a step is the token-weighted mean over the *global* batch: with micro-batch ``i``
holding ``n_i`` target elements and ``loss_fn`` returning their mean ``L_i``, the step's loss
is ``sum_i n_i L_i / sum_i n_i`` — exactly ``loss_fn(model(inputs), targets)`` of the
unsplit model for any ``m`` and ``pp``. If ``loss_fn`` returns a pair ``(loss_sum, count)``
(e.g. a summed cross-entropy and the number of non-ignored tokens), the loss is
``sum_i loss_sum_i / sum_i count_i``, still the global token mean, padding included correctly.
Backward seeds each micro-batch with its *sum* (``n_i L_i`` or ``loss_sum_i``); parameter
gradients accumulate in fp32 buffers over the micro-batches, and :meth:`PipelineParallel.finalize`
divides them by the global count, which the last stage broadcasts with the losses (one small
broadcast per step), then adds them to ``param.grad``. Gradients therefore never depend on how
the batch was cut into micro-batches.

[Note: fp16 loss scaling in the pipeline]
With ``step(..., loss_scale=S)`` the backward must see the magnitudes DeepSpeed's fp16 engines
give it — micro-batch ``i`` seeded with ``S * L_i / m`` (the mean loss, divided over the
accumulation) — not ``S * n_i L_i``: a sum over thousands of tokens would overflow fp16 that
many times sooner, and a static scale tuned on DeepSpeed would overflow every step. So the last
stage seeds ``loss_sum_i * S / (m * n_0)`` (``n_0``: micro-batch 0's count, known after its
forward, before any backward of every schedule), and :meth:`PipelineParallel.finalize`
multiplies the sums by ``m * n_0 / sum_i n_i`` (1 when the micro-batches count alike) instead
of dividing by ``sum_i n_i``: ``param.grad`` then holds ``S`` times the global mean gradient,
still independent of how the batch was cut. Every activation gradient sent upstream is scaled
alike, so small fp16 gradients stay representable on every stage. The reported losses are not
scaled. The caller unscales and agrees the overflow over pp, dp and tp
(:class:`~shardkit.parallel.ParallelModel`: in its clip/step with ``dp="ddp"``, in the ZeRO
epilogue with ZeRO): a stage that skipped alone would leave the model half-updated. fp16
*parameters* (``model.half()``, DeepSpeed's fp16 mode) take the fp32-sum path of the next Note;
the sum is cast to fp16 once (an overflow there is an inf the caller sees).

[Note: accumulating in param.grad]: the sums of the scaled
micro-batch gradients are fp32, cast to fp16 once (an overflow there is an inf the caller sees).

[Note: accumulating in param.grad]
With fp32 parameters, a full backward (B) runs ``torch.autograd.backward(y, g, inputs=[x, *params])``
and lets autograd accumulate each micro-batch into ``param.grad`` (the step's own sums: the
caller's gradients are set aside at the start of :meth:`PipelineParallel.step` and given back
after the loop, or on an error). AccumulateGrad adds each gradient the moment it is computed,
while it is still in cache, and frees it at once; returning every gradient of the micro-batch
from ``torch.autograd.grad`` and adding them afterwards was measured 20% slower on CPU (one
stage of 4 MLP blocks, 16.8M params, 8 micro-batches: 443 vs 519 ms min), the gap between our
pipeline and torch.distributed.pipelining's. Parameter hooks therefore fire once per
micro-batch, as in a plain accumulation loop. ZB-H1's weight-gradient action (W) accumulates
the same way (``backward_weight(..., accumulate=True)``). Other dtypes keep fp32 sums
(``_accumulate``).

The shape exchange before the first activation is in :mod:`~shardkit.parallel.pipeline.shapes`;
tied parameters in :mod:`~shardkit.parallel.pipeline.tied`.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import GraphExecGroup

from shardkit.comm import CommStats, ParallelContext, all_reduce, broadcast

from .backward import WeightWork, backward_input, backward_weight
from .evaluate import evaluate_pipeline
from ..activation_checkpointing import checkpoint_blocks
from .p2p import p2p_tag, post
from .schedules import COMPUTE, Action, Kind, TimedAction, build_schedule
from .shapes import exchange_shapes, signature
from .split import SplitSpec, split_blocks
from .tied import TiedParameters, TiedSpec, find_ties

__all__ = ["PipelineParallel"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


class PipelineParallel:
    """Pipeline-parallel training of a model given as a sequence of blocks.

    Every rank of the pp group builds the same full ``blocks`` (same seed), keeps the stages the
    schedule places on it (see [Note: stages, chunks and ranks] in
    :mod:`~shardkit.parallel.pipeline.schedules`) and calls :meth:`step` with the same global
    batch; ``inputs`` are read on the first stage, ``targets`` on the last.

    Args:
        blocks: ``nn.Sequential`` or sequence of modules, embedding first, head last; block ``j``
            consumes block ``j - 1``'s single tensor output.
        ctx: the :class:`~shardkit.comm.ParallelContext`; its ``pp`` axis is the pipeline.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``.
        microbatches: ``m >= 1`` (any value; a multiple of pp for interleaved).
        loss_fn: ``loss_fn(output, target)`` returning the micro-batch's mean loss (scalar), or
            ``(loss_sum, count)``; see [Note: pipeline loss normalization].
        virtual_stages: stages per rank (``> 1`` only with ``"interleaved"``).
        split: ``"layers"``, ``"params"`` or explicit stage sizes (see
            :func:`~shardkit.parallel.pipeline.split.partition`).
        stats: optional :class:`~shardkit.comm.CommStats` for the P2P and broadcast payloads.
        tied: extra tied parameter slots, e.g. ``[("0.weight", "7.weight")]`` (keys of
            ``nn.Sequential(*blocks)``); the same ``nn.Parameter`` in several blocks is tied
            without it. See [Note: tied weights across stages] in
            :mod:`~shardkit.parallel.pipeline.tied`.
        checkpointing: ``False``, ``True`` (every block of this rank recomputes its forward in
            backward, see :func:`~shardkit.parallel.activation_checkpointing.checkpoint_blocks`)
            or ``"cpu"`` (the same, with the kept block inputs in CPU memory).

    Raises:
        ValueError: bad schedule/sizes, interleaved with ``m % pp != 0``, more stages than
            blocks, a bad ``tied`` or ``checkpointing`` — all before any communication.

    The constructor is collective on pp when parameters are tied across ranks (their values are
    broadcast from the lowest block's owner), and on the world when a tie spans only part of the
    pp group (its process group is created); :meth:`close` releases those groups.

    Example:
        >>> ctx = ParallelContext.from_env(pp=2)
        >>> pipe = PipelineParallel(blocks, ctx, schedule="1f1b", microbatches=4, loss_fn=F.cross_entropy)
        >>> opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        >>> loss = pipe.step(x, y); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        blocks: nn.Sequential | Sequence[nn.Module],
        ctx: ParallelContext,
        *,
        schedule: str = "1f1b",
        microbatches: int,
        loss_fn: LossFn,
        virtual_stages: int = 1,
        split: SplitSpec = "layers",
        stats: CommStats | None = None,
        tied: TiedSpec = (),
        checkpointing: bool | str = False,
    ) -> None:
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not (isinstance(checkpointing, bool) or checkpointing == "cpu"):
            raise ValueError(f"checkpointing must be False, True or 'cpu', got {checkpointing!r}")
        self.checkpointing = checkpointing
        self.ctx, self.loss_fn, self.stats = ctx, loss_fn, stats
        self.group, self.rank, p = ctx.group("pp"), ctx.rank("pp"), ctx.size("pp")
        self.schedule = build_schedule(schedule, num_ranks=p, microbatches=microbatches, virtual_stages=virtual_stages)
        S = self.schedule.num_stages
        plan = split_blocks(blocks, S, split)
        ties = find_ties([b for _, mod in plan for b in mod], tied)
        #: ``stage_blocks[s]``: indices of the blocks that form stage ``s`` (all stages).
        self.stage_blocks: list[range] = [idx for idx, _ in plan]
        #: this rank's stages: ``{stage: nn.Sequential}``.
        self.stages: dict[int, nn.Module] = {s: mod for s, (_, mod) in enumerate(plan) if s % p == self.rank}
        self._params = {s: [q for q in mod.parameters() if q.requires_grad] for s, mod in self.stages.items()}
        # [Note: accumulating in param.grad]: fp32 params only (the sums must be fp32)
        self._accumulate_in_grad = all(q.dtype == torch.float32 for qs in self._params.values() for q in qs)
        if checkpointing:
            for mod in self.stages.values():
                checkpoint_blocks(mod, offload_to_cpu=checkpointing == "cpu")
        self.tied = TiedParameters([b for _, mod in plan for b in mod], ties, self.stage_blocks, p, ctx, stats)
        self.tied.broadcast_values()
        self._signature: tuple[int, ...] | None = None
        self._loop_s = 0.0
        self._in_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._out_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        #: last step's actions on this rank, with start/end in seconds from the step's start and
        #: the time spent blocked on P2P (``wait``) recorded separately from compute.
        self.timeline: list[TimedAction] = []
        #: last step's per-micro-batch losses (same on every pp rank).
        self.microbatch_losses: list[float] = []

    # ---- public ------------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """This rank's stage parameters (for the optimizer), each once even when tied across
        two of this rank's stages."""
        unique = {id(q): q for s in sorted(self.stages) for q in self.stages[s].parameters()}
        return list(unique.values())

    def evaluate(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> float:
        """Mean loss of a batch without gradients (eval mode): one forward, stage by stage, the
        whole batch at once; the same float on every pp rank. Collective on pp.

        Example:
            >>> val = pipe.evaluate(x_val, y_val)   # inputs read on the first stage, targets on the last
        """
        return evaluate_pipeline(
            self.stages,
            num_stages=self.schedule.num_stages,
            rank=self.rank,
            num_ranks=self.schedule.num_ranks,
            group=self.group,
            loss_fn=self.loss_fn,
            inputs=inputs,
            targets=targets,
            device=self.ctx.device,
        )

    def close(self) -> None:
        """Release the process groups created for tied parameters (see
        :class:`~shardkit.parallel.pipeline.tied.TiedParameters`); the pipeline must not step
        afterwards. Idempotent; local."""
        self.tied.close()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, keyed as ``nn.Sequential(*blocks).state_dict()``
        (``"<block index>.<name>"``), on every pp rank; CPU copies. Collective on pp (an object
        all-gather: meant for checkpoints and evaluation of models that fit one host's memory).

        Example:
            >>> sd = pipe.full_state_dict()          # every rank
            >>> nn.Sequential(*make_blocks()).load_state_dict(sd)
        """
        local = {
            f"{j}.{k}": v.detach().cpu()
            for s in sorted(self.stages)
            for j, blk in zip(self.stage_blocks[s], self.stages[s], strict=True)
            for k, v in blk.state_dict().items()
        }
        parts = [local]
        if self.schedule.num_ranks > 1:
            parts = [None] * self.schedule.num_ranks
            dist.all_gather_object(parts, local, group=self.group)
        merged = [item for part in parts for item in part.items()]
        return dict(sorted(merged, key=lambda kv: int(kv[0].split(".", 1)[0])))  # stable: block order

    def timeline_summary(self) -> dict[str, float]:
        """This rank's last step from :attr:`timeline`, in seconds: ``compute`` (F/B/BI/BW),
        ``p2p_wait`` (blocked in receives), ``wall`` (the action loop, without finalize) and
        ``bubble_fraction`` = ``(wall - compute) / compute``, the measured counterpart of the
        simulator's (docs/reference.md, "Pipeline bubbles").

        Example:
            >>> pipe.step(x, y); pipe.timeline_summary()["bubble_fraction"]
            0.41
        """
        compute = sum(ta.end - ta.start for ta in self.timeline if ta.action.kind in COMPUTE)
        wait = sum(ta.wait for ta in self.timeline)
        wall = self._loop_s
        return {
            "compute": compute,
            "p2p_wait": wait,
            "wall": wall,
            "bubble_fraction": (wall - compute) / compute if compute else 0.0,
        }

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.schedule.num_ranks - 1

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, *, loss_scale: float | None = None) -> float:
        """Forward and backward of one global batch through the pipeline; collective on pp.

        Args:
            inputs: ``[B, ...]`` global batch, read on the first stage (may be None elsewhere).
            targets: ``[B, ...]``, read on the last stage (may be None elsewhere). ``B`` must be
                a multiple of ``microbatches``; micro-batch ``i`` is rows ``[i B/m, (i+1) B/m)``.
            loss_scale: fp16 loss scale ``S`` (e.g. ``DynamicLossScaler.scale``), the same on
                every pp rank, or None: the backward is seeded with ``S`` times the loss, so the
                gradients come out multiplied by ``S`` (see [Note: fp16 loss scaling in the
                pipeline]); the returned loss is not scaled.

        Returns:
            The global token-weighted mean loss, on every pp rank. Gradients are *added* to
            ``param.grad`` of :meth:`parameters` (see [Note: pipeline loss normalization]).

        Raises:
            ValueError: on every rank, when any rank's inputs/targets are unusable or a stage
                cannot take its predecessor's output (see [Note: the shape exchange]);
                ``loss_scale`` not a finite number > 0 (before any communication).

        Example:
            >>> loss = pipe.step(x, y, loss_scale=scaler.scale)   # grads = scale * dloss/dparam
        """
        if loss_scale is not None and (
            isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not 0 < loss_scale < float("inf")
        ):
            raise ValueError(f"loss_scale must be None or a finite number > 0, got {loss_scale!r}")
        m = self.schedule.microbatches
        x_mbs = self._chunks("inputs", inputs) if self.is_first else None
        y_mbs = self._chunks("targets", targets) if self.is_last else None
        self._agree(x_mbs, y_mbs)
        state = _StepState(x_mbs, y_mbs, m)
        state.loss_scale = None if loss_scale is None else float(loss_scale)
        if self._accumulate_in_grad:  # [Note: accumulating in param.grad]: the caller's grads aside
            state.stashed = {q: q.grad for qs in self._params.values() for q in qs}
            for q in state.stashed:
                q.grad = None
        t0 = time.perf_counter()
        self.timeline = []
        acts, n = self.schedule.actions[self.rank], 0
        try:
            while n < len(acts):
                if acts[n].kind in COMPUTE:
                    start = time.perf_counter()
                    self._compute(acts[n], state)
                    self.timeline.append(TimedAction(acts[n], start - t0, time.perf_counter() - t0))
                    n += 1
                    continue
                end = n  # a run of communication actions is posted together (see communicate)
                while end < len(acts) and acts[end].kind not in COMPUTE:
                    end += 1
                self.timeline += self.communicate(acts[n:end], state, t0)
                n = end
            self._loop_s = time.perf_counter() - t0
            assert not state.outputs and not state.w_pending, "schedule left work undone"
            self._collect_grads(state)
        except BaseException:
            for q, g in state.stashed.items():  # nothing of a failed step reaches the caller's grads
                q.grad = g
            raise
        loss = self.finalize(state)
        assert len(self.microbatch_losses) == m
        return loss

    # ---- phases -------------------------------------------------------------------------------
    def _compute(self, a: Action, st: _StepState) -> None:
        k = a.kind
        if k is Kind.F:
            with record_function("shardkit::pipeline_forward"):
                self.forward(a.stage, a.mb, st)
        elif k is Kind.B:
            with record_function("shardkit::pipeline_backward"):
                self.backward(a.stage, a.mb, st, split=False)
        elif k is Kind.BI:
            with record_function("shardkit::pipeline_backward_input"):
                self.backward(a.stage, a.mb, st, split=True)
        else:
            with record_function("shardkit::pipeline_backward_weight"):
                self.backward_weight(a.stage, a.mb, st)

    def forward(self, s: int, i: int, st: _StepState) -> None:
        """Run stage ``s`` on micro-batch ``i``; the last stage also computes the loss."""
        S = self.schedule.num_stages
        if s == 0:
            x = st.x_mbs[i]
        else:
            x = st.acts.pop((s, i))
            if x.is_floating_point():
                x.requires_grad_(True)
        y = self.stages[s](x)
        st.inputs[(s, i)] = x
        if s == S - 1:
            out = self.loss_fn(y, st.y_mbs[i])
            if isinstance(out, tuple):
                total, count = out[0], torch.as_tensor(out[1])
            else:
                count = torch.tensor(st.y_mbs[i].numel())
                total = out * float(count)
            unscaled = total
            if st.loss_scale is not None:  # [Note: fp16 loss scaling in the pipeline]
                if st.seed is None:  # S / (m * n_0): a 0-d tensor, no host sync
                    assert i == 0, "every schedule runs the last stage's forwards in micro-batch order"
                    n0 = torch.as_tensor(count, device=total.device).to(torch.float32).clamp(min=1)
                    st.seed = st.loss_scale / (self.schedule.microbatches * n0)
                total = total * st.seed
            st.outputs[(s, i)] = total
            # kept as tensors: no device sync per micro-batch, one copy in finalize
            st.loss_sums[i], st.counts[i] = unscaled.detach(), count
            return
        st.outputs[(s, i)] = y
        if (s + 1) % self.schedule.num_ranks == self.rank:
            st.acts[(s + 1, i)] = y.detach()  # local hand-off (p = 1 with several stages)
        else:
            st.to_send[(Kind.SEND_F, s, i)] = y.detach()

    def backward(self, s: int, i: int, st: _StepState, *, split: bool) -> None:
        """Backward of stage ``s`` on micro-batch ``i``: input and weight gradients, or (``split``,
        ZB-H1's BI) the input gradient only, keeping what :meth:`backward_weight` needs (see
        [Note: splitting backward without re-walking the graph] in
        :mod:`~shardkit.parallel.pipeline.backward`)."""
        y, x = st.outputs.pop((s, i)), st.inputs.pop((s, i))
        g = None if s == self.schedule.num_stages - 1 else st.grads.pop((s, i))
        want_x = s > 0 and x.requires_grad
        params = self._params[s]
        gx = None
        if split:
            if want_x:
                gx, work = backward_input(y, x, g, params)
            else:  # nothing to send upstream: all of the backward is W
                work = WeightWork(list(params), output=y, grad_output=g)
            st.w_pending[(s, i)] = work
        elif self._accumulate_in_grad:  # [Note: accumulating in param.grad]
            wrt = ([x] if want_x else []) + params
            if wrt:
                torch.autograd.backward(y, grad_tensors=g, inputs=wrt)
            if want_x:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                x.grad = None
        else:
            wrt = ([x] if want_x else []) + params
            got = torch.autograd.grad(y, wrt, grad_outputs=g, allow_unused=True) if wrt else ()
            self._accumulate(s, got[1:] if want_x else got, st, foreign=[g, got[0] if want_x else None])
            if want_x:
                gx = got[0] if got[0] is not None else torch.zeros_like(x)
        if gx is not None:
            if (s - 1) % self.schedule.num_ranks == self.rank:
                st.grads[(s - 1, i)] = gx
            else:
                st.to_send[(Kind.SEND_B, s, i)] = gx

    def backward_weight(self, s: int, i: int, st: _StepState) -> None:
        """ZB-H1's W: the weight gradients of stage ``s`` for micro-batch ``i``."""
        work = st.w_pending.pop((s, i))
        # checkpointed blocks: W's autograd calls (one per weight group) share one recomputation
        foreign = [work.grad_output, *(t for gs in work.captured.values() for t in gs)]
        with GraphExecGroup() if self.checkpointing else nullcontext():
            grads = backward_weight(work, accumulate=self._accumulate_in_grad)  # clears work.captured
        if not self._accumulate_in_grad:
            self._accumulate(s, grads, st, foreign=foreign)

    def communicate(self, run: Sequence[Action], st: _StepState, t0: float) -> list[TimedAction]:
        """Post a run of consecutive sends/receives together (one ``batch_isend_irecv`` when
        there are several, so facing send/recv pairs cannot block each other on NCCL), then
        wait for the receives; sends are waited in :meth:`finalize`. Returns the run's timed
        actions: receives with the time blocked as ``wait``."""
        p, S = self.schedule.num_ranks, self.schedule.num_stages
        ops: list = []
        recvs: list = []
        with record_function("shardkit::pipeline_communicate"):
            for a in run:
                back = a.kind in (Kind.SEND_B, Kind.RECV_B)
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    peer = a.stage + (-1 if back else 1)
                    tag = p2p_tag(a.stage, a.mb, back, S)
                    ops.append(("send", st.to_send.pop((a.kind, a.stage, a.mb)), peer % p, tag))
                else:
                    peer = a.stage + (1 if back else -1)
                    shape, dtype = self._out_meta[a.stage] if back else self._in_meta[a.stage]
                    buf = torch.empty(shape, dtype=dtype, device=self.ctx.device)
                    ops.append(("recv", buf, peer % p, p2p_tag(peer, a.mb, back, S)))
            posted = time.perf_counter()
            handles = post(ops, group=self.group, stats=self.stats)
            out: list[TimedAction] = [TimedAction(a, posted - t0, posted - t0) for a in run]  # sends
            for n, (a, h) in enumerate(zip(run, handles, strict=True)):
                if h.op == "send":
                    st.sends.append(h)
                else:
                    recvs.append((n, a, h))
            for n, a, h in recvs:
                h.wait()
                (st.grads if a.kind is Kind.RECV_B else st.acts)[(a.stage, a.mb)] = h.output
                done = time.perf_counter()
                out[n] = TimedAction(a, posted - t0, done - t0, done - posted)
        return out

    def finalize(self, st: _StepState) -> float:
        """Wait for the sends, broadcast the losses and counts from the last stage, and add the
        accumulated gradients divided by the global count to ``param.grad``."""
        with record_function("shardkit::pipeline_finalize"):
            for h in st.sends:
                h.wait()
            m = self.schedule.microbatches
            vec = torch.zeros(2 * m, dtype=torch.float64, device=self.ctx.device)
            if self.is_last:
                vec[:m] = torch.stack([t.to(vec) for t in st.loss_sums])
                vec[m:] = torch.stack([t.to(vec) for t in st.counts])
            broadcast(vec, src=self.schedule.num_ranks - 1, group=self.group, stats=self.stats)
            sums, counts = vec[:m].tolist(), vec[m:].tolist()
            total = sum(counts)
            if total <= 0:
                raise ValueError(f"the loss counted {total} tokens over the batch; loss_fn must count >= 1")
            self.tied.sync_grads(st.grad_acc)  # sum-form, before the division: see tied.py
            # [Note: fp16 loss scaling in the pipeline]: the seed was S / (m * n_0), not S
            factor = None if st.loss_scale is None else m * max(counts[0], 1.0) / total
            for q, acc in st.grad_acc.items():
                if factor is None:
                    acc.div_(total)  # acc is this step's own fp32 buffer: divide in place, no new tensor
                elif factor != 1.0:
                    acc.mul_(factor)
                g = acc if acc.dtype == q.dtype else acc.to(q.dtype)
                q.grad = g if q.grad is None else q.grad.add_(g)
            self.microbatch_losses = [a / c if c else float("nan") for a, c in zip(sums, counts, strict=True)]
            return sum(sums) / total

    # ---- helpers ------------------------------------------------------------------------------
    def _collect_grads(self, st: _StepState) -> None:
        """[Note: accumulating in param.grad] After the loop: each param's ``.grad`` (this step's
        sum over micro-batches, accumulated by autograd) joins ``grad_acc``, and the caller's
        gradient goes back to ``.grad`` (finalize adds the step's mean to it)."""
        for q, kept in st.stashed.items():
            if q.grad is not None:
                acc = st.grad_acc.get(q)
                st.grad_acc[q] = q.grad if acc is None else acc.add_(q.grad)
            q.grad = kept
        st.stashed = {}

    def _accumulate(
        self, s: int, grads: Sequence[torch.Tensor | None], st: _StepState, foreign: Sequence[torch.Tensor | None] = ()
    ) -> None:
        """Add one micro-batch's parameter gradients into the step's fp32 sums.

        The first micro-batch's gradient is copied into a new fp32 buffer, never kept: keeping
        it (as AccumulateGrad steals a fresh gradient) was measured *slower* on CPU —
        ``perf/pipeline.py``, pp 2, m 8, 33.6M params: 1f1b 679 vs 585 ms, gpipe 711 vs 598 ms
        per step — as the allocator then hands every micro-batch's gradients fresh, untouched
        memory, and it would also have to prove the gradient shares no storage with ``foreign``
        (the tensors the autograd call was seeded with or returned: for ``y = x + p``, ``dp``
        *is* the incoming gradient, which may still be in flight to another stage).
        """
        del foreign  # kept in the signature: the callers name what a kept gradient must not alias
        for q, g in zip(self._params[s], grads, strict=True):
            if g is None:
                continue
            acc = st.grad_acc.get(q)
            if acc is not None:
                acc.add_(g)
            else:
                st.grad_acc[q] = g.detach().to(torch.float32, copy=True)

    def _chunks(self, name: str, t: Any) -> list[torch.Tensor] | str:
        m = self.schedule.microbatches
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            return f"{name} must be a tensor with a batch dim on this stage, got {type(t).__name__}"
        if t.shape[0] % m:
            return f"{name} batch size {t.shape[0]} must be a multiple of microbatches={m}"
        return list(t.to(self.ctx.device).chunk(m))

    def _agree(self, x_mbs: list | str | None, y_mbs: list | str | None) -> None:
        """Every rank learns every rank's input problems and micro-batch signatures (one tiny
        all-reduce); a new signature triggers the shape exchange."""
        p = self.schedule.num_ranks
        rows = torch.zeros(p, 3, dtype=torch.int64, device=self.ctx.device)
        problem = next((v for v in (x_mbs, y_mbs) if isinstance(v, str)), None)
        rows[self.rank, 0] = problem is not None
        if problem is None:
            rows[self.rank, 1] = signature(x_mbs[0]) if x_mbs else 0
            rows[self.rank, 2] = signature(y_mbs[0]) if y_mbs else 0
        all_reduce(rows, group=self.group, stats=self.stats)
        bad = [r for r in range(p) if rows[r, 0]]
        if bad:
            here = f": {problem}" if problem else ""
            raise ValueError(f"pipeline step rejected by pp rank(s) {bad}{here}")
        sig = tuple(rows[:, 1:].flatten().tolist())
        if sig != self._signature:
            self._signature = None  # until the exchange succeeds
            exchange_shapes(self, x_mbs, y_mbs)
            self._signature = sig


class _StepState:
    """Tensors alive during one step, keyed by (stage, micro-batch)."""

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
