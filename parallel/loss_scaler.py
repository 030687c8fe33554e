"""fp16 loss scaling with DeepSpeed's semantics and config keys.

Why: fp16 has 5 exponent bits, so small gradients underflow to zero. Multiplying the loss by a
scale S before ``backward()`` lifts them into range; gradients are divided by S before the
optimizer step. Dynamic scaling finds the largest S that does not overflow. bf16 has fp32's
exponent range and needs no loss scaling: train bf16 without a scaler.

Rules (docs/reference.md, "fp16 dynamic loss scaling"; identical, update by update, to
DeepSpeed >= 0.17.1 ``DynamicLossScaler.update_scale`` — a differential test drives both):

* overflow (any inf/nan grad on ANY rank of ``group``): the step is skipped. If ``hysteresis``
  is 1 or the hysteresis left is 1, S is halved: with S exactly equal to ``min_loss_scale``
  raise ``LossScaleAtMinimumError`` ("Current loss scale already at minimum - cannot decrease
  scale anymore"), else ``S = max(S / 2, min_loss_scale)`` — so a scale that starts below the
  minimum is raised to it by the first halving. Otherwise the hysteresis left drops by one and
  S stays. The hysteresis is not refilled by a halving.
* clean step: with ``consecutive_hysteresis`` the hysteresis is refilled. Let
  ``stable = cur_iter - last_overflow_iter - 1``, the clean steps BEFORE this one since the last
  overflow (training starts as if step -1 overflowed). When ``stable > 0`` and
  ``stable % loss_scale_window == 0``, S doubles and the hysteresis is refilled: the doublings
  happen on clean steps ``W + 1, 2W + 1, ...`` of a run (DeepSpeed < 0.17.1 doubled one step
  earlier, on clean step W).
* ``loss_scale > 0`` is a static scale: S never changes, and (as in DeepSpeed's engines, which
  check overflow whatever the scaler) an overflow still skips the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.profiler import record_function

from .grad_utils import OverflowReport, UnscaledGrads, unscale_grads_

__all__ = ["DynamicLossScaler", "LossScaleAtMinimumError", "step_unless_overflow"]


class LossScaleAtMinimumError(RuntimeError):
    """An overflow happened with the loss scale already at ``min_loss_scale``."""


#: The ``"fp16"`` config keys :meth:`DynamicLossScaler.from_config` passes on; their defaults
#: are the constructor's (DeepSpeed's, checked in tests/data_parallel/test_loss_scaler_deepspeed.py).
_CONFIG_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)


class DynamicLossScaler:
    """Dynamic (or static) fp16 loss scaler with DeepSpeed's config keys.

    Args:
        loss_scale: 0 for dynamic scaling; > 0 for a static scale.
        initial_scale_power: dynamic scaling starts at ``2 ** initial_scale_power``.
        loss_scale_window: clean steps between doublings.
        hysteresis: overflows tolerated before the scale is halved.
        consecutive_hysteresis: refill the hysteresis on every clean step.
        min_loss_scale: lowest scale; an overflow with the scale exactly here raises
            :class:`LossScaleAtMinimumError`.
        raise_error_at_min_scale: DeepSpeed's switch of the same name (not a config key there
            either): False keeps training at ``min_loss_scale`` instead of raising.

    Example:
        >>> scaler = DynamicLossScaler.from_config({"loss_scale": 0, "initial_scale_power": 16})
        >>> scaler.scale_loss(loss).backward()
        >>> report = scaler.unscale_(model.parameters(), group=ctx.group("dp"))
        >>> if not report.overflow:
        ...     optimizer.step()
        >>> scaler.update(report.overflow)
    """

    def __init__(
        self,
        *,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        if not loss_scale >= 0:
            raise ValueError(f"loss_scale must be >= 0 (0 = dynamic), got {loss_scale}")
        if int(loss_scale_window) < 1:
            raise ValueError(f"loss_scale_window must be >= 1, got {loss_scale_window}")
        if int(hysteresis) < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        if not min_loss_scale > 0:
            raise ValueError(f"min_loss_scale must be > 0, got {min_loss_scale}")
        self.dynamic = loss_scale == 0
        self.loss_scale_window = int(loss_scale_window)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_loss_scale = float(min_loss_scale)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_scale = float(2.0**initial_scale_power) if self.dynamic else float(loss_scale)
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self._unscaled: UnscaledGrads | None = None  # see expect_unscaled; never checkpointed

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DynamicLossScaler:
        """Build from a DeepSpeed-style ``"fp16"`` config section (``enabled`` is ignored).

        Raises:
            ValueError: an unknown key (a typo would otherwise be silently ignored).
        """
        unknown = set(config) - set(_CONFIG_KEYS) - {"enabled", "auto_cast"}
        if unknown:
            raise ValueError(f"unknown fp16 config key(s): {sorted(unknown)}; known: {sorted(_CONFIG_KEYS)}")
        return cls(**{k: config[k] for k in _CONFIG_KEYS if k in config})

    @property
    def scale(self) -> float:
        """The current loss scale S."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (call ``.backward()`` on the result)."""
        return loss * self.cur_scale

    def update(self, overflow: bool) -> None:
        """Advance the scale schedule by one step (DeepSpeed's ``update_scale``).

        Raises:
            LossScaleAtMinimumError: overflow with the scale already at ``min_loss_scale``.
        """
        self._unscaled = None  # a step boundary: a record not used by now is stale
        if not self.dynamic:
            self.cur_iter += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                # Exact equality, as DeepSpeed: a scale below the minimum (min_loss_scale above
                # the initial scale) is not an error; max() below lifts it to the minimum.
                if self.cur_scale == self.min_loss_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        "Current loss scale already at minimum - cannot decrease scale anymore "
                        f"(scale={self.cur_scale}, min_loss_scale={self.min_loss_scale})"
                    )
                self.cur_scale = max(self.cur_scale / 2.0, self.min_loss_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            # Clean steps before this one since the last overflow: doubling on clean steps
            # W+1, 2W+1, ... of a run (DeepSpeed >= 0.17.1).
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.loss_scale_window == 0:
                self.cur_hysteresis = self.hysteresis
                self.cur_scale *= 2.0
        self.cur_iter += 1

    def unscale_(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        group: Any = None,
        max_norm: float | None = None,
        report_nonfinite: bool = False,
        backend: str = "auto",
    ) -> OverflowReport:
        """Unscale grads by 1/S in place, detect inf/nan, and optionally clip — fused.

        One epilogue launch per (device, dtype) over all grads: unscale, inf/nan flag, and sum of
        squares for the norm (none for grads ``DataParallel(loss_scaler=self)`` already unscaled
        in backward, see :meth:`expect_unscaled`); the overflow flag (and, with ``group``, the squared norm when grads
        are sharded) is agreed across ``group`` with one all-reduce, so every rank skips the same
        steps. With ``max_norm`` the grads are then clipped by global norm (one more launch).

        Args:
            params: parameters, or ``(name, param)`` pairs (names appear in the report).
            group: process group over which the overflow is agreed (e.g. ``ctx.group("dp")``),
                or None for a single process.
            max_norm: clip to this global L2 norm (skipped on overflow).
            report_nonfinite: list the params whose grads hold inf/nan on this rank.
            backend: kernel backend (see :func:`shardkit.kernels.runtime.resolve_backend`).

        Returns:
            An :class:`OverflowReport`.
        """
        unscaled, self._unscaled = self._unscaled, None
        if unscaled is not None and unscaled.loss_scale != self.cur_scale:
            raise RuntimeError(
                f"the grads were unscaled in backward by loss scale {unscaled.loss_scale}, but the scale "
                f"is now {self.cur_scale}: call update() only after unscale_()"
            )
        return unscale_grads_(
            _named(params),
            inv_scale=1.0 / self.cur_scale,
            group=group,
            max_norm=max_norm,
            report_nonfinite=report_nonfinite,
            backend=backend,
            unscaled=unscaled,
        )

    def expect_unscaled(self, record: UnscaledGrads) -> None:
        """Note that a strategy already unscaled these grads (for the next :meth:`unscale_`).

        ``DataParallel(loss_scaler=self)`` calls this at the end of each reducing backward: it
        divided the grads by ``dp * S`` in the copy back from its buckets and measured them in
        the same pass, so :meth:`unscale_` then only agrees the overflow over ``group`` (and
        clips). Consumed by the next :meth:`unscale_`; dropped by :meth:`update`.
        """
        self._unscaled = record

    def state_dict(self) -> dict[str, Any]:
        """The scaler's full state (for checkpoints)."""
        return dict(
            cur_scale=self.cur_scale,
            cur_hysteresis=self.cur_hysteresis,
            cur_iter=self.cur_iter,
            last_overflow_iter=self.last_overflow_iter,
            dynamic=self.dynamic,
            loss_scale_window=self.loss_scale_window,
            hysteresis=self.hysteresis,
            consecutive_hysteresis=self.consecutive_hysteresis,
            min_loss_scale=self.min_loss_scale,
            raise_error_at_min_scale=self.raise_error_at_min_scale,
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        for key, value in state.items():
            setattr(self, key, value)
        self._unscaled = None


def step_unless_overflow(step: Callable[[], Any], overflow: bool, loss_scaler: DynamicLossScaler | None) -> bool:
    """The one optimizer-step decision of every layout: ``step()`` unless an overflow was agreed
    (every rank passes the same ``overflow``), then the loss scale updated. Returns whether it
    stepped. Replicated layouts pass ``optimizer.step``; ZeRO's
    :class:`~shardkit.parallel.zero.ZeroOptimizer` its shard step and all-gather.

    Example:
        >>> report = scaler.unscale_(model.parameters(), group=ctx.group("dp"))
        >>> stepped = step_unless_overflow(opt.step, report.overflow, scaler)
    """
    with record_function("shardkit::step"):
        if not overflow:
            step()
        if loss_scaler is not None:
            loss_scaler.update(overflow)
    return not overflow


def _named(params: Iterable[Any]) -> Sequence[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(params):
        if isinstance(item, tuple):
            out.append((str(item[0]), item[1]))
        else:
            out.append((f"param[{i}]", item))
    return out
