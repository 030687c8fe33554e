"""Replicated parameters used on sequence shards: their gradients summed over tp, coalesced.

Under sequence parallelism (Korthikanti et al. 2022, §4; see ``docs/reference.md``, "Tensor
parallel") every tp rank applies the LayerNorms / RMSNorms — and adds the row-parallel biases — on
its own ``s/tp`` tokens, so each rank's gradient of those replicated parameters covers only its
tokens; the dense gradient is their sum over tp. Forgetting that sum lets the replicas drift
apart silently (Megatron, NeMo and gpt-neox have all shipped that bug), so shardkit's layers do it
themselves, inside autograd: no call for the user to remember.

[Note: one coalesced all-reduce per backward]
A :class:`SequenceParallelGrads` holds the parameters of every layer that shares it (a
:class:`SequenceParallelNorm`'s parameters, a sequence-parallel
:class:`~shardkit.parallel.tensor.RowParallelLinear`'s bias). The first time one of them is
used in a forward pass, one autograd node is created over *all* of them (identity forward); the
layers use its outputs instead of the parameters. The autograd engine runs a node once, after
the gradients of all its outputs have arrived — at the end of backward, since the first layer of
the forward pass is the last of the backward — so its backward sees every gradient at once:
it concatenates them (zeros for an output that got none), all-reduces the one flat buffer (one
per dtype) and hands each parameter its slice, which reaches ``.grad`` through the ordinary
``AccumulateGrad`` (so post-accumulate-grad hooks such as DataParallel's see the summed value,
and gradient accumulation over micro-batches sums correctly). A parameter whose output got no
gradient on this rank gets ``None``, as without tensor parallelism.

A "forward pass" ends when a parameter is asked for a second time (the next forward, or the
same layer called twice): a new node is then created. Only the number of all-reduces depends on
that guess, never the result: every node sums exactly the gradients that flow through it.
Without grad mode (evaluation) the parameters are used directly.

Each layer gets its own :class:`SequenceParallelGrads` when built (one all-reduce per layer);
:func:`share_sequence_parallel_grads` — called by
:func:`~shardkit.parallel.tensor.tensor_parallelize` — gives all the layers of a model one, so
the whole model costs one all-reduce per backward of the summed bytes.

[Note: sequence-parallel grads under ZeRO-3 and pipelines]
One node over the whole model assumes every parameter is materialized, in place, from the first
use to the end of backward. Two compositions break that, and get one node per *scope* instead
(``share_sequence_parallel_grads(..., scopes=...)``; ``parallelize`` does both):

* **ZeRO-3** re-points ``p.data`` at its gathered buffer just before each unit's forward and
  reduce-scatters the unit's gradients at the unit's post-backward. A model-wide node built at
  the first norm took views of the later units' placeholders, so their norms computed with
  stale values, and it delivered their gradients at the end of backward,
  after their reduce-scatter. With one scope per unit, a unit's node is built inside its forward
  (its params gathered) and runs in its backward before the unit's post-backward (it becomes ready
  with the unit's first layer's backward, like the unit's input node, and was created after it:
  the engine runs the later-created node first). Cost: one all-reduce per unit.
* **A pipeline** splits a model that ``tensor_parallelize`` converted whole: one node over every
  block made each pp rank all-reduce every stage's norms (zeros for the other stages') and kept
  the other stages' parameters alive. One scope per held stage sums this rank's
  parameters only, one all-reduce per stage and micro-batch.

Independently, :meth:`SequenceParallelGrads.use` starts a new node when a parameter no longer
points where the node's view does (``p.data`` replaced after the node was built): a view is
never handed out with values other than the parameter's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import CommStats, ParallelContext, all_reduce

__all__ = ["SequenceParallelGrads", "SequenceParallelNorm", "make_sequence_parallel_", "share_sequence_parallel_grads"]


class _CoalescedCopyToTP(torch.autograd.Function):
    """Identity on every parameter forward; one all-reduce (per dtype) of all their grads backward."""

    @staticmethod
    def forward(ctx: Any, sync: SequenceParallelGrads, round_id: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.sync, ctx.round_id = sync, round_id
        ctx.meta = [(p.shape, p.dtype, p.device) for p in params]
        ctx.set_materialize_grads(False)  # None marks a parameter that got no gradient here
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        sync = ctx.sync
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (_, dtype, _) in enumerate(ctx.meta):
            by_dtype.setdefault(dtype, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(grads)
        for dtype, idx in by_dtype.items():  # the buffer is the same on every rank: zeros for None
            shape0, _, device = ctx.meta[idx[0]]
            flat = torch.cat(
                [
                    (grads[i] if grads[i] is not None else torch.zeros(ctx.meta[i][0], dtype=dtype, device=device)).reshape(-1)
                    for i in idx
                ]
            )
            all_reduce(flat, group=sync.group, stats=sync.stats)
            offset = 0
            for i in idx:
                n = ctx.meta[i][0].numel()
                if grads[i] is not None:
                    out[i] = flat[offset : offset + n].view(ctx.meta[i][0])
                offset += n
        sync._backward_done(ctx.round_id)
        return (None, None, *out)


class SequenceParallelGrads:
    """The tp sum of the gradients of replicated parameters used on sequence shards, as one
    coalesced all-reduce per backward; see [Note: one coalesced all-reduce per backward].

    Layers call :meth:`use` on each such parameter in their forward and compute with what it
    returns. Build one per model and pass it to the layers (``grad_sync=``), or let
    :func:`share_sequence_parallel_grads` (called by ``tensor_parallelize``) do it.

    Args:
        group: the tp process group (``ctx.group("tp")``) the sum runs over.
        stats: optional CommStats recording the all-reduce.

    Example:
        >>> sync = SequenceParallelGrads(group=ctx.group("tp"))
        >>> ln1 = SequenceParallelNorm(nn.LayerNorm(512), ctx=ctx, grad_sync=sync)
        >>> ln2 = SequenceParallelNorm(nn.LayerNorm(512), ctx=ctx, grad_sync=sync)
        >>> ln2(ln1(x_seq)).sum().backward()       # one all-reduce of 4 * 512 floats
    """

    def __init__(self, *, group: dist.ProcessGroup, stats: CommStats | None = None) -> None:
        self.group = group
        self.stats = stats
        self._params: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self._views: tuple[torch.Tensor, ...] | None = None
        self._used: set[int] = set()
        self._round = 0

    @property
    def params(self) -> list[torch.Tensor]:
        """The registered parameters, in registration order (the flat buffer's layout)."""
        return list(self._params)

    def register(self, params: Iterable[torch.Tensor]) -> None:
        """Add parameters (idempotent). Registering before the first forward lets that forward
        coalesce them too; an unregistered parameter passed to :meth:`use` is added then."""
        for p in params:
            if id(p) not in self._index:
                self._index[id(p)] = len(self._params)
                self._params.append(p)
                self._views = None  # the next use builds a node that includes it

    def unregister(self, params: Iterable[torch.Tensor]) -> None:
        """Remove parameters (a layer that replaced its own); unknown ones are ignored."""
        drop = {id(p) for p in params}
        kept = [p for p in self._params if id(p) not in drop]
        if len(kept) != len(self._params):
            self._params, self._views = kept, None
            self._index = {id(p): i for i, p in enumerate(kept)}

    def use(self, p: torch.Tensor) -> torch.Tensor:
        """``p`` to compute with in this forward pass: a view whose gradient is summed over tp.

        Returns ``p`` itself when the tp group has one rank, when grad mode is off, or when ``p``
        does not require a gradient.
        """
        if self.group.size() == 1 or not torch.is_grad_enabled() or not p.requires_grad:
            return p
        self.register([p])
        i = self._index[id(p)]
        # a new forward pass, or p.data re-pointed since the node took its view (ZeRO-3's gather):
        # a new node ([Note: sequence-parallel grads under ZeRO-3 and pipelines])
        if self._views is None or i in self._used or not self._views[i].is_set_to(p):
            self._round += 1
            self._views = _CoalescedCopyToTP.apply(self, self._round, *self._params)
            self._used = set()
        self._used.add(i)
        return self._views[i]

    def _backward_done(self, round_id: int) -> None:
        if round_id == self._round:  # drop the views (and the graph they hold) of a finished pass
            self._views, self._used = None, set()


class SequenceParallelNorm(nn.Module):
    """Run a module with replicated parameters (LayerNorm, RMSNorm) on sequence shards.

    Under sequence parallelism each tp rank applies the norm to its own ``s/tp`` tokens, so each
    rank's weight gradient covers only those tokens; the true gradient is their sum, which this
    wrapper makes autograd compute (see [Note: one coalesced all-reduce per backward]) —
    forgetting it silently lets the ranks' replicas diverge. Parameters stay those of the
    wrapped module (``.module``).

    Args:
        module: the module to wrap (its parameters are replicated on every tp rank).
        ctx: the parallel context.
        stats: optional CommStats recording the gradient all-reduce (when ``grad_sync`` is
            not given).
        grad_sync: the :class:`SequenceParallelGrads` to join (default: one of its own, i.e. one
            all-reduce of this module's parameters per backward).

    Example:
        >>> ln = SequenceParallelNorm(nn.LayerNorm(512), ctx=ctx)
        >>> h = ln(x_seq)                                   # [b, s/tp, 512]
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        ctx: ParallelContext,
        stats: CommStats | None = None,
        grad_sync: SequenceParallelGrads | None = None,
    ) -> None:
        super().__init__()
        self.module, self.group, self.stats = module, ctx.group("tp"), stats
        self.grad_sync = grad_sync if grad_sync is not None else SequenceParallelGrads(group=self.group, stats=stats)
        self.grad_sync.register(module.parameters())

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are summed over tp (all of the wrapped module's)."""
        return list(self.module.parameters())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.group.size() == 1:
            return self.module(*args, **kwargs)
        params = {n: self.grad_sync.use(p) for n, p in self.module.named_parameters()}
        return torch.func.functional_call(self.module, params, args, kwargs)


class _SequenceParallelModule:
    """Mixed into a module's class by :func:`make_sequence_parallel_` (FSDP2's class-swap trick):
    its own forward runs on the :class:`SequenceParallelGrads` identities of its parameters, and
    its names, ``state_dict`` keys and ``isinstance`` checks stay those of the original class."""

    _sp_inside = False

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are summed over tp (all of the module's)."""
        return list(self.parameters())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sp_inside or self._sp_group.size() == 1:  # the original forward (see below)
            return super().forward(*args, **kwargs)
        params = {n: self.grad_sync.use(p) for n, p in self.named_parameters()}
        self._sp_inside = True  # functional_call calls this forward again: run the original one
        try:
            return torch.func.functional_call(self, params, args, kwargs)
        finally:
            self._sp_inside = False


def make_sequence_parallel_(
    module: nn.Module, *, ctx: ParallelContext, stats: CommStats | None = None, grad_sync: SequenceParallelGrads | None = None
) -> nn.Module:
    """Turn ``module`` (a LayerNorm, RMSNorm: replicated parameters) in place into one that runs
    on sequence shards with its gradients summed over tp — :class:`SequenceParallelNorm`'s
    behaviour without a wrapper, so parameter names and ``state_dict`` keys do not change (the
    TP plans use it; dense checkpoints load as they are).

    Args:
        module: the module (its class is swapped for a subclass; nothing is copied).
        ctx: the parallel context (the tp group).
        stats: optional CommStats for the gradient all-reduce.
        grad_sync: the :class:`SequenceParallelGrads` to join (default: its own).

    Returns:
        ``module``.

    Example:
        >>> ln = make_sequence_parallel_(nn.LayerNorm(512), ctx=ctx)
        >>> isinstance(ln, nn.LayerNorm), list(ln.state_dict())
        (True, ['weight', 'bias'])
    """
    if isinstance(module, _SequenceParallelModule):
        return module
    cls = type(module)
    module.__class__ = type(f"SequenceParallel{cls.__name__}", (_SequenceParallelModule, cls), {})
    module._sp_group = ctx.group("tp")
    module.grad_sync = grad_sync if grad_sync is not None else SequenceParallelGrads(group=module._sp_group, stats=stats)
    module.grad_sync.register(module.parameters())
    return module


def share_sequence_parallel_grads(
    model: nn.Module, *, stats: CommStats | None = None, scopes: Iterable[nn.Module] = ()
) -> list[SequenceParallelGrads]:
    """Give every sequence-parallel layer of ``model`` one :class:`SequenceParallelGrads` per tp
    group, so a backward pass costs one all-reduce (per dtype) for all their replicated
    parameters instead of one per layer. Idempotent; ``tensor_parallelize`` calls it.

    With ``scopes``, the layers inside each scope share one of their own instead (the innermost
    scope that holds a layer wins), registering only that scope's parameters: one all-reduce per
    scope and backward. ZeRO-3 units and pipeline stages need it: see [Note: sequence-parallel
    grads under ZeRO-3 and pipelines]. Calling it again regroups from scratch.

    A layer takes part if it has a ``grad_sync`` attribute and a ``replicated_parameters()``
    method (:class:`SequenceParallelNorm`, ``RowParallelLinear(sequence_parallel=True)``).

    Args:
        model: the model (modified in place; call it before the first forward pass).
        stats: CommStats for the shared all-reduce (default: the first layer's).
        scopes: submodules of ``model`` whose layers get their own shared object (default: none).

    Returns:
        The shared objects (empty when the model has no sequence-parallel layer), in the module
        order of their first layer.

    Raises:
        ValueError: a scope is not a submodule of ``model`` (before anything is changed).

    Example:
        >>> share_sequence_parallel_grads(block)      # 2 LayerNorms + 2 row biases: 1 all-reduce
        >>> share_sequence_parallel_grads(model, scopes=model.blocks)   # one per block
    """
    scope_ids = {id(s) for s in scopes}
    missing = scope_ids - {id(m) for m in model.modules()}
    if missing:
        raise ValueError(f"scopes must be submodules of the model; {len(missing)} of them are not")
    shared: dict[tuple[int, int], SequenceParallelGrads] = {}
    seen: set[int] = set()

    def visit(module: nn.Module, scope: int) -> None:
        if id(module) in seen:  # a module reachable twice is grouped once, by its first path
            return
        seen.add(id(module))
        scope = id(module) if id(module) in scope_ids else scope
        sync = getattr(module, "grad_sync", None)
        if isinstance(sync, SequenceParallelGrads):
            key = (scope, id(sync.group))
            if key not in shared:
                shared[key] = SequenceParallelGrads(group=sync.group, stats=stats or sync.stats)
            module.grad_sync = shared[key]
            shared[key].register(module.replicated_parameters())
        for child in module.children():
            visit(child, scope)

    visit(model, id(model))
    return list(shared.values())
