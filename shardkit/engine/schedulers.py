"""DeepSpeed's learning-rate schedules, on any optimizer that has ``param_groups``.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest`` take
DeepSpeed's constructor arguments and follow its update rules step for step (docs/reference.md, "DeepSpeed
LR schedules"; a differential test drives DeepSpeed's classes and these with the same
arguments). Unlike DeepSpeed's, they do not require a ``torch.optim.Optimizer``: torch
optimizers, shardkit's fused optimizers and ``ZeroOptimizer`` (which only exposes
``param_groups``/``defaults``) all work.

The protocol, shared by the five:

* ``last_batch_iteration`` (``it``) is -1 after construction; each :meth:`step` adds 1 and writes
  :meth:`get_lr` at the new ``it`` into the groups (an lr stored as a tensor is filled in place).
* Constructed with ``last_batch_iteration=-1``, the constructor already writes ``get_lr()`` at
  -1 into the groups (resuming with another value writes nothing until the next ``step``).
* ``state_dict()`` is ``{"last_batch_iteration": it}``; ``load_state_dict`` restores ``it`` only.

Deliberate differences from DeepSpeed 0.19.8, all at argument validation: an unknown
``warmup_type`` raises ``ValueError`` (DeepSpeed logs a warning and silently uses ``"log"``), and
``get_last_lr()`` right after construction returns what the constructor wrote (DeepSpeed's
``OneCycle`` asserts there).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any, Protocol

import torch

__all__ = [
    "SCHEDULERS",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "make_scheduler",
    "warmup_gamma",
]

WARMUP_TYPES = ("log", "linear")


class HasParamGroups(Protocol):
    """Anything with torch.optim's ``param_groups`` (a list of dicts with an ``"lr"`` key)."""

    param_groups: list[dict[str, Any]]


def warmup_gamma(it: int, warmup_steps: int, warmup_type: str) -> float:
    """The warmup fraction γ at iteration ``it`` (0 <= it < W), W = ``warmup_steps`` (>= 2).

    ``log``: γ = ln(it + 1) / ln(W); ``linear``: γ = it / W. Both start at 0 and never reach 1
    during warmup; the schedule takes γ = 1 (or its decay) from ``it = W`` on.

    Example:
        >>> warmup_gamma(0, 10, "log"), warmup_gamma(5, 10, "linear")
        (0.0, 0.5)
    """
    if warmup_type == "log":
        return math.log(it + 1) / math.log(warmup_steps)
    return it / warmup_steps


def _per_group(optimizer: HasParamGroups, value: Any, name: str) -> list[Any]:
    """One value per param group: a scalar is broadcast, a list/tuple must match the groups."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: expected {n} values (one per param group), got {len(value)}")
        return list(value)
    return [value] * n


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> int:
    """W = max(2, warmup_num_steps): ln(W) is the log warmup's denominator, so W = 1 is lifted."""
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, Integral) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
    return max(2, int(warmup_num_steps))


class _Schedule:
    """The shared protocol: iteration counter, writing lrs into groups, state dict."""

    optimizer: HasParamGroups
    last_batch_iteration: int
    _last_lr: list[Any] | None = None

    def __init__(self, optimizer: HasParamGroups, last_batch_iteration: int) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizer must have param_groups, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.last_batch_iteration = int(last_batch_iteration)

    def get_lr(self) -> list[float]:
        """The lr of every param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def _write_lrs(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            if isinstance(group["lr"], torch.Tensor):
                # a tensor lr (torch's capturable/fused optimizers) keeps its identity and device
                group["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the current one + 1) and write the lrs."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else int(last_batch_iteration)
        self._write_lrs()

    def get_last_lr(self) -> list[Any]:
        """The lrs last written into the groups (by the constructor or :meth:`step`)."""
        if self._last_lr is None:
            raise RuntimeError("no lr written yet: call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        """``{"last_batch_iteration": it}``, DeepSpeed's checkpoint format."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``last_batch_iteration`` (the groups get their lr at the next :meth:`step`)."""
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])


