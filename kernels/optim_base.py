"""Shared machinery of the fused optimizers: validation, state, launch groups, AMP, state_dict.

A subclass declares its state (``_init_state``) and its update for one launch group
(``_update``); this base class keeps torch.optim's public contract:

* same constructor arguments, ``param_groups``, ``add_param_group``, ``zero_grad``, LR
  schedulers (``lr`` may be a float or a 0-d tensor);
* ``state`` uses torch.optim's keys (``step``, ``exp_avg``, ``exp_avg_sq``,
  ``max_exp_avg_sq``, ``momentum_buffer``), so state_dicts load into the torch class and back;
* ``torch.amp.GradScaler`` support (``_step_supports_amp_scaling``): the scaler hands us
  ``grad_scale``/``found_inf``; grads are unscaled inside the kernel, and a found inf skips the
  step leaving params and state untouched (one host read of ``found_inf``, as GradScaler's own
  non-fused path does).

[Note: launch groups]
Within a param group, parameters are grouped by (device, param dtype, grad dtype, master copy
or not, subclass key — e.g. the step count, which only differs after ``add_param_group`` or
when some params had no grad). Each launch group is one kernel launch, however many parameters it
holds; a model trained in one dtype takes one launch per param group per step.

[Note: cached step plans]
Re-deriving the launch groups every step costs more Python time than the fused CPU kernel on a
model of ~50 small tensors, so each param group caches its plan (the launch groups) and reuses it
while the step "signature" is unchanged: the same ``state`` mapping and param list (by
identity, element by element), the same params with grads, the same grad dtypes and shapes.
Within a cached plan all params of a launch group were stepped together last time, so their keys
(step counts, SGD first-step) still agree. ``add_param_group`` and ``load_state_dict`` drop
every plan; building a plan checks every state tensor against its param (size, dtype, layout).
Replacing one param's state dict in place (``opt.state[p] = {...}``) is not detected: reset
state with ``opt.state = collections.defaultdict(dict)`` or ``load_state_dict``. Within a
launch group the ``step`` counters are 0-d views of one float32 buffer (still one tensor per
param in ``state``, as torch.optim has it), so advancing them is one op instead of one per param.

[Note: master weights]
``master_weights=True`` keeps an fp32 copy (``state["master_param"]``) for every fp16/bf16
param, with fp32 moments; the kernel updates master and moments and writes the rounded param in
the same pass. ``Optimizer.load_state_dict`` would cast every state tensor to the param's
dtype, so :meth:`FusedOptimizer.load_state_dict` restores fp32 for these params afterwards. A
state_dict from a torch optimizer (no ``master_param``) starts the master from the param.

A param written by the user (``model.load_state_dict``, a rollback, an EMA swap, ``p.copy_``
under ``no_grad``, ``p.data = w``) would be silently undone by the next step, which continues
from the master. So the optimizer remembers each master-weight param's ``(_version, data_ptr)``
after writing it, and ``step`` copies a param whose pair moved into its master first — the
fp32 math then continues from the written weights (moments kept), as an fp32 optimizer would.
The check is one list comparison per launch group per step (with the record, ~0.5 us per
master-weight param on CPU). Writes through ``p.data`` in place
(``p.data.copy_(w)``) move no version counter: call :meth:`FusedOptimizer.sync_master_weights`
after those. ``load_state_dict`` makes the loaded masters current, so load the model's weights
first and the optimizer's state second (the usual order) to keep the fp32 masters.

[Note: implementation flags]
``torch.optim.Optimizer.load_state_dict`` replaces every group entry but ``params`` with the
saved one, the flags that pick an implementation included (torch to torch as well). Our groups
carry torch's keys (``fused``, ``foreach``, ``capturable``, ``differentiable``) so state_dicts
interchange, but the values the user passed us (``fused=None`` by default) would switch a
``torch.optim.AdamW(fused=True)`` target to its slow for-loop path. So ``state_dict()`` saves
``fused=True, foreach=None, capturable=False, differentiable=False`` — the state comes from a
fused implementation, and torch has fused kernels for every device and dtype we accept — and
``load_state_dict`` keeps our own flags whatever was saved. A torch target built with
``capturable=True`` (CUDA graphs) gets ``capturable=False`` back, as from any non-capturable
torch optimizer: set ``group["capturable"] = True`` again after loading.

[Note: torch.compile]
``torch.compile(opt.step)`` compiles the closure (if any) and runs the update eagerly behind a
graph break: the update is already one fused launch per launch group, so compiling it gains
nothing, and inductor cannot compile it (on the CPU path ``torch._fused_adamw_`` trips a
functionalization assert and ``torch._fused_sgd_`` has no fake kernel; the Triton path launches
through raw pointer tables). Params and state come out exactly as in eager mode.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, ParamSpec, TypeVar

import torch

from .layout import SUPPORTED_DTYPES, is_dense, same_layout
from .runtime import resolve_backend

__all__ = ["LaunchGroup", "FusedOptimizer", "check_betas", "check_nonneg"]

#: What a saved group tells torch.optim about its implementation (see [Note: implementation flags])
_IMPLEMENTATION_FLAGS: dict[str, bool | None] = {
    "fused": True,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
}

_P = ParamSpec("_P")
_T = TypeVar("_T")


def check_nonneg(name: str, value: float | torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value >= 0`` (floats or 0-d tensors)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} as a tensor must have one element, got shape {tuple(value.shape)}")
        value = float(value)
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def check_betas(betas: tuple[float, float], name: str = "betas") -> None:
    """Raise ``ValueError`` unless both betas lie in [0, 1)."""
    if len(betas) != 2:
        raise ValueError(f"{name} must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"Invalid {name}[{i}]: {float(b)} (must be in [0, 1))")


def _run_eagerly_under_compile(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """``fn`` unchanged in eager mode; under ``torch.compile`` a graph break around an eager call.

    See [Note: torch.compile]. ``torch._dynamo`` is imported on the first compiled call only:
    importing it costs about a second, which eager training (and import) should not pay.
    """
    disabled: list[Callable[_P, _T]] = []

    @functools.wraps(fn)
    def inner(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return inner


class LaunchGroup(list):
    """A launch group's params (a plain list to subclasses) plus a cache of derived lists.

    The cache lives exactly as long as the plan that made the group (see [Note: cached step
    plans]), so state tensors gathered into it cannot go stale: every event that replaces state
    tensors (``load_state_dict``, ``add_param_group``, a change of which params have grads)
    drops the plan.
    """

    __slots__ = ("cache",)

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(params)
        self.cache: dict[str, Any] = {}


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of shardkit's fused optimizers (not used directly).

    Args:
        params: iterable of tensors or of param-group dicts, as for ``torch.optim``.
        defaults: hyper-parameter defaults, validated by the subclass.
        master_weights: keep fp32 master weights and moments for fp16/bf16 params.
        backend: ``"auto"`` (compiled Triton on CUDA, torch fast path on CPU), ``"triton"``
            (on CPU: Triton's interpreter — correctness checks only), or ``"torch"``.
    """

    _step_supports_amp_scaling = True
    #: state keys held in fp32 when a master copy is kept (restored after load_state_dict)
    _fp32_state_keys: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        master_weights: bool = False,
        backend: str = "auto",
    ) -> None:
        resolve_backend(backend, torch.device("cpu"))  # validates the name
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool, got {type(master_weights).__name__}")
        self.master_weights = master_weights
        self.backend = backend
        self._plans: dict[int, tuple[Any, tuple, list]] = {}
        self._written: dict[int, tuple[int, int]] = {}  # id(param) -> (_version, data_ptr)
        super().__init__(params, defaults)

    # ---- construction-time checks ---------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (validated: floating fp32/fp16/bf16, non-complex, leaf tensors)."""
        super().add_param_group(param_group)
        self._plans = {}
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            if p.is_complex():
                raise TypeError(f"{type(self).__name__} does not support complex params (param {i})")
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{type(self).__name__}: param {i} has dtype {p.dtype}; supported: float32, float16, bfloat16")
        self._validate_group(group)

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Subclasses check their hyper-parameters here (called for every group)."""

    # ---- subclass interface -----------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _launch_group_key(self, state: dict[str, Any], group: dict[str, Any]) -> Hashable:
        """Extra launch-group key (e.g. the step count); see [Note: launch groups]."""
        return None

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], grad_scale: torch.Tensor | None) -> None:
        raise NotImplementedError

    # ---- shared helpers ---------------------------------------------------------------------
    def _uses_master(self, p: torch.Tensor) -> bool:
        return self.master_weights and p.dtype != torch.float32

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self._uses_master(p) else p.dtype

    def _zeros_state(self, p: torch.Tensor) -> torch.Tensor:
        # preserve_format: dense params (e.g. channels_last) get state with the same strides, so
        # param, grad and state share one memory order and kernels treat them as flat
        return torch.zeros_like(p, dtype=self._state_dtype(p))

    def _ensure_master(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        if self._uses_master(p) and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True)

    def _grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [same_layout(p.grad, p) for p in params]

    def _masters(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.master_weights:
            return []
        return [self.state[p]["master_param"] for p in params if self._uses_master(p)]

    def _advance_steps(self, params: list[torch.Tensor]) -> float:
        """Add 1 to every param's ``state["step"]``; return the new (common) value.

        See [Note: cached step plans]: the counters of a launch group become views of one buffer.
        """
        buf = params.cache.get("step_buf") if isinstance(params, LaunchGroup) else None
        if buf is not None:
            buf.add_(1.0)
            return float(buf[0])
        states = [self.state[p] for p in params]
        buf = states[0]["step"]._base
        if buf is None or buf.numel() != len(states) or any(s["step"]._base is not buf for s in states):
            buf = torch.tensor([float(s["step"]) for s in states], dtype=torch.float32)
            for i, s in enumerate(states):
                s["step"] = buf[i]
        if isinstance(params, LaunchGroup):
            params.cache["step_buf"] = buf
        buf.add_(1.0)
        return float(states[0]["step"])

    # ---- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step over every param group.

        With ``master_weights=True``, params written since the last step are first copied into
        their masters ([Note: master weights]). Under ``torch.compile`` the closure is compiled
        and the update runs eagerly behind a graph break ([Note: torch.compile]).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.

        Example:
            >>> loss = model(x).sum(); loss.backward()
            >>> opt.step()  # or: torch.compile(opt.step)()
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._apply_updates()
        return loss

    @_run_eagerly_under_compile
    def _apply_updates(self) -> None:
        """Update every param group with a grad (the kernel launches; see [Note: torch.compile])."""
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.sum() > 0):
            return  # overflow: skip, params and state untouched
        if grad_scale is not None:
            grad_scale = grad_scale.to(torch.float32).reshape(1)
        work = []  # (group, device, launch group, has masters), every group planned first
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            grads = [p.grad for p in params]
            # dtype only: a sparse or mis-shaped grad changes nothing here, but _plan rejects it the
            # first time, and autograd never turns a param's dense grad sparse between steps
            signature = (
                id(self.state),
                tuple(map(id, params)),
                tuple([None if g is None else (g.dtype, g.shape) for g in grads]),
            )
            plan = self._plans.get(index)
            if plan is None or plan[0] is not params or plan[1] != signature:
                plan = (params, signature, self._plan(group))
                self._plans[index] = plan
            work += [(group, *entry) for entry in plan[2]]
        # Every re-sync before any update, every record after all of them: params that are views
        # of one tensor share its version counter, so updating one launch group would otherwise
        # look like a user write to a sibling group (and reset its master from the rounded param).
        for _, _, launch_group, master in work:
            if master:
                self._resync_written_masters(launch_group)
        for group, device, launch_group, _ in work:
            self._update(group, launch_group, grad_scale.to(device) if grad_scale is not None else None)
        for _, _, launch_group, master in work:
            if master:
                self._record_written(launch_group)

    def _resync_written_masters(self, params: LaunchGroup) -> None:
        """Copy into its master every param written since the optimizer wrote it.

        See [Note: master weights]. One pass over the group's (version, address) pairs; the
        per-param lookup only runs when something moved (or on a new plan's first step).
        """
        now = [(p._version, p.data_ptr()) for p in params]
        if now == params.cache.get("written"):
            return
        for p, current in zip(params, now):
            last = self._written.get(id(p))
            if last is not None and last != current:
                self.state[p]["master_param"].copy_(p.detach())

    def _record_written(self, params: Iterable[torch.Tensor]) -> None:
        """Remember how the optimizer left these params (see [Note: master weights])."""
        params = params if isinstance(params, list) else list(params)
        now = [(p._version, p.data_ptr()) for p in params]
        if isinstance(params, LaunchGroup):
            params.cache["written"] = now
            ids = params.cache.get("ids") or params.cache.setdefault("ids", list(map(id, params)))
        else:
            ids = list(map(id, params))
        self._written.update(zip(ids, now))

    def _plan(self, group: dict[str, Any]) -> list[tuple[torch.device, LaunchGroup, bool]]:
        """Validate grads, create missing state, and split a group into launch groups (see [Note: launch groups])."""
        groups: dict[Hashable, LaunchGroup] = defaultdict(LaunchGroup)
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            self._check_grad(p, i)
            state = self.state[p]
            if len(state) == 0:
                self._init_state(p, state, group)
            self._ensure_master(p, state)
            self._conform_state(p, state, i)
            key = (p.device, p.dtype, p.grad.dtype, self._uses_master(p), self._launch_group_key(state, group))
            groups[key].append(p)
        return [(key[0], params, key[3]) for key, params in groups.items()]  # device, params, master

    def _conform_state(self, p: torch.Tensor, state: dict[str, Any], index: int) -> None:
        """Check state sizes against ``p``; give state the dtype and strides the kernels expect."""
        for key, value in list(state.items()):
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            if value.numel() != p.numel():
                raise ValueError(
                    f"{type(self).__name__}: state[{key!r}] of param {index} has {value.numel()} "
                    f"elements but the param has {p.numel()} (was the param resized? reset its state)"
                )
            want = (
                torch.float32
                if key == "master_param"
                else (self._state_dtype(p) if key in self._fp32_state_keys else value.dtype)
            )
            if value.dtype != want or value.device != p.device or value.stride() != p.stride():
                state[key] = torch.empty_like(p, dtype=want).copy_(value.view_as(p) if value.shape != p.shape else value)

    def _check_grad(self, p: torch.Tensor, index: int) -> None:
        g = p.grad
        name = type(self).__name__
        if g.is_sparse:
            raise TypeError(f"{name} does not support sparse gradients (param {index})")
        if g.device != p.device:
            raise ValueError(f"{name}: param {index} is on {p.device} but its grad is on {g.device}")
        if g.shape != p.shape:
            raise ValueError(f"{name}: param {index} has shape {tuple(p.shape)}, grad {tuple(g.shape)}")
        if g.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: grad of param {index} has unsupported dtype {g.dtype}")
        if not is_dense(p):
            raise ValueError(f"{name}: param {index} must be dense (got strides {p.stride()} for shape {tuple(p.shape)})")

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer pickles only defaults/state/param_groups: keep our settings too
        return {**super().__getstate__(), "master_weights": self.master_weights, "backend": self.backend}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plans = {}  # plans hold live tensors: never carried through pickling/deepcopy
        self._written = {}  # keyed by id(param): meaningless in a copy

    # ---- state_dict ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state_dict, with groups that keep a torch target on its fused path.

        See [Note: implementation flags]: each saved group's ``fused``/``foreach``/``capturable``/
        ``differentiable`` (those the matching torch class has) say "fused".

        Returns:
            ``{"state": {id: {key: tensor}}, "param_groups": [{..., "params": [id, ...]}]}``,
            loadable by this class and by the matching ``torch.optim`` class.
        """
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:  # fresh dicts: our own groups are untouched
            group.update({k: v for k, v in _IMPLEMENTATION_FLAGS.items() if k in group})
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict (ours or the matching torch.optim class's).

        Saved state is matched to params through the saved groups' ``params`` ids, as torch.optim
        does (ids need not be 0..N-1). See [Note: master weights] for how fp32 master state
        survives the load; every cached plan is dropped ([Note: cached step plans]).
        """
        saved_state = state_dict["state"]
        by_id: dict[Any, torch.Tensor] = {}
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            by_id.update(zip(saved_group["params"], group["params"]))
        own_flags = [{k: g[k] for k in _IMPLEMENTATION_FLAGS if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, flags in zip(self.param_groups, own_flags):
            group.update(flags)  # ours, not the saved ones: see [Note: implementation flags]
        self._plans = {}
        for state in self.state.values():
            # torch hands the saved step tensors over as they are; ours advance in place (launch-group
            # buffers), so a shared one would be advanced by two optimizers
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()
        for pid, saved in saved_state.items():
            p = by_id.get(pid)
            if p is None or not self._uses_master(p):
                continue
            state = self.state[p]
            for key in (*self._fp32_state_keys, "master_param"):
                if isinstance(saved.get(key), torch.Tensor):
                    state[key] = saved[key].to(device=p.device, dtype=torch.float32, copy=True)
            self._record_written([p])  # the loaded master wins over the param as it is now

    @torch.no_grad()
    def sync_master_weights(self) -> None:
        """Copy every param into its fp32 master copy (``master_weights=True`` only).

        ``step`` already does this for every param written since the optimizer last wrote it
        (see [Note: master weights]); call it after writes ``step`` cannot see: through
        ``p.data`` in place (``p.data.copy_(w)``), which moves no version counter.

        Example:
            >>> for p, w in zip(model.parameters(), best_weights):
            ...     p.data.copy_(w)
            >>> opt.sync_master_weights()
        """
        for group in self.param_groups:
            for p in group["params"]:
                master = self.state.get(p, {}).get("master_param")
                if master is not None:
                    master.copy_(p.detach())
                    self._record_written([p])

    @staticmethod
    def _step_tensor() -> torch.Tensor:
        # torch.optim keeps ``step`` as a float32 CPU scalar (non-capturable): same here, so
        # state_dicts interchange, and bias corrections are computed on the host with no sync.
        return torch.tensor(0.0, dtype=torch.float32)
