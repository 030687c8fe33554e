"""ZeRO stage 3: parameters sharded, gathered per unit just before use, freed after.

One step, top-down (FSDP2's ``FSDPParamGroup`` phases, each under ``shardkit::<phase>``):

1. The root module's forward starts (a forward pre-hook on the model itself, so that
   ``sdp(x)``, ``sdp.module(x)`` and ``sdp.module.generate(...)`` all take this path): the root
   unit (the params no other unit owns: embeddings, final norm, head) is all-gathered and stays
   gathered until the end of backward (under ``no_grad``: until the end of the root's forward).
2. ``pre_forward(unit)`` (a forward pre-hook on the unit's module): all-gather the unit unless
   it was prefetched, *then* (``forward_prefetch=True``) start the all-gather of the unit that
   followed it in the last forward (prefetch, async), then wait for this unit's. Its params are views of the gathered
   flat buffers ([Note: gathering into autograd's saved tensors]). Its inputs that require grad
   pass through an identity autograd node whose backward is the unit's post-backward.
3. ``post_forward(unit)``: free the unit's full buffers (unless ``reshard_after_forward=False``)
   and hook its outputs (``register_multi_grad_hook``) so that its backward is announced.
4. ``pre_backward(unit)`` (the first gradient reaching the unit's outputs): gather it again
   and prefetch the unit that precedes it in the forward order — the next one in backward.
5. ``post_backward(unit)`` (the identity node on its inputs: every node of the unit ran): pack
   its grads — zeros for a param that got none on this rank — and reduce-scatter each of its
   buckets into the persistent fp32 ``[shard]`` gradient (stage 2's path), then free its full
   buffers ([Note: stage-3 reduce-scatter points]).
6. ``finalize_backward``: reduce-scatter the buckets of units whose post-backward did not run
   (the root; units with a call whose inputs need no grad), in bucket order, wait,
   free every unit still gathered (the root, units with frozen params). The step epilogue, clip
   and optimizer are stage 2's, on the shards; after the step the fp32 masters are written back
   into the persistent param shards — the next forward's gathers replace stage 1/2's all-gather.

Communication per step: all-gather Ψ (forward) + all-gather Ψ (backward) + reduce-scatter Ψ =
3Ψ (docs/reference.md "ZeRO memory and communication"); the root unit is gathered once (its Ψ
counts once in the all-gathers), and ``reshard_after_forward=False`` saves the backward gathers
(2Ψ, at the memory of every unit gathered from forward to its backward).

[Note: stage-3 gather order]
Every rank must issue the same collectives in the same order: gloo and NCCL match collectives
by their position in the group's sequence, so if rank 0 gathers unit 3 while rank 1 gathers
unit 4 they either deadlock or silently swap buffers of equal size. Gathers are therefore issued
only from points every rank reaches in the same order — the pre-forward hooks (forward runs the
same modules on every rank), the pre-backward hooks (autograd runs the same graph) — and what
to prefetch is decided from data every rank has alike: the unit sequence of the *previous*
forward, recorded in ``pre_forward`` (forward and backward) and this forward's sequence
reversed (backward). The order cannot be taken from registration order (a model may call its
blocks in another order, or one block twice) nor decided as gathers complete (completion order
differs per rank). A model whose control flow differs between ranks (a data-dependent skip of a
block on one rank) is not supported by ZeRO-3 on any framework (control flow inside a unit is:
an MoE layer inside a block). The reduce-scatters follow the same rule: [Note: stage-3
reduce-scatter points].

[Note: stage-3 reduce-scatter points]
A bucket's reduce-scatter goes on the same group as the unit gathers, so it must be issued at
the same point of that sequence on every rank. "When the bucket's grads are complete" (the
reducer's rule for stages 1-2, where nothing else is issued during backward) is not such a
point: a param that gets no gradient on one rank only (an MoE expert no token reached there)
leaves its bucket incomplete there until the end of backward, while the other ranks launch it
between two gathers — the collectives pair up wrongly and every rank times out. As FSDP2 does,
a unit's buckets are launched at the unit's post-backward instead: an identity autograd node on
its forward inputs, whose backward runs once every node between the unit's inputs and outputs
ran (so every gradient of its params was accumulated: ``AccumulateGrad`` runs as soon as its
inputs are ready). It is a point of the graph, the same on every rank; a param without a
gradient there contributes zeros. Units whose post-backward is not exact — no input requires
grad, or a call whose inputs did not (a unit called twice, once on the raw input), or a
backward over a graph kept from before — and the root (gathered throughout) are launched at
the end of backward, in bucket order. A gradient that still arrives after its unit's launch
(a param the unit owns but that a node outside the unit's input-to-output path uses) raises a
``RuntimeError`` instead of being silently dropped; leave that module out of the units (``wrap``)
so that its params live in the root unit.

[Note: why the forward order is recorded]
A prefetch must be issued *before* the unit that needs it starts, i.e. before the hooks know
which module runs next. Registration order is a guess; the previous forward's order is exact
for models whose forward is the same every step, costs nothing to record, and adapts when it
changes (one step runs with a useless prefetch, freed at the end of backward). Backward's order
is this forward's sequence reversed, so its prefetches are exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves

from ..reducer import GradBucket, GradReducer
from .sharded_bucket import ShardedBucket
from .stage3_shards import Stage3Shards
from .units import UnitSpec, select_units, unit_buckets

__all__ = ["ShardUnits"]


class _Unit:
    """One unit's runtime state: its buckets and whether they are gathered."""

    def __init__(self, spec: UnitSpec, buckets: list[ShardedBucket], frozen: list[ShardedBucket], root: bool) -> None:
        self.name, self.module, self.root = spec.name, spec.module, root
        self.trainable = buckets
        self.buckets = buckets + frozen
        self.last_bucket = max((sb.grad_bucket.index for sb in buckets), default=None)
        self.has_frozen = bool(frozen)
        self.gathered = False  # full buffers allocated (gathered or being gathered)
        self.works: list[Any] = []
        # since the last backward ended: forward calls whose inputs carry the post-backward node
        # (minus the nodes that ran), and grad-mode calls whose inputs could not carry it
        self.post_pending = 0
        self.unhooked = 0


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward is the unit's post-backward
    ([Note: stage-3 reduce-scatter points])."""

    @staticmethod
    def forward(ctx: Any, units: ShardUnits, unit: _Unit, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.units, ctx.unit = units, unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.units._post_backward(ctx.unit)
        return (None, None, *grads)


def _grad_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors requiring grad in ``obj``, looking into plain tuples, lists and dicts only (a
    custom container, e.g. a KV cache, is never rebuilt; its tensors are simply not hooked)."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            yield obj
    elif type(obj) in (tuple, list):
        for x in obj:
            yield from _grad_tensors(x)
    elif type(obj) is dict:
        for x in obj.values():
            yield from _grad_tensors(x)


def _replace_grad_tensors(obj: Any, new: Iterator[torch.Tensor]) -> Any:
    """``obj`` with each tensor :func:`_grad_tensors` yields replaced by the next of ``new``."""
    if isinstance(obj, torch.Tensor):
        return next(new) if obj.requires_grad else obj
    if type(obj) in (tuple, list):
        return type(obj)(_replace_grad_tensors(x, new) for x in obj)
    if type(obj) is dict:
        return {k: _replace_grad_tensors(x, new) for k, x in obj.items()}
    return obj


class ShardUnits:
    """The stage-3 runtime: units, their hooks, prefetch, and the reducer they share.

    Args:
        module: the model (its params become views of the units' flat buffers).
        wrap: the units (see :func:`~shardkit.parallel.zero.units.select_units`).
        reshard_after_forward: free each unit after its forward (True) or keep it until its
            backward is over (False: no backward all-gather, more memory).
        bucket_mb: bucket capacity in MiB inside a unit.
        **shard_kwargs: :class:`Stage3Shards` arguments (group, rank, size, grad_dtype, ...).

    Attributes:
        shards: the :class:`Stage3Shards` (``.buckets``: every trainable bucket, launch order).
        reducer: the :class:`~shardkit.parallel.reducer.GradReducer` over those buckets.
        units: root unit first, then the others in module order.

    Example:
        >>> units = ShardUnits(model, wrap=None, reshard_after_forward=True, bucket_mb=25,
        ...                    group=dp, rank=r, size=n, stage=3, grad_dtype=torch.float32,
        ...                    stats=CommStats())
        >>> out = model(x)     # the hooks gather each unit around its forward, free it after
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        wrap: Any,
        reshard_after_forward: bool,
        bucket_mb: float,
        check_sync: bool = False,
        forward_prefetch: bool = False,
        on_abandon: Callable[[], None] | None = None,
        **shard_kwargs: Any,
    ) -> None:
        specs = select_units(module, wrap)
        self._on_abandon = on_abandon
        self.check_sync = check_sync
        self.forward_prefetch = forward_prefetch
        self.reshard_after_forward = reshard_after_forward
        # launch order: the reverse of module order (backward's), the root last: it holds the
        # first-used params (embeddings) whose grads come last
        launch_order = specs[1:][::-1] + specs[:1]
        trainable, frozen, owner_t, owner_f = [], [], [], []
        for spec in launch_order:
            unit_trainable, unit_frozen = unit_buckets(spec, bucket_mb=bucket_mb)
            for buckets, out, owner in ((unit_trainable, trainable, owner_t), (unit_frozen, frozen, owner_f)):
                out.extend(buckets)
                owner.extend([spec] * len(buckets))
        self.shards = Stage3Shards(trainable, frozen, check_sync=check_sync, **shard_kwargs)
        self.units = [
            _Unit(
                spec,
                [sb for sb, o in zip(self.shards.buckets, owner_t) if o is spec],
                [sb for sb, o in zip(self.shards.frozen, owner_f) if o is spec],
                root=i == 0,
            )
            for i, spec in enumerate(specs)
        ]
        self.root = self.units[0]
        self._unit_of = {sb.grad_bucket.index: u for u in self.units for sb in u.buckets if sb.grad_bucket.index >= 0}
        # the reducer watches the grads and ends backward; the reduce-scatters are issued at the
        # units' post-backward or by the first finish ([Note: stage-3 reduce-scatter points])
        self.reducer = GradReducer(
            [sb.grad_bucket for sb in self.shards.buckets],
            launch=lambda gb: None,
            finish=self._finish,
            on_ready=self._grad_ready,
            on_finalize=self._finalize_backward,
        )
        self._launched: set[int] = set()  # buckets reduce-scattered in this backward
        if self.shards.sync is not None:  # name units in the error; frozen-only models: their device
            self.shards.sync.name_of = self._sync_name
            any_sb = (self.shards.buckets or self.shards.frozen)[:1]
            self.shards.sync.device = any_sb[0].flat_param.device if any_sb else self.shards.sync.device
        self._handles = [
            module.register_forward_pre_hook(lambda m, a: self._root_pre_forward(), prepend=True),
            module.register_forward_hook(lambda m, a, out: self._root_post_forward(out)),
        ]
        for u in self.units[1:]:
            self._handles.append(
                u.module.register_forward_pre_hook(
                    lambda m, a, kw, u=u: self._unit_pre_forward(u, a, kw), prepend=True, with_kwargs=True
                )
            )
            self._handles.append(u.module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out)))
        self._owner = owner = self.unit_of_param()
        for m in module.modules():  # every module holding a sharded param directly, at any depth
            held = [p for p in m.parameters(recurse=False) if p in owner]
            if held:
                hook = lambda m, prefix, keep_vars, held=held: self._guard_state_dict(m, held, keep_vars)  # noqa: E731
                self._handles.append(m.register_state_dict_pre_hook(hook))
        self._last_order: list[_Unit] = []  # the previous forward's unit sequence ([Note: why ...])
        self._order: list[_Unit] = []  # this forward's
        self._bwd_cursor = 0
        #: every unit gather issued, in order: ``(unit name, "forward" | "backward" | "prefetch")``
        self.gather_log: list[tuple[str, str]] = []

    # ---- gather / free -----------------------------------------------------------------------
    def _unshard(self, unit: _Unit, why: str) -> None:
        if unit.gathered or not unit.buckets:
            return
        if self.shards.sync is not None:  # [Note: diverged ranks] (sync_check.py)
            self.shards.sync.check("unit all-gather", self.units.index(unit), why)
        if self.shards.stats is not None:  # the heartbeat's phase label
            self.shards.stats.set_phase(f"{why}: all-gather of unit {unit.name!r}")
        with record_function("shardkit::all_gather"):
            unit.works = [self.shards.gather(sb) for sb in unit.buckets]
        unit.gathered = True
        self.gather_log.append((unit.name, why))

    def _sync_name(self, kind: str, index: int) -> str:
        if kind == "unit all-gather":
            return f"unit {self.units[index].name!r}"
        unit = self._unit_of.get(index)
        return f"bucket {index}" + (f" (unit {unit.name!r})" if unit is not None else "")

    @staticmethod
    def _wait(unit: _Unit) -> None:
        for work in unit.works:
            work.wait()
        unit.works = []

    def _reshard(self, unit: _Unit, *, keep_secondary: bool = False) -> None:
        if not unit.gathered:
            return
        self._wait(unit)  # a collective may still write the buffer: never free it in flight
        for sb in unit.buckets:
            self.shards.free(sb, keep_secondary=keep_secondary)  # [Note: hierarchical gathers]
        unit.gathered = False

    def reshard_all(self) -> None:
        """Free every gathered unit (waiting for gathers in flight first)."""
        for unit in self.units:
            self._reshard(unit)

    # ---- phases ------------------------------------------------------------------------------
    def _root_pre_forward(self) -> None:
        """The model's forward starts (a hook on the root module: ``sdp(x)`` and direct calls of
        ``sdp.module`` alike): discard a backward that raised, gather the root unit."""
        raised = self.reducer.pending  # [Note: a backward that raised] in parallel/reducer.py
        self.reducer.pre_forward()
        if raised:  # collectives may have been issued whatever the reducer launched itself
            self.reshard_all()
            self.shards.drop_secondary()  # before abandon(), which zeroes the transient count
            self.shards.abandon()
            self._end_backward()
            if self._on_abandon is not None:
                self._on_abandon()
        self.reshard_all()  # a forward without backward (reshard_after_forward=False) left some
        self.shards.drop_secondary()  # nor may its secondary shards serve this forward's backward
        self._last_order, self._order = self._order or self._last_order, []
        self._pre_forward(self.root)

    def _root_post_forward(self, out: Any) -> None:
        self.reducer.post_forward()
        self._post_forward(self.root, out)

    def _unit_pre_forward(self, unit: _Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Gather the unit, and route its inputs through its post-backward node (grad mode, not
        an activation-checkpoint recompute inside backward)."""
        self._pre_forward(unit)
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return None
        tensors = list(_grad_tensors((args, kwargs)))
        if not tensors:  # nothing to hook: this call's backward is over only at the end of backward
            unit.unhooked += 1
            return None
        unit.post_pending += 1
        return _replace_grad_tensors((args, kwargs), iter(_PostBackward.apply(self, unit, *tensors)))

    def _pre_forward(self, unit: _Unit) -> None:
        with record_function("shardkit::pre_forward"):
            pos = len(self._order)
            self._order.append(unit)
            self._unshard(unit, "forward")
            # [Note: stage-3 gather order]: the next unit of the previous forward, issued after
            # this unit's own gather on every rank
            if self.forward_prefetch and pos + 1 < len(self._last_order):
                self._unshard(self._last_order[pos + 1], "prefetch")
            self._wait(unit)

    def _post_forward(self, unit: _Unit, out: Any) -> None:
        with record_function("shardkit::post_forward"):
            grad = torch.is_grad_enabled()
            if not grad or (self.reshard_after_forward and not unit.root):
                self._reshard(unit, keep_secondary=grad)  # a backward will gather it again
            if not grad:
                if unit.root:
                    self.reshard_all()
                return
            tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, lambda *_: self._pre_backward(unit), mode="any")
            elif not unit.root and unit.last_bucket is not None and self.reshard_after_forward:
                # the unit's params are freed now and nothing would gather them before the
                # backward nodes that saved them run (a crash reading a 0-byte storage)
                raise ValueError(
                    f"ShardedDataParallel(stage=3): unit {unit.name!r} returned a {type(out).__name__} in which "
                    "no tensor requires grad, so its backward cannot be hooked to gather its parameters "
                    "again. Return tensors (or tuples/lists/dicts of them), register the output type "
                    "with torch.utils._pytree (e.g. register_dataclass), or pass reshard_after_forward=False"
                )
            if unit.root:
                self._bwd_cursor = len(self._order)

    def _pre_backward(self, unit: _Unit) -> None:
        with record_function("shardkit::pre_backward"):
            self._unshard(unit, "backward")
            order = self._order
            if unit.root:  # the output of the whole model: backward starts with the last unit
                nxt = len(order) - 1
            else:  # this unit's last call before the cursor; the one before it runs next
                at = [i for i in range(min(self._bwd_cursor, len(order))) if order[i] is unit]
                nxt = at[-1] - 1 if at else -1
                if at:
                    self._bwd_cursor = at[-1]
            if nxt >= 0 and order[nxt] is not unit:
                self._unshard(order[nxt], "prefetch")
            self._wait(unit)

    def _post_backward(self, unit: _Unit) -> None:
        """One of the unit's post-backward nodes ran; after the last one (of every call since the
        last backward) reduce-scatter its buckets and free it ([Note: stage-3 reduce-scatter points])."""
        with record_function("shardkit::post_backward"):
            unit.post_pending -= 1
            if unit.post_pending != 0 or unit.unhooked:  # another call's backward is still to run
                return
            self._launch(unit.trainable)
            # Frozen params may still be read by a later node: such units (and the root) stay
            # gathered until finalize_backward
            if not unit.root and not unit.has_frozen:
                self._reshard(unit)

    def _launch(self, buckets: list[ShardedBucket]) -> None:
        for sb in buckets:
            if sb.grad_bucket.index not in self._launched:
                self._launched.add(sb.grad_bucket.index)
                with record_function("shardkit::reduce_scatter"):
                    self.shards.launch(sb.grad_bucket)

    def _grad_ready(self, gb: GradBucket, j: int) -> None:
        """The reducer's per-grad callback: a grad after its bucket's reduce-scatter would be lost."""
        if gb.index in self._launched:
            unit = self._unit_of[gb.index]
            raise RuntimeError(
                f"ShardedDataParallel(stage=3): a parameter of unit {unit.name!r} got its gradient after the "
                "unit's backward ended and its gradients were reduce-scattered (a node outside the unit's "
                "input-to-output path uses it). Exclude that module from the units (wrap=...) so that its "
                "params live in the root unit"
            )

    def _finish(self, gb: GradBucket, work: Any) -> None:
        """The reducer's finish (end of backward, bucket order): the first call reduce-scatters
        every bucket no post-backward launched, in bucket order, then each waits for its bucket."""
        if len(self._launched) < len(self.shards.buckets):
            self._launch(self.shards.buckets)
        self.shards.finish(gb, work)

    def _finalize_backward(self) -> None:
        self.reshard_all()
        self.shards.drop_secondary()  # a unit whose backward did not gather it (no grad reached it)
        self._end_backward()

    def _end_backward(self) -> None:
        self._launched.clear()
        for unit in self.units:
            unit.post_pending = unit.unhooked = 0

    # ---- state -------------------------------------------------------------------------------
    def _guard_state_dict(self, module: nn.Module, held: list[nn.Parameter], keep_vars: bool) -> None:
        """``state_dict()`` of the model or of any submodule, outside its forward, would copy the
        freed params' placeholders (zeros of the right shapes, which load without complaint):
        refuse it and point at the gather. Gathering here instead would be a collective that a
        rank-0-only save never completes. ``keep_vars=True`` (the Parameter objects themselves,
        as the gather and the checkpoint code read them) stays allowed."""
        if keep_vars or all(self._owner[p].gathered for p in held):
            return
        raise RuntimeError(
            f"ShardedDataParallel(stage=3): {type(module).__name__}.state_dict() would read parameters "
            "that are freed outside forward (only this rank's shard is kept). Use sdp.full_state_dict() "
            "(collective: every rank calls it; rank0_only=True to keep the copy on rank 0 only; select a "
            "submodule's entries by their key prefix) or shardkit.parallel.save_checkpoint"
        )

    def unit_of_param(self) -> dict[nn.Parameter, _Unit]:
        """Every sharded parameter -> its unit."""
        return {p: u for u in self.units for sb in u.buckets for p in sb.grad_bucket.params}

    @torch.no_grad()
    def full_state_dict(self, module: nn.Module, want: bool) -> dict[str, torch.Tensor]:
        """Gather unit by unit (every rank, same order) and copy the full tensors (if ``want``)."""
        tensors = module.state_dict(keep_vars=True)
        owner = self.unit_of_param()
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            was = unit.gathered
            self._unshard(unit, "state_dict")
            self._wait(unit)
            if want:
                out.update({k: t.detach().clone() for k, t in tensors.items() if owner.get(t) is unit})
            if not was:
                self._reshard(unit)
        if not want:
            return {}
        return {k: out[k] if k in out else t.detach().clone() for k, t in tensors.items()}

    @torch.no_grad()
    def load_full_state_dict(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Write each full tensor's piece into this rank's shards (no communication)."""
        tensors = module.state_dict(keep_vars=True)
        missing, unexpected = sorted(set(tensors) - set(state)), sorted(set(state) - set(tensors))
        if missing or unexpected:
            raise ValueError(f"state: missing keys {missing}, unexpected keys {unexpected}")
        where = {}
        for sb in self.shards.buckets + self.shards.frozen:
            for seg in sb.segments:
                where.setdefault(sb.grad_bucket.params[seg.index], []).append((sb, seg))
        owner = self.unit_of_param()
        for k, t in tensors.items():
            if tuple(state[k].shape) != tuple(t.shape):
                raise ValueError(f"state[{k!r}]: shape {tuple(state[k].shape)}, the module's is {tuple(t.shape)}")
            if t not in owner:
                t.detach().copy_(state[k])
                continue
            src = state[k].detach().reshape(-1)
            for sb, seg in where.get(t, []):
                dst = sb.param_shard.narrow(0, seg.flat_offset - sb.start, seg.numel)
                dst.copy_(src.narrow(0, seg.tensor_offset, seg.numel))
        self.shards.refresh_master()

    @contextlib.contextmanager
    def gathered(self, params: Iterable[nn.Parameter], src: int | None) -> Iterator[None]:
        """Keep the units that hold ``params`` gathered inside the block (collective: every rank
        names the same params), then free the ones this opened.

        With ``src`` (a rank of the dp group), a block that ends without an exception broadcasts
        ``src``'s values of ``params`` over the dp group and writes them into every rank's shards
        and their fp32 masters. The write is exact: fp32 widens bf16/fp16 exactly. The other
        elements of the masters keep their precision.

        Example:
            >>> with units.gathered([model.head.weight], src=0):
            ...     if dp_rank == 0:
            ...         model.head.weight.zero_()       # every rank's shard is 0 afterwards
        """
        wanted = {p for p in params if p in self._owner}
        units = [u for u in self.units if any(self._owner[p] is u for p in wanted)]  # module order: the same everywhere
        opened = [u for u in units if not u.gathered]
        for unit in units:
            self._unshard(unit, "gathered")
            self._wait(unit)
        try:
            yield
            if src is not None:
                self._write_back(wanted, src)
        finally:
            for unit in opened:
                self._reshard(unit)

    @torch.no_grad()
    def _write_back(self, wanted: set[nn.Parameter], src: int) -> None:
        group = self.shards.group
        root = dist.get_global_rank(group, src) if group is not None else src
        self.shards.host_writable()  # offload_params: no staging copy still reads the host shards
        seen: set[nn.Parameter] = set()
        for sb in self.shards.buckets + self.shards.frozen:  # the same order on every rank
            for p in sb.grad_bucket.params:
                if p in wanted and p not in seen:
                    seen.add(p)
                    if self.shards.size > 1:
                        dist.broadcast(p.data, src=root, group=group)
            for seg in sb.segments:
                p = sb.grad_bucket.params[seg.index]
                if p not in wanted:
                    continue
                piece = p.data.reshape(-1).narrow(0, seg.tensor_offset, seg.numel)
                at = seg.flat_offset - sb.start
                sb.local_param_shard().narrow(0, at, seg.numel).copy_(piece)
                if getattr(sb, "master", None) is not None:
                    sb.master.narrow(0, at, seg.numel).copy_(piece)

    def remove(self) -> None:
        """Remove the hooks (the units stop gathering)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.reducer.remove()
