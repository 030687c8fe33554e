"""``ZeroOptimizer``: any elementwise optimizer, stepping on this rank's flat shard only.

The wrapped optimizer (shardkit's fused ones or a ``torch.optim`` class) is built over 1-D
*shard parameters*: views of this rank's fp32 master shard, one per original parameter that has
elements in the shard (:func:`~shardkit.kernels.flatten.shard_segments`), each with a view of
the reduced gradient shard as ``.grad``. Parameter groups are given with the ORIGINAL parameters
(or their names), so per-parameter settings survive the flattening — no weight decay for biases
and norms, a different lr per block — and a fused optimizer still takes one launch per group
(its multi-tensor table covers every view of the group). Its state (Adam's m and v) is allocated
for the shard only: 8Ψ/N bytes per rank instead of 8Ψ.

With ``offload="cpu"``/``"nvme"`` the shard params, masters and state live on the CPU / in files
instead (:mod:`.offload`, :mod:`.nvme`, docs/offload.md); the gradient shards reach the host
during backward and the epilogue and clip run there; the wrapped optimizer, its groups and the
state_dict format are the same.

Optimizers whose update of an element depends on more than that element (LAMB's per-tensor
trust ratio, Adafactor's row/column factors, LBFGS's global history) would compute it over a
fragment and silently differ; they are refused with a ValueError naming ``optimizer_class``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.profiler import record_function

from .nvme import NvmeOffload, validate_nvme_dir
from .offload import CpuOffload
from ..loss_scaler import step_unless_overflow
from ..param_groups import resolve_param_groups
from .sharded import ShardedDataParallel

__all__ = ["ZeroOptimizer"]


def _not_elementwise() -> tuple[type, ...]:
    """Optimizer classes whose per-element update needs the whole tensor (or all of them)."""
    from shardkit.kernels import FusedLAMB

    names = ("LBFGS", "Adafactor", "SparseAdam", "Muon")
    return (FusedLAMB, *(getattr(torch.optim, n) for n in names if hasattr(torch.optim, n)))


class ZeroOptimizer:
    """Step ``optimizer_class`` on this rank's shard of ``sdp``'s parameters, then all-gather.

    Args:
        sdp: the :class:`ShardedDataParallel` whose parameters to optimize.
        optimizer_class: an elementwise ``torch.optim.Optimizer`` subclass (FusedAdamW,
            FusedAdam, FusedSGD, FusedLion, torch.optim.AdamW, SGD, ...).
        params: None (every trainable parameter, one group), an iterable of parameters or
            names, or of group dicts whose ``"params"`` are original parameters or names.
        **optimizer_kwargs: passed to ``optimizer_class`` (lr, betas, weight_decay, ...).

    Not a ``torch.optim.Optimizer`` itself: give LR schedulers ``opt.optimizer`` (its
    ``param_groups`` are the ones :attr:`param_groups` returns).

    Attributes:
        optimizer: the wrapped optimizer (over shard parameters).
        skipped_steps: steps skipped because an fp16 gradient overflowed on some rank.

    Raises:
        ValueError: a parameter not in ``sdp.module`` (or frozen, or in two groups), an unknown
            name, or a non-elementwise ``optimizer_class`` — all before any communication.

    Example:
        >>> decay = [p for n, p in sdp.module.named_parameters() if p.dim() >= 2]
        >>> no_decay = [p for n, p in sdp.module.named_parameters() if p.dim() < 2]
        >>> opt = ZeroOptimizer(sdp, FusedAdamW, [{"params": decay, "weight_decay": 0.1},
        ...                                       {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        sdp: ShardedDataParallel,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not isinstance(sdp, ShardedDataParallel):
            raise TypeError(f"sdp must be a ShardedDataParallel, got {type(sdp).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if issubclass(optimizer_class, _not_elementwise()):
            raise ValueError(
                f"optimizer_class {optimizer_class.__name__} updates each element from whole-tensor "
                "statistics (trust ratio / factored moments / global history); on a ZeRO shard it would "
                "see fragments of tensors. Use an elementwise optimizer (AdamW, SGD, Lion) or DataParallel"
            )
        if sdp.offload == "nvme":
            validate_nvme_dir(sdp.nvme_dir)
        groups = resolve_param_groups(sdp.module, params)
        # each group's original params as the user gave them (zero-size ones and those with no
        # element on this rank included): a checkpoint records these, the same on every rank
        self._members = [list(g["params"]) for g in groups]
        self._grouped = {p for g in groups for p in g["params"]}
        self.sdp = sdp
        self._offload: Any = None
        if sdp.offload is not None:
            self._offload = _offload_class(sdp.offload)(sdp, optimizer_class, groups, optimizer_kwargs)
            self.optimizer = self._offload.optimizer
        else:
            shard_of = sdp._shards.shard_param_of()
            inner = [{**g, "params": [shard_of[p] for p in g["params"] if p in shard_of]} for g in groups]
            self.optimizer = optimizer_class(inner, **optimizer_kwargs)
        self.skipped_steps = 0
        self.last_step_skipped = False
        sdp._attach(self)

    # ---- torch.optim-like surface ----------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups (shard parameters); set ``lr`` etc. here, as usual."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state, keyed by shard parameter."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of original parameters (or names), as ``torch.optim.Optimizer.add_param_group``.

        Every rank must add the same group (groups line up across ranks, as the shards do). The
        params must be params of ``sdp.module`` that are in no group yet. ZeRO lays out every
        param that was trainable when ``ShardedDataParallel`` was built: a frozen param is a
        member that is never stepped, and one unfrozen later (progressive unfreezing) needs the
        model wrapped again.

        Args:
            param_group: a dict with ``"params"`` (original params or names) and per-group
                options (``lr``, ``weight_decay``, ...); missing options take the defaults.

        Raises:
            ValueError: a param already in a group, or not in the module (before any
                change); with offload, which builds its host optimizer once.

        Example:
            >>> opt = ZeroOptimizer(sdp, FusedAdamW, list(model.head.parameters()), lr=1e-3)
            >>> opt.add_param_group({"params": list(model.body.parameters()), "lr": 1e-4})
        """
        if self._offload is not None:
            raise ValueError(
                f"add_param_group: offload={self.sdp.offload!r} builds its host optimizer once; pass every "
                "group to ZeroOptimizer(...) instead"
            )
        (group,) = resolve_param_groups(self.sdp.module, [param_group], arg="param_group")
        again = [p for p in group["params"] if p in self._grouped]
        if again:
            names = {p: n for n, p in self.sdp.module.named_parameters()}
            raise ValueError(f"add_param_group: {[names[p] for p in again][:3]} already in a parameter group")
        shard_of = self.sdp._shards.shard_param_of()
        self.optimizer.add_param_group({**group, "params": [shard_of[p] for p in group["params"] if p in shard_of]})
        self._members.append(list(group["params"]))
        self._grouped.update(group["params"])

    def group_members(self) -> list[list[torch.nn.Parameter]]:
        """Each param group's original parameters, as resolved from what the user passed.

        Unlike :attr:`param_groups` (this rank's shard views), the same on every rank and
        including zero-size parameters, which hold no shard: what ``torch.optim`` would hold, so
        what a checkpoint records as the group's members.

        Example:
            >>> [len(ps) for ps in opt.group_members()]   # e.g. [4, 2]: decay and no-decay
        """
        return [list(ps) for ps in self._members]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients (module params and the reduced shards)."""
        self.sdp.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finalize the gradients (if :meth:`ShardedDataParallel.clip_grad_norm_` did not), step
        this rank's shard unless a gradient overflowed on any rank, all-gather the updated
        params, and update the fp16 loss scale.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        overflow, _ = self.sdp.finalize_gradients()
        stepped = step_unless_overflow(self._step_shard, overflow, self.sdp.loss_scaler)
        if not stepped:
            self.sdp._shards.release_step_buffers()
            self.skipped_steps += 1
        self.last_step_skipped = not stepped
        return loss

    def _step_shard(self) -> None:
        """Step this rank's shard (after the agreed no-overflow decision), then all-gather the
        updated params into every rank's full params."""
        shards = self.sdp._shards
        if self._offload is None and self.sdp.stage < 3:  # offload re-reads its own masters
            shards.refresh_written_masters()  # [Note: params written between steps]
        hidden = self._hide_unstepped_grads()
        try:
            if self._offload is not None:
                self._offload.step()  # also writes sb.local_param_shard()
            else:
                self.optimizer.step()
        finally:  # an NVMe write that failed leaves params and state as before this step
            for sp, grad in hidden:
                sp.grad = grad
            shards.release_step_buffers()
        with record_function("shardkit::all_gather"):
            shards.all_gather_params()

    def _hide_unstepped_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        """Set ``.grad = None`` on the shard params of params that no rank had a gradient for, so
        that the wrapped optimizer skips them as torch.optim skips a param without a grad ([Note:
        params without a gradient are not stepped] in ``flat_shards.py``). Returns what to
        restore after the step. NVMe offload binds each bucket's grads itself and reads
        ``sb.stepped`` there."""
        shards = self.sdp._shards
        if self._offload is not None:
            shard_params = self._offload.shard_params
        else:
            shard_params = [sb.shard_params for sb in shards.buckets]
        hidden = []
        for b, k in shards.unstepped():
            sp = shard_params[b][k]
            hidden.append((sp, sp.grad))
            sp.grad = None
        return hidden

    def state_bytes(self) -> int:
        """Bytes of the wrapped optimizer's state tensors (distinct storages) on this rank's
        device: 0 with offload (see :meth:`offloaded_bytes`)."""
        if self._offload is not None:
            return 0
        seen: dict[int, int] = {}
        for s in self.optimizer.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        return sum(seen.values())

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state and fp32 masters held off the device, ``{}`` without offload.

        Returns:
            ``{"cpu": n, "nvme": n, "cpu_buffers": n}``: ``cpu``/``nvme`` the persistent
            masters (4 bytes per shard element) and optimizer state (Adam: 8 per element held,
            plus the ``step`` scalars) in host memory / in files under ``nvme_dir``;
            ``cpu_buffers`` the host gradient buffers the step reads (4 bytes per shard element,
            +2 with bf16 gradients: the staging copy), filled during backward.
        """
        return {} if self._offload is None else self._offload.offloaded_bytes()

    def shard_slots(self) -> list[tuple[str, int, int]]:
        """``(param name, first element, numel)`` of each inner shard parameter, in the inner
        optimizer's parameter order (the integer keys of ``state_dict()["optimizer"]["state"]``):
        which piece of which flattened original parameter each state entry holds.

        Example:
            >>> opt.shard_slots()[0]
            ('blocks.0.attn.qkv.weight', 0, 4096)
        """
        names = {p: n for n, p in reversed(list(self.sdp.module.named_parameters(remove_duplicate=False)))}
        where = {}
        for p, (_, seg) in self.sdp._shards.segment_of().items():
            where[p] = (names[p], seg.tensor_offset, seg.numel)
        if self._offload is not None:
            origin = self._offload.origin
        else:
            origin = {sp: p for p, sp in self.sdp._shards.shard_param_of().items()}
        return [where[origin[sp]] for g in self.optimizer.param_groups for sp in g["params"]]

    def _layout(self) -> dict[str, Any]:
        sdp = self.sdp
        return {
            "stage": sdp.stage,
            "dp_size": sdp.ctx.size("dp_cp"),
            "dp_rank": sdp.ctx.rank("dp_cp"),
            "buckets": [(sb.total, sb.shard, len(sb.segments)) for sb in sdp.sharded_buckets],
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer: the wrapped optimizer's state_dict, the fp32 master
        shards of low-precision params, and the layout they belong to (reload on the same dp
        size and rank; resharding to another size is the checkpoint work, docs/zero.md).

        With offload, ``"master"`` holds the fp32 CPU master of every bucket (fp32 params
        included) and the optimizer state is on the CPU (read from the files for ``"nvme"``)."""
        if self._offload is not None:
            optimizer_state = self._offload.inner_state_dict()
            return {"zero": self._layout(), "optimizer": optimizer_state, "master": self._offload.masters_for_state_dict()}
        masters = [None if sb.master is None else sb.master.clone() for sb in self.sdp.sharded_buckets]
        return {"zero": self._layout(), "optimizer": self.optimizer.state_dict(), "master": masters}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (load the model's params first: the masters then win)."""
        for key in ("zero", "optimizer", "master"):
            if key not in state:
                raise ValueError(f"state: missing key {key!r} (not a ZeroOptimizer state_dict)")
        mine = self._layout()

        def norm(v: Any) -> Any:
            return [tuple(x) for x in v] if isinstance(v, (list, tuple)) else v

        for key, value in mine.items():
            if norm(state["zero"].get(key)) != norm(value):
                raise ValueError(f"state['zero'][{key!r}] is {state['zero'].get(key)!r} but this run has {value!r}")
        if self._offload is not None:
            self._offload.load(state["optimizer"], list(state["master"]))
            return
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for sb, m in zip(self.sdp.sharded_buckets, state["master"]):
                if sb.master is not None and m is not None:
                    sb.master.copy_(m)
        # the loaded masters win over the params written before them ([Note: params written
        # between steps] in flat_shards.py): they are the source the next step starts from
        self.sdp._shards.record_param_versions()


def _offload_class(offload: str) -> type[CpuOffload]:
    """The runtime for ``ShardedDataParallel(offload=...)``."""
    return CpuOffload if offload == "cpu" else NvmeOffload
