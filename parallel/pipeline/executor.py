"""One executor for every pipeline schedule: :class:`PipelineParallel`.

The schedule (:func:`~shardkit.parallel.pipeline.schedules.build_schedule`) is data; this module
runs this rank's action list over point-to-point transfers on the pp group. Each action is a
named phase under a profiler label ``shardkit::pipeline_<phase>``.

How gradients are normalized, scaled and accumulated over the micro-batches is in
:mod:`~shardkit.parallel.pipeline.step_state` ([Note: pipeline loss normalization],
[Note: fp16 loss scaling in the pipeline], [Note: accumulating in param.grad]).

The shape exchange before the first activation is in :mod:`~shardkit.parallel.pipeline.shapes`;
tied parameters in :mod:`~shardkit.parallel.pipeline.tied`; the P2P transfers of a step (runs
posted together, receives waited by the compute consuming them) in
:mod:`~shardkit.parallel.pipeline.transfers`.
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

from shardkit.comm import CommStats, ParallelContext, all_reduce

from .backward import WeightWork, backward_input, backward_weight
from .evaluate import evaluate_pipeline
from ..activation_checkpointing import checkpoint_blocks
from .schedules import COMPUTE, Action, Kind, TimedAction, build_schedule
from .shapes import agree_step, broadcast_text
from .split import SplitSpec, as_block_list, measure_block_times, split_blocks
from .step_state import StepState
from .p2p import post
from .tied import TiedParameters, TiedSpec, find_ties
from .transfers import StepTransfers

#: computes between posting a receive and the compute consuming it, on gloo (one receive buffer
#: more per direction alive; see [Note: receives ahead on gloo])
GLOO_RECV_AHEAD = 2

__all__ = ["PipelineParallel"]

#: a compute action as the heartbeat's phase label says it
_COMPUTE_NAMES = {Kind.F: "forward", Kind.B: "backward", Kind.BI: "input-gradient backward", Kind.BW: "weight-gradient backward"}

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
        loss_fn: ``loss_fn(output, target)`` returning the micro-batch's mean loss (scalar,
            weighted by ``target.numel()``), or ``(loss_sum, count)``: use the pair when some
            targets are ignored (padding), see [Note: pipeline loss normalization].
        virtual_stages: stages per rank (``> 1`` only with ``"interleaved"``).
        split: ``"layers"``, ``"params"``, ``"time"`` or explicit stage sizes (see
            :func:`~shardkit.parallel.pipeline.split.partition`); ``"time"`` is collective, see
            [Note: splitting by measured time].
        split_example: the first block's input for one micro-batch (required with
            ``split="time"``, which times the blocks on it; unused otherwise), or ``(input,
            target)``: the last block's time then includes ``loss_fn``, which the last stage runs.
        stats: optional :class:`~shardkit.comm.CommStats` for the P2P and broadcast payloads.
        tied: extra tied parameter slots, e.g. ``[("0.weight", "7.weight")]`` (keys of
            ``nn.Sequential(*blocks)``); the same ``nn.Parameter`` in several blocks is tied
            without it. See [Note: tied weights across stages] in
            :mod:`~shardkit.parallel.pipeline.tied`.
        checkpointing: ``False``, ``True`` (every block of this rank recomputes its forward in
            backward, see :func:`~shardkit.parallel.activation_checkpointing.checkpoint_blocks`)
            or ``"cpu"`` (the same, with the kept block inputs in CPU memory).
        normalize_over_dp: the caller averages ``param.grad`` over ``ctx``'s dp axis after each
            step (:func:`~shardkit.parallel.parallelize` does): normalize by the count of every
            dp replica's batch (one more small all-reduce per step, on dp), so that average is
            the global batch's token mean (see [Note: pipeline loss normalization]). False:
            by this replica's own count.

    Raises:
        ValueError: bad schedule/sizes, interleaved with ``m % pp != 0``, more stages than
            blocks, a bad ``tied`` or ``checkpointing``, ``split="time"`` without
            ``split_example`` — all before any communication.

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
        split_example: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        normalize_over_dp: bool = False,
    ) -> None:
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not (isinstance(checkpointing, bool) or checkpointing == "cpu"):
            raise ValueError(f"checkpointing must be False, True or 'cpu', got {checkpointing!r}")
        example = split_example if isinstance(split_example, tuple) else (split_example,)
        if split == "time" and not (0 < len(example) <= 2 and all(isinstance(t, torch.Tensor) for t in example)):
            raise ValueError(
                f"split='time' needs split_example= (the first block's input for one micro-batch, to time "
                f"the blocks on, or (input, target) to time the loss too), got {type(split_example).__name__}"
            )
        self.checkpointing = checkpointing
        self.normalize_over_dp = bool(normalize_over_dp)
        self.ctx, self.loss_fn, self.stats = ctx, loss_fn, stats
        self.group, self.rank, p = ctx.group("pp"), ctx.rank("pp"), ctx.size("pp")
        # [Note: receives ahead on gloo]: gloo matches by tag and its sends never block
        ahead = GLOO_RECV_AHEAD if p > 1 and dist.get_backend(self.group) == "gloo" else None
        self.schedule = build_schedule(
            schedule, num_ranks=p, microbatches=microbatches, virtual_stages=virtual_stages, recv_ahead=ahead
        )
        S = self.schedule.num_stages
        times = self._agreed_block_times(blocks, *example) if split == "time" else None
        plan = split_blocks(blocks, S, split, weights=times)
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
        self._stale_p2p = 0  # a failed step's transfers still in flight: [Note] in transfers.py
        self._loop_s = 0.0
        self._in_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._out_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        #: last step's actions on this rank, with start/end in seconds from the step's start and
        #: the time spent blocked on P2P (``wait``) recorded separately from compute.
        self.timeline: list[TimedAction] = []
        #: last step's per-micro-batch losses (same on every pp rank).
        self.microbatch_losses: list[float] = []
        #: ``(sum of token losses, token count)`` of the last step's (or evaluation's) batch on this
        #: rank, the same on every pp rank: context parallelism adds them over cp for the
        #: replica's loss ([Note: the loss over cp shards] in shardkit.parallel.context.sequence_loss)
        self.last_loss_sum_count: tuple[float, float] = (0.0, 0.0)

    # [Note: splitting by measured time]
    # split="time" weighs each block by its measured forward + backward seconds on one
    # micro-batch (measure_block_times) and takes the min-max contiguous partition, as "params"
    # does with parameter counts. Timings differ between ranks (noise, a busier host), yet every
    # rank must build the same stages or the P2P pattern deadlocks, and every dp/tp replica too
    # (the dp reduction pairs the same blocks across replicas). So each rank converts its times
    # to integer nanoseconds and they are summed over every mesh axis of size > 1 (pp, then dp,
    # then tp: one all-reduce each, the sum over the whole mesh). Integer sums are exact and
    # order-independent, so every rank partitions bitwise-identical weights (a float average
    # could differ in the last bit between ranks and flip a near-tie); the sum is the mean times
    # the world size, which does not change the argmin. Measuring costs (warmup + repeats)
    # forward/backward passes of the full model on every rank, once, at construction.
    def _agreed_block_times(
        self, blocks: nn.Sequential | Sequence[nn.Module], example: torch.Tensor, target: torch.Tensor | None = None
    ) -> list[int]:
        """Per-block nanoseconds summed over the mesh (the same list on every rank); collective
        over each mesh axis of size > 1. See [Note: splitting by measured time]."""
        loss_fn = None if target is None else self.loss_fn  # the last block's time includes the loss
        times = measure_block_times(as_block_list(blocks), example, loss_fn=loss_fn, target=target)
        total = torch.tensor([round(t * 1e9) for t in times], dtype=torch.int64, device=self.ctx.device)
        for axis in ("pp", "dp", "cp", "tp"):
            if self.ctx.size(axis) > 1:
                all_reduce(total, group=self.ctx.group(axis), op="sum", stats=self.stats)
        return total.tolist()

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
        total, count = evaluate_pipeline(
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
        self.last_loss_sum_count = (total, count)
        return total / count if count else float("nan")

    def close(self) -> None:
        """Release the process groups created for tied parameters (see
        :class:`~shardkit.parallel.pipeline.tied.TiedParameters`); the pipeline must not step
        afterwards. Idempotent; local."""
        self.tied.close()

    def held_blocks(self) -> nn.ModuleDict:
        """This rank's blocks keyed by block index: their ``state_dict`` keys are the unsplit
        ``nn.Sequential(*blocks)``'s (``"<block>.<name>"``), distinct across pp ranks.

        Example:
            >>> sorted(pipe.held_blocks())   # pp 2, 4 blocks, rank 1
            ['2', '3']
        """
        return nn.ModuleDict(
            {str(j): blk for s in sorted(self.stages) for j, blk in zip(self.stage_blocks[s], self.stages[s], strict=True)}
        )

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
            The token-weighted mean loss of the batch, on every pp rank. Gradients are *added*
            to ``param.grad`` of :meth:`parameters`; with ``normalize_over_dp`` and dp > 1 they
            are normalized by the count of the whole global batch, for the caller's average
            over dp (see [Note: pipeline loss normalization]).

        Raises:
            ValueError: on every rank, when any rank's inputs/targets are unusable or a stage
                cannot take its predecessor's output (see [Note: the shape exchange]);
                ``loss_scale`` not a finite number > 0 (before any communication).
            RuntimeError: on every rank, at the end of the step, when a stage's forward,
                backward or loss raised on any rank (see [Note: a stage failing mid-step] in
                :mod:`~shardkit.parallel.pipeline.transfers`); the next step can run. Also at
                the start of a step after one that failed in a transfer (see [Note: a failed
                step's transfers]).

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
        agree_step(self, x_mbs, y_mbs)
        state = StepState(x_mbs, y_mbs, m)
        state.loss_scale = None if loss_scale is None else float(loss_scale)
        if self._accumulate_in_grad:  # [Note: accumulating in param.grad]: the caller's grads aside
            state.set_aside_grads([q for qs in self._params.values() for q in qs])
        t0 = time.perf_counter()
        self.timeline = []
        xfer = StepTransfers(
            self.schedule,
            self.rank,
            state,
            group=self.group,
            stats=self.stats,
            in_meta=self._in_meta,
            out_meta=self._out_meta,
            device=self.ctx.device,
            timeline=self.timeline,
            t0=t0,
        )
        acts, n = self.schedule.actions[self.rank], 0
        try:
            while n < len(acts):
                if acts[n].kind in COMPUTE:
                    xfer.wait_for(acts[n])  # the lazy wait: [Note: posting receives ahead]
                    if self.stats is not None:
                        a = acts[n]
                        self.stats.set_phase(f"pipeline: {_COMPUTE_NAMES[a.kind]} of micro-batch {a.mb} on stage {a.stage}")
                    start = time.perf_counter()
                    try:
                        self._compute(acts[n], state)
                    except Exception as exc:  # noqa: BLE001 - every rank raises it from finalize
                        state.failure, state.cause = self._describe_failure(acts[n], exc), exc
                        xfer.drain(acts[n + 1 :], post)  # the peers must not wait for this rank
                        break
                    self.timeline.append(TimedAction(acts[n], start - t0, time.perf_counter() - t0))
                    n += 1
                    continue
                end = n  # a run of communication actions is posted together
                while end < len(acts) and acts[end].kind not in COMPUTE:
                    end += 1
                self.communicate(acts[n:end], xfer)
                n = end
            self._loop_s = time.perf_counter() - t0
            if state.failure is None:
                assert not state.outputs and not state.w_pending and not xfer.pending, "schedule left work undone"
                state.collect_grads()
            else:
                state.give_back_grads()
        except BaseException:
            state.give_back_grads()  # nothing of a failed step reaches the caller's grads
            self._stale_p2p = xfer.in_flight()
            raise
        loss = self.finalize(state)
        assert len(self.microbatch_losses) == m
        return loss

    def _describe_failure(self, a: Action, exc: Exception) -> str:
        """The error every pp rank raises when compute ``a`` raised ``exc`` on this rank."""
        blocks = self.stage_blocks[a.stage]
        return (
            f"pipeline step failed on pp rank {self.rank}: {a} (stage {a.stage}, blocks "
            f"{blocks.start}..{blocks.stop - 1}, micro-batch {a.mb}) raised {type(exc).__name__}: {exc}. "
            "Every pp rank raises this error; no gradient of the step reached param.grad and no "
            "transfer is left in flight, so the next step can run"
        )

    # ---- phases -------------------------------------------------------------------------------
    def _compute(self, a: Action, st: StepState) -> None:
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

    def forward(self, s: int, i: int, st: StepState) -> None:
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

    def backward(self, s: int, i: int, st: StepState, *, split: bool) -> None:
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
                gx, work = backward_input(y, x, g, params, accumulate=self._accumulate_in_grad)
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
            st.accumulate(self._params[s], got[1:] if want_x else got)
            if want_x:
                gx = got[0] if got[0] is not None else torch.zeros_like(x)
        if gx is not None:
            if (s - 1) % self.schedule.num_ranks == self.rank:
                st.grads[(s - 1, i)] = gx
            else:
                st.to_send[(Kind.SEND_B, s, i)] = gx

    def backward_weight(self, s: int, i: int, st: StepState) -> None:
        """ZB-H1's W: the weight gradients of stage ``s`` for micro-batch ``i``."""
        work = st.w_pending.pop((s, i))
        # checkpointed blocks: W's autograd calls (one per weight group) share one recomputation
        with GraphExecGroup() if self.checkpointing else nullcontext():
            grads = backward_weight(work, accumulate=self._accumulate_in_grad)  # clears work.captured
        if not self._accumulate_in_grad:
            st.accumulate(self._params[s], grads)

    def communicate(self, run: Sequence[Action], xfer: StepTransfers) -> None:
        """Post a run of consecutive sends/receives together, without waiting: each receive is
        waited by the compute consuming it, the sends in :meth:`finalize` (see
        :class:`~shardkit.parallel.pipeline.transfers.StepTransfers`)."""
        xfer.post(run, post)

    def finalize(self, st: StepState) -> float:
        """Wait for the sends; agree the step's outcome, per-micro-batch losses and counts over pp
        (one all-reduce; the losses and counts come from the last stage) and, with
        ``normalize_over_dp`` and dp > 1, the global count over dp (one more); add the accumulated gradients, normalized by that count
        (see [Note: pipeline loss normalization]), to ``param.grad``.

        Args:
            st: the step (``st.failure``: this rank's error message when one of its computes
                raised and its transfers were drained, else None).

        Raises:
            RuntimeError: on every rank, when a compute raised on any pp rank (of any dp replica,
                with ``normalize_over_dp``; see [Note: a stage failing mid-step] in :mod:`~shardkit.parallel.pipeline.transfers`).
            ValueError: on every rank, when the loss counted no token over the global batch.
        """
        with record_function("shardkit::pipeline_finalize"):
            for h in st.sends:
                h.wait()
            m, p, dev = self.schedule.microbatches, self.schedule.num_ranks, self.ctx.device
            # [sums (m), counts (m), failed flag per pp rank (p)]: an all-reduce rather than a
            # broadcast from the last stage, because any rank may have failed
            vec = torch.zeros(2 * m + p, dtype=torch.float64, device=dev)
            if st.failure is not None:
                vec[2 * m + self.rank] = 1
            elif self.is_last:
                vec[:m] = torch.stack([t.to(vec) for t in st.loss_sums])
                vec[m : 2 * m] = torch.stack([t.to(vec) for t in st.counts])
            all_reduce(vec, group=self.group, stats=self.stats)
            values = vec.tolist()
            sums, counts = values[:m], values[m : 2 * m]
            failed = [r for r in range(p) if values[2 * m + r]]
            total = norm = sum(counts)
            # every replica of the parameters: dp, and cp whose ranks hold other tokens of the same
            # sequences ([Note: the dp_cp group] in shardkit.comm.context)
            dp, failed_replicas = self.ctx.size("dp_cp") if self.normalize_over_dp else 1, 0.0
            if dp > 1:  # [Note: pipeline loss normalization]: the count of every dp replica's batch
                both = torch.tensor([total, float(bool(failed))], dtype=torch.float64, device=dev)
                all_reduce(both, group=self.ctx.group("dp_cp"), stats=self.stats)
                global_total, failed_replicas = both.tolist()
                norm = global_total / dp  # the caller's average over dp divides by dp once more
            if failed:  # [Note: a stage failing mid-step]: the first failed rank's message everywhere
                raise RuntimeError(
                    broadcast_text(st.failure or "", src=failed[0], rank=self.rank, group=self.group, device=dev)
                ) from st.cause
            if failed_replicas:
                raise RuntimeError(
                    "pipeline step failed on another dp replica (its pp ranks raise the reason); no gradient "
                    "of the step reached param.grad"
                )
            if norm <= 0:
                raise ValueError(f"the loss counted {norm * dp:g} tokens over the batch; loss_fn must count >= 1")
            self.tied.sync_grads(st.grad_acc)  # sum-form, before the division: see tied.py
            st.apply_grads(counts, m, norm)
            self.microbatch_losses = [a / c if c else float("nan") for a, c in zip(sums, counts, strict=True)]
            self.last_loss_sum_count = (sum(sums), total)
            return sum(sums) / total if total else float("nan")

    # ---- helpers ------------------------------------------------------------------------------
    def _chunks(self, name: str, t: Any) -> list[torch.Tensor] | str:
        m = self.schedule.microbatches
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            return f"{name} must be a tensor with a batch dim on this stage, got {type(t).__name__}"
        if t.shape[0] % m:
            return f"{name} batch size {t.shape[0]} must be a multiple of microbatches={m}"
        return list(t.to(self.ctx.device).chunk(m))
