"""One pipeline step's point-to-point transfers on this rank: :class:`StepTransfers`.

Runs of consecutive sends/receives are posted together; a receive is waited lazily, right
before the compute that consumes it, and that blocked time is the receive's ``wait`` in
``PipelineParallel.timeline`` (see [Note: posting receives ahead] in
:mod:`~shardkit.parallel.pipeline.schedules`); sends are waited at the end of the step.

[Note: a failed step's transfers]
A step that raises part-way (a stage's exception, a timed-out receive) can leave transfers in
flight: receives posted ahead and never waited, sends the peer never took. Their tags are
(stage, micro-batch, direction), the same every step, and NCCL matches by posting order
anyway, so the next step's transfers would meet them: a stale activation consumed as a fresh
one, or a receive that never completes. Nothing can withdraw a posted P2P operation, so the
executor counts them (:meth:`StepTransfers.in_flight`, conservatively: a send not yet known
complete counts) and the next step's agreement all-reduce, before any P2P, raises the same
``RuntimeError`` on every rank instead of running; a new ``ParallelContext`` (new process
groups) starts clean. A failure that leaves nothing in flight (inputs rejected by the
agreement, a stage failing before it posts anything) does not block the next step.

[Note: a stage failing mid-step]
An exception in one rank's compute (a block's forward or backward, the loss) must not leave its
peers blocked in receives that will never complete, until the group's timeout. So the failing
rank does not stop its transfers: :meth:`StepTransfers.drain` posts the rest of its schedule's
runs, in order and grouped as the schedule posts them (NCCL's in-order matching is kept), each
send carrying zeros of the announced shape, and waits for every transfer of the step. Its peers
see nothing unusual: they finish the step computing on those zeros (the failed step costs one
step's time; its gradients are dropped everywhere). The outcome travels in the step's closing
all-reduce (``PipelineParallel.finalize``), which has to run anyway for the losses and counts,
so a step that succeeds pays nothing per action and no message more: every pp rank then raises
the same ``RuntimeError`` naming the failed rank, action and exception (broadcast from that
rank), no gradient of the step reaches ``param.grad``, and since every transfer was matched the
next step runs as usual. A transfer that fails itself (a receive timing out, a peer gone) cannot
be drained: that is [Note: a failed step's transfers].
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardkit.comm import CommHandle, CommStats

from .actions import COMPUTE, SENDS, Action, Kind, Schedule, TimedAction
from .p2p import p2p_tag, post
from .step_state import StepState

__all__ = ["StepTransfers"]

Meta = tuple[torch.Size, torch.dtype]
PostFn = Callable[..., list[CommHandle]]


class StepTransfers:
    """Posts this rank's runs of sends/receives for one step and hands each received tensor to
    the step state when the compute consuming it asks for it.

    Args:
        schedule, rank: the schedule and this rank's pp index.
        st: the step's :class:`~shardkit.parallel.pipeline.step_state.StepState` (``to_send``
            is read; received tensors land in ``acts``/``grads``; send handles in ``sends``).
        group, stats: the pp process group and optional :class:`~shardkit.comm.CommStats`.
        in_meta, out_meta: per stage, ``(shape, dtype)`` of its input and output (from the
            shape exchange): the receive buffers' layout.
        device: where receive buffers live.
        timeline: the step's timeline, appended in action order; a receive's entry is completed
            when it is waited. ``t0``: the step's start (``time.perf_counter()``).

    Example:
        >>> xfer = StepTransfers(sched, 1, st, group=g, stats=None, in_meta=im, out_meta=om,
        ...                      device=dev, timeline=tl, t0=time.perf_counter())
        >>> xfer.post([Action(Kind.RECV_F, 1, 0)])   # posted, not waited
        >>> xfer.wait_for(Action(Kind.F, 1, 0))      # st.acts[(1, 0)] now holds the activation
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        st: StepState,
        *,
        group: dist.ProcessGroup,
        stats: CommStats | None,
        in_meta: dict[int, Meta],
        out_meta: dict[int, Meta],
        device: torch.device,
        timeline: list[TimedAction],
        t0: float,
    ) -> None:
        self.schedule, self.rank, self.st = schedule, rank, st
        self.group, self.stats, self.device = group, stats, device
        self.in_meta, self.out_meta = in_meta, out_meta
        self.timeline, self.t0 = timeline, t0
        #: posted receives not yet waited: receive -> (handle, index in the timeline)
        self.pending: dict[Action, tuple[CommHandle, int]] = {}

    def post(self, run: Sequence[Action], post_fn: PostFn = post) -> None:
        """Post a run of consecutive sends/receives together (one ``batch_isend_irecv`` when
        there are several, so facing send/recv pairs cannot block each other on NCCL); nothing
        is waited here. ``post_fn`` posts the ``(op, tensor, peer, tag)`` list
        (:func:`~shardkit.parallel.pipeline.p2p.post`; the executor passes its own reference)."""
        p, S, st = self.schedule.num_ranks, self.schedule.num_stages, self.st
        ops: list[tuple[str, torch.Tensor, int, int]] = []
        with record_function("shardkit::pipeline_communicate"):
            for a in run:
                back = a.kind in (Kind.SEND_B, Kind.RECV_B)
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    tag = p2p_tag(a.stage, a.mb, back, S)
                    ops.append(("send", st.to_send.pop((a.kind, a.stage, a.mb)), (a.stage + (-1 if back else 1)) % p, tag))
                else:
                    peer = a.stage + (1 if back else -1)
                    shape, dtype = self.out_meta[a.stage] if back else self.in_meta[a.stage]
                    buf = torch.empty(shape, dtype=dtype, device=self.device)
                    ops.append(("recv", buf, peer % p, p2p_tag(peer, a.mb, back, S)))
            posted = time.perf_counter() - self.t0
            for a, h in zip(run, post_fn(ops, group=self.group, stats=self.stats), strict=True):
                if h.op == "send":
                    st.sends.append(h)
                else:
                    self.pending[a] = (h, len(self.timeline))
                self.timeline.append(TimedAction(a, posted, posted))

    def wait_for(self, a: Action) -> None:
        """Before compute ``a``: wait for the receive it consumes, if any, and record the time
        blocked as that receive's ``wait``."""
        recv = self.schedule.receive_for(a)
        if recv is None:
            return
        h, n = self.pending[recv]
        if self.stats is not None:  # the heartbeat's phase label while blocked here
            back = recv.kind is Kind.RECV_B
            peer = recv.stage + (1 if back else -1)
            what = "gradient" if back else "activation"
            self.stats.set_phase(f"pipeline: receive of micro-batch {recv.mb}'s {what} from stage {peer}")
        with record_function("shardkit::pipeline_wait"):
            start = time.perf_counter()
            h.wait()  # a receive that times out stays pending: see in_flight
            done = time.perf_counter()
        del self.pending[recv]
        (self.st.grads if recv.kind is Kind.RECV_B else self.st.acts)[(recv.stage, recv.mb)] = h.output
        self.timeline[n] = TimedAction(recv, self.timeline[n].start, done - self.t0, done - start)

    def drain(self, rest: Sequence[Action], post_fn: PostFn) -> None:
        """After a compute of this rank raised: post the rest of its transfers (``rest``: the
        actions after the failed compute), in the schedule's runs, every send carrying zeros of
        the announced shape, then wait for every receive and send of the step, so no peer blocks
        on this rank and nothing is left in flight (see [Note: a stage failing mid-step]).
        ``post_fn`` as in :meth:`post`.

        Raises:
            CommTimeoutError: a transfer did not complete (it then stays counted by :meth:`in_flight`).
        """
        n = 0
        while n < len(rest):
            if rest[n].kind in COMPUTE:  # skipped: the peers only need this rank's messages
                n += 1
                continue
            end = n
            while end < len(rest) and rest[end].kind not in COMPUTE:
                end += 1
            for a in rest[n:end]:
                if a.kind in SENDS:  # SEND_F carries stage a's output, SEND_B the gradient of its input
                    shape, dtype = self.out_meta[a.stage] if a.kind is Kind.SEND_F else self.in_meta[a.stage]
                    self.st.to_send[(a.kind, a.stage, a.mb)] = torch.zeros(shape, dtype=dtype, device=self.device)
            self.post(rest[n:end], post_fn)
            n = end
        for recv in list(self.pending):
            self.pending[recv][0].wait()
            del self.pending[recv]
        for h in self.st.sends:
            h.wait()

    def in_flight(self) -> int:
        """Transfers of this step that a later step could still match, after a failure: receives
        posted and not waited (or whose wait failed) and sends not known to be complete. Their
        tags repeat every step, and NCCL matches by order, so the pp group must not run another
        step while any exists (see [Note: a failed step's transfers])."""
        return len(self.pending) + sum(not h.is_completed() for h in self.st.sends)