class WarmupLR(_Schedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr`` over W steps, then hold it.

    lr(it) = min_lr + (max_lr − min_lr)·γ(it) for 0 <= it < W (:func:`warmup_gamma`), max_lr from
    it = W on, min_lr at it = -1. W = max(2, ``warmup_num_steps``).

    Args:
        optimizer: anything with ``param_groups``.
        warmup_min_lr: lr at the start (a float, or one per param group).
        warmup_max_lr: lr after warmup (float or per group); None takes each group's current lr.
        warmup_num_steps: warmup length (positive int).
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: -1 to start; the step count when resuming.

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=100)
        >>> for batch in loader:
        ...     train_step(batch); opt.step(); sched.step()
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        if self.last_batch_iteration == -1:
            self._write_lrs()

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        return warmup_gamma(it, self.warmup_num_steps, self.warmup_type) if it < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        """``min_lr + delta·γ`` per group; ``min_lr`` before the first step."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`'s warmup, then a linear decay that reaches 0 at ``total_num_steps``.

    After warmup (it >= W): γ = max(0, (T − it) / max(1, T − W)), T = ``total_num_steps``, so the
    lr is min_lr + (max_lr − min_lr)·γ (it decays towards ``warmup_min_lr``, not 0).

    Args:
        optimizer: anything with ``param_groups``.
        total_num_steps: T, the step at which the decay ends.
        warmup_min_lr: see :class:`WarmupLR`.
        warmup_max_lr: see :class:`WarmupLR` (default 0.001, not the groups' lr, as DeepSpeed).
        warmup_num_steps: see :class:`WarmupLR`.
        warmup_type: see :class:`WarmupLR`.
        last_batch_iteration: see :class:`WarmupLR`.

    Example:
        >>> sched = WarmupDecayLR(opt, total_num_steps=1000, warmup_max_lr=3e-4, warmup_num_steps=100)
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(total_num_steps, Real) or isinstance(total_num_steps, bool):
            raise ValueError(f"total_num_steps must be a number, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}", stacklevel=2)

    def _gamma(self) -> float:
        it, w, t = self.last_batch_iteration, self.warmup_num_steps, self.total_num_steps
        if it < w:
            return warmup_gamma(it, w, self.warmup_type)
        return max(0.0, float(t - it) / float(max(1.0, t - w)))


class WarmupCosineLR(_Schedule):
    """Scale each group's own lr by a ratio: warmup from ``warmup_min_ratio`` to 1, then cosine.

    lr(it) = base_lr × ratio(it), base_lr = the group's lr at construction. For it < W:
    ratio = r₀ + (1 − r₀)·γ(it); after: q = min(1, (it − W + 1) / max(1, T − W)),
    ratio = max(0, c + (1 − c)(1 + cos πq)/2) with c = ``cos_min_ratio``. ratio = 0 at it = -1.

    Args:
        optimizer: anything with ``param_groups``; their lrs are the peak lrs.
        total_num_steps: T.
        warmup_min_ratio: r₀, the ratio at it = 0.
        warmup_num_steps: see :class:`WarmupLR` (W = max(2, ·)).
        cos_min_ratio: c, the ratio at it >= T.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: -1 to start.

    Example:
        >>> opt = FusedAdamW(model.parameters(), lr=3e-4)
        >>> sched = WarmupCosineLR(opt, total_num_steps=1000, warmup_num_steps=50)
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        if total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}", stacklevel=2)
        # copies: the groups' lrs are overwritten below, the base lrs must survive
        self.org_lrs = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in optimizer.param_groups]
        if self.last_batch_iteration == -1:
            self._write_lrs()

    def get_lr_ratio(self) -> float:
        """ratio(it) as in the class docstring."""
        it, w = self.last_batch_iteration, self.warmup_num_steps
        if it < 0:
            return 0.0
        if it < w:
            r0 = self.warmup_min_ratio
            return r0 + warmup_gamma(it, w, self.warmup_type) * (1.0 - r0)
        q = min(1.0, (it - w + 1) / max(1, self.total_num_steps - w))
        c = self.cos_min_ratio
        return max(0.0, c + (1.0 - c) * (1 + math.cos(math.pi * q)) / 2)

    def get_lr(self) -> list[float]:
        """``base_lr × ratio`` per group."""
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """DeepSpeed's 1-cycle policy: lr up then down over one cycle, then an optional slow decay.

    The formulas are in docs/reference.md, "DeepSpeed LR schedules" (OneCycle). In short: with
    n = it + 1, S = first + second step size and x = n/S − floor(n/S) (the position in the
    cycle), the scale s rises as x/ρ over the first half (ρ = first/S) and falls as
    (1 − x)/(1 − ρ) over the second; lr = min_lr + (max_lr − min_lr)·s and, when momentum is
    cycled, beta1 = max_mom − (max_mom − min_mom)·s. From it >= S the decay phase applies.

    Momentum cycling writes ``group["betas"] = (beta1, 0.99)``: DeepSpeed fixes beta2 at 0.99
    whenever it cycles momentum, and a config run here must match a run there. Momentum is only
    cycled for optimizers whose ``defaults`` (or, lacking them, groups) carry ``betas``; with
    none, a warning is issued and only the lr cycles (SGD's ``momentum`` is not cycled, as in
    DeepSpeed).

    Args:
        optimizer: anything with ``param_groups``.
        cycle_min_lr: lr at the cycle's ends (float or per group).
        cycle_max_lr: lr at the cycle's peak (float or per group).
        decay_lr_rate: after the cycle, lr = min_lr / (1 + rate·k/decay_step_size) (k = steps
            past the cycle); 0 keeps min_lr.
        cycle_first_step_size: steps of the rising half (> 0).
        cycle_second_step_size: steps of the falling half (>= 0; None: the first's).
        cycle_first_stair_count: > 0 quantises the rising half into that many flat stairs.
        cycle_second_stair_count: the same for the falling half (None: the first's).
        decay_step_size: decay interval; 0 disables the decay phase (lr stays min_lr).
        cycle_momentum: cycle beta1 inversely to the lr.
        cycle_min_mom: beta1 at the peak (float or per group).
        cycle_max_mom: beta1 at the cycle's ends (float or per group).
        decay_mom_rate: after the cycle, beta1 = max_mom·(1 + rate·k/decay_step_size).
        last_batch_iteration: -1 to start.

    Example:
        >>> opt = FusedAdam(model.parameters(), lr=1e-3)
        >>> sched = OneCycle(opt, cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=100)
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        # the scale divides by the rising half's share, so it must be positive
        if not first > 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if not second >= 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)

        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum:
            defaults = getattr(optimizer, "defaults", None)
            has_betas = "betas" in defaults if defaults is not None else all("betas" in g for g in optimizer.param_groups)
            if not has_betas:
                warnings.warn(
                    f"cycle_momentum is disabled: {type(optimizer).__name__} has no betas (it is only cycled for Adam-like optimizers)",
                    stacklevel=2,
                )
                self.cycle_momentum = False
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        if self.last_batch_iteration == -1:
            # it = -1 is the cycle's start: s = 0, so lr = min_lr; DeepSpeed writes min_mom here
            # (not max_mom, which s = 0 would give) and so do we
            self._write_groups(list(self.min_lrs), self.min_moms if self.cycle_momentum else None)

    def _scale(self) -> float:
        n = self.last_batch_iteration + 1
        cycle = math.floor(1 + n / self.total_size)
        x = 1.0 + n / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # quantise from the integer step, not from the float scale: at an exact stair the
            # float can land 1e-16 low and floor() would drop a whole stair
            pos = n % self.total_size
            if pos <= self.first_step_size:
                stair = pos * stairs / self.first_step_size
            else:
                stair = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def _decay_steps(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        """The cycle's lr while it < S, the decayed min_lr after."""
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_steps()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """``(beta1, 0.99)`` per group, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [(hi - (hi - lo) * s, 0.99) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return [(hi, 0.99) for hi in self.max_moms]
        factor = 1 + self.decay_mom_rate * self._decay_steps()
        return [(hi * factor, 0.99) for hi in self.max_moms]

    def _write_groups(self, lrs: list[float], moms: list[float] | list[tuple[float, float]] | None) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        if moms is not None:
            for group, mom in zip(self.optimizer.param_groups, moms):
                group["betas"] = mom if isinstance(mom, tuple) else (mom, 0.99)

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance one step (or to ``batch_iteration``) and write lr (and betas) into the groups."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if batch_iteration is None else int(batch_iteration)
        self._write_groups(self.get_lr(), self.get_mom())


class LRRangeTest(_Schedule):
    """DeepSpeed's learning-rate range test: the lr grows from ``lr_range_test_min_lr`` without bound.

    lr(it) = min_lr × (1 + step_rate × i), with i = (it + 1) / step_size, or ⌊(it + 1) / step_size⌋
    when ``lr_range_test_staircase`` is true; min_lr at it = -1. Used to find the largest lr a
    model trains at before diverging (then the bounds of a cyclic schedule such as
    :class:`OneCycle`).

    Args:
        optimizer: anything with ``param_groups``.
        lr_range_test_min_lr: the lr at the start (a float, or one per param group).
        lr_range_test_step_size: steps per unit of ``i`` (a positive integer).
        lr_range_test_step_rate: the lr's growth per unit of ``i``, as a multiple of min_lr.
        lr_range_test_staircase: grow in steps of ``step_size`` iterations rather than continuously.
        last_batch_iteration: -1 to start; the step count when resuming.

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sched = LRRangeTest(opt, lr_range_test_min_lr=1e-5, lr_range_test_step_size=100,
        ...                     lr_range_test_step_rate=5.0)
        >>> for batch in loader:
        ...     train_step(batch); opt.step(); sched.step()
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        step_size = lr_range_test_step_size
        if isinstance(step_size, bool) or not isinstance(step_size, Integral) or step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {step_size!r}")
        self.step_size = int(step_size)
        self.step_rate = lr_range_test_step_rate
        self.staircase = bool(lr_range_test_staircase)
        if self.last_batch_iteration == -1:
            self._write_lrs()

    def _interval(self) -> float:
        ratio = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(ratio) if self.staircase else ratio

    def get_lr(self) -> list[float]:
        """``min_lr × (1 + step_rate × i)`` per group."""
        increase = 1 + self.step_rate * self._interval()
        return [lo * increase for lo in self.min_lr]


#: DeepSpeed's ``scheduler.type`` names -> classes.
SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def make_scheduler(name: str, optimizer: HasParamGroups, params: dict[str, Any]) -> _Schedule:
    """Build the scheduler a DeepSpeed config's ``"scheduler"`` section names.

    Args:
        name: ``scheduler.type`` (one of :data:`SCHEDULERS`).
        optimizer: anything with ``param_groups``.
        params: ``scheduler.params``, passed as keyword arguments.

    Example:
        >>> make_scheduler("WarmupLR", opt, {"warmup_max_lr": 1e-3, "warmup_num_steps": 10})
    """
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler.type must be one of {sorted(SCHEDULERS)}, got {name!r}")
    return SCHEDULERS[name](optimizer, **params)
