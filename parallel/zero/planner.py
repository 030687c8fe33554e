"""ZeRO memory planner: per-rank bytes of each stage, predicted without allocating anything, and
its tables (:func:`plan_table`, :func:`format_gb`: the paper's GB as it prints them).

Pure functions of a parameter count (or a model, possibly on the meta device) and the run's
settings. The categories are those of ``ShardedDataParallel.memory_report()`` and of
:class:`~shardkit.parallel.strategy.StrategyReport` (``params``, ``grads``, ``optimizer_state``,
``transient``; bytes per rank), so a measured report can be compared with a plan key by key.

Formulas (docs/reference.md, "ZeRO memory and communication"; Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", 2019, §3.1 and §5, Table 1; §7 for
communication). With Ψ parameters (Ψ_t of them trainable), N data-parallel ranks, P / G bytes per
parameter / gradient element, K bytes of optimizer state per trainable parameter (fp32 master
copy included) and a padded shard ⌈x/N⌉::

    stage 0 (DDP)       params P·Ψ      grads G·Ψ_t       optimizer K·Ψ_t
    stage 1 (P_os)      params P·Ψ      grads G·Ψ_t       optimizer K·⌈Ψ_t/N⌉
    stage 2 (P_os+g)    params P·Ψ      grads G·⌈Ψ_t/N⌉   optimizer K·⌈Ψ_t/N⌉
    stage 3 (P_os+g+p)  params P·⌈Ψ/N⌉  grads G·⌈Ψ_t/N⌉   optimizer K·⌈Ψ_t/N⌉

Mixed precision Adam (P = G = 2, K = 12) gives the paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and
16Ψ/N; fp32 Adam (P = G = 4, K = 8: no master copy) gives 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N.
docs/planner.md derives both and lists the transient, offload and communication terms. Given a
model, stages 1-2 count the exact flat buffers ``ShardedDataParallel`` builds (alignment and
padding, the real buckets: :mod:`~shardkit.parallel.zero.plan_layout`); its default fp32
gradients are ``grad_dtype_bytes=4``.

Example:
    >>> plan = plan_memory(7_500_000_000, dp=64, stage=2, precision="fp16")
    >>> plan.model_state_bytes / 1e9   # the ZeRO paper's Table 1: 16.6 GB
    16.640625
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from decimal import ROUND_HALF_UP, Decimal
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from .flat_shards import MAX_IN_FLIGHT
from .plan_layout import ceil_shard, flat_layout, stage3_layout, stage3_transient, zero12_transient

__all__ = [
    "MemoryPlan",
    "StageTable",
    "count_parameters",
    "format_gb",
    "optimizer_state_bytes",
    "plan_memory",
    "plan_table",
    "unit_sizes",
]

_GB = 10**9  # the paper's GB (Table 1: 16Ψ for Ψ = 7.5e9 is "120 GB")


def format_gb(nbytes: int | float, unit: int = _GB) -> str:
    """Bytes in GB (10^9; or in ``unit`` bytes), rounded half up to about 3 significant figures.

    Half up, not Python's half-even, as the paper's Table 1 prints 41.25 GB ("41.3") and
    1.875 GB ("1.88").

    Example:
        >>> format_gb(31_406_250_000), format_gb(41_250_000_000), format_gb(2.048e12)
        ('31.4', '41.3', '2048')
    """
    value = Decimal(int(nbytes)) / unit
    if value == 0:
        return "0"
    digits = next((d for limit, d in ((100, 0), (10, 1), (1, 2)) if abs(value) >= limit), 3)
    return str(value.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def _display_unit(largest: int) -> tuple[int, str]:
    """GB unless everything is below 1 GB (a small model): then MB (10^6)."""
    return (_GB, "GB") if largest >= _GB else (10**6, "MB")


Precision = Literal["fp32", "bf16", "fp16"]
Offload = Literal["cpu", "nvme"]

#: fp32 state tensors each optimizer keeps per parameter (torch.optim / shardkit.kernels state
#: keys: Adam(W)/LAMB exp_avg + exp_avg_sq, Lion and SGD with momentum one buffer, SGD none).
#: The scalar ``step`` tensors (4 bytes per parameter *tensor*) are left out.
OPTIMIZER_STATE_SLOTS: dict[str, int] = {
    "adam": 2,
    "adamw": 2,
    "lamb": 2,
    "adagrad": 1,
    "lion": 1,
    "sgd_momentum": 1,
    "sgd": 0,
}
_PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_STAGE_NAMES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
_COMM_WEIGHT = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # the paper's unit, §7


def optimizer_state_bytes(optimizer: str | int, precision: Precision) -> int:
    """K: bytes of optimizer state per trainable parameter, fp32 master copy included.

    Mixed precision (``"bf16"``/``"fp16"``) keeps an fp32 master copy (4 bytes) next to the fp32
    moments; ``"fp32"`` updates the parameters themselves, so K is the moments only.

    Args:
        optimizer: a name in :data:`OPTIMIZER_STATE_SLOTS`, or K itself as an int.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.

    Example:
        >>> optimizer_state_bytes("adamw", "fp16"), optimizer_state_bytes("adamw", "fp32")
        (12, 8)
    """
    if precision not in _PARAM_BYTES:
        raise ValueError(f"precision must be one of {list(_PARAM_BYTES)}, got {precision!r}")
    if isinstance(optimizer, bool) or not isinstance(optimizer, (int, str)):
        raise TypeError(f"optimizer must be a name or an int K, got {type(optimizer).__name__}")
    if isinstance(optimizer, int):
        if optimizer < 0:
            raise ValueError(f"optimizer (K bytes per parameter) must be >= 0, got {optimizer}")
        return optimizer
    key = optimizer.lower()
    if key not in OPTIMIZER_STATE_SLOTS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_SLOTS)} or an int K, got {optimizer!r}")
    master = 0 if precision == "fp32" else 1
    return 4 * (OPTIMIZER_STATE_SLOTS[key] + master)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameter counts of ``model``, without touching parameter data.

    A parameter shared by several modules (tied embedding and output projection) counts once:
    ``model.parameters()`` de-duplicates by identity, as DDP and FSDP do. Works on the meta
    device (only ``numel`` is read). Trainable = ``requires_grad``; frozen parameters get no
    gradient and no optimizer state.

    Example:
        >>> with torch.device("meta"):
        ...     m = nn.Linear(4, 3)
        >>> count_parameters(m)
        (15, 15)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def unit_sizes(model: nn.Module, wrap: set[type[nn.Module]] | Callable[[nn.Module], bool]) -> list[int]:
    """Parameter counts of the ZeRO-3 units ``wrap`` would make, outermost-last (root remainder).

    Each module selected by ``wrap`` (a set of classes, or a predicate) that is not inside an
    already selected one becomes a unit; the parameters left over form the root unit. Shared
    parameters count once, in the first unit that reaches them.

    Example:
        >>> unit_sizes(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), {nn.Linear})
        [20, 10, 0]
    """
    pick = wrap if callable(wrap) and not isinstance(wrap, (set, frozenset)) else (lambda m: isinstance(m, tuple(wrap)))
    seen: set[int] = set()
    sizes: list[int] = []

    def take(module: nn.Module) -> int:
        n = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if pick(child):
                sizes.append(take(child))
            else:
                visit(child)

    visit(model)
    sizes.append(take(model))
    return sizes


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted bytes per data-parallel rank for one ZeRO stage (see the module docstring).

    Attributes:
        num_params / trainable_params: Ψ and Ψ_t.
        dp, stage, precision, optimizer, offload: the settings planned for.
        bytes_per_param / bytes_per_grad / optimizer_bytes_per_param: P, G and K.
        params / grads / optimizer_state: persistent model-state bytes on the device.
        transient: peak bytes of buffers outside the model state (gradient buckets; ZeRO-3
            gathered units incl. prefetch and one unit's unsharded gradients).
        cpu: host bytes per rank (offload: optimizer state, fp32 gradient shard, staging).
        nvme: bytes per rank in files (``offload="nvme"``).
        master: the fp32 master copy's share of ``optimizer_state`` (mixed precision, stages 1-3).
        comm: (op, elements, bytes per element) of each collective per step, per rank.
        device_bytes: the device memory planned against, or None.
    """

    num_params: int
    trainable_params: int
    dp: int
    stage: int
    precision: str
    optimizer: str
    offload: str | None
    bytes_per_param: int
    bytes_per_grad: int
    optimizer_bytes_per_param: int
    params: int
    grads: int
    optimizer_state: int
    transient: int
    master: int = 0
    cpu: int = 0
    nvme: int = 0
    comm: tuple[tuple[str, int, int], ...] = field(default=())
    device_bytes: int | None = None

    @property
    def name(self) -> str:
        """``"DDP"``, ``"ZeRO-1"``, ``"ZeRO-2"`` or ``"ZeRO-3"``."""
        return _STAGE_NAMES[self.stage]

    @property
    def model_state_bytes(self) -> int:
        """params + grads + optimizer state on the device: the ZeRO paper's Table 1 quantity."""
        return self.params + self.grads + self.optimizer_state

    @property
    def device_total(self) -> int:
        """Model states + transient buffers (activations and fragmentation come on top)."""
        return self.model_state_bytes + self.transient

    @property
    def fits(self) -> bool | None:
        """``device_total <= device_bytes``; None when no device size was given."""
        return None if self.device_bytes is None else self.device_total <= self.device_bytes

    def memory(self) -> dict[str, int]:
        """Device bytes by category, keyed as ``memory_report()`` / ``StrategyReport.memory``."""
        return {"params": self.params, "grads": self.grads, "optimizer_state": self.optimizer_state, "transient": self.transient}

    def memory_report(self) -> dict[str, int | str]:
        """The same figures keyed as ``ShardedDataParallel.memory_report()``, for a like-for-like check.

        There the fp32 master shard is its own key (``master_params``); here it is part of K, so
        ``optimizer_state`` is split: master = 4 bytes per sharded trainable parameter when mixed
        precision keeps one on the device.
        """
        master = self.master
        return {
            "unit": "bytes",
            "params": self.params,
            "grads": self.grads,
            "master_params": master,
            "optimizer_state": self.optimizer_state - master,
            "model_state": self.model_state_bytes,
            "peak_transient": self.transient,
        }

    @property
    def comm_payload_bytes(self) -> dict[str, int]:
        """Bytes per op as :class:`~shardkit.comm.CommStats` records them (an all-reduce of Ψ = Ψ)."""
        out: dict[str, int] = {}
        for op, n, size in self.comm:
            out[op] = out.get(op, 0) + n * size
        return out

    @property
    def comm_elements(self) -> int:
        """Elements per step in the ZeRO paper's unit (§7: all-reduce of Ψ = 2Ψ): 2Ψ, 2Ψ, 2Ψ, 3Ψ."""
        return sum(_COMM_WEIGHT[op] * n for op, n, _ in self.comm)

    @property
    def comm_bytes(self) -> int:
        """Bytes per step per rank in the paper's unit (all-reduce counted twice)."""
        return sum(_COMM_WEIGHT[op] * n * size for op, n, size in self.comm)

    @property
    def comm_wire_bytes(self) -> int:
        """Bytes each rank sends per step with ring algorithms: the paper's unit × (N−1)/N."""
        return self.comm_bytes * (self.dp - 1) // self.dp

    def table(self) -> str:
        """A two-column table of this plan's categories, in GB (10^9 bytes; MB below 1 GB).

        Example:
            >>> print(plan_memory(10**9, dp=8, stage=3, precision="bf16").table())  # doctest: +SKIP
        """
        rows = [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer_state", self.optimizer_state),
            ("model states", self.model_state_bytes),
            ("transient", self.transient),
            ("device total", self.device_total),
            ("cpu (offload)", self.cpu),
            ("nvme (offload)", self.nvme),
            ("comm/step (paper unit)", self.comm_bytes),
        ]
        head = (
            f"{self.name} (stage {self.stage}), Ψ={self.num_params:,} (trainable {self.trainable_params:,}), "
            f"dp={self.dp}, {self.precision}, {self.optimizer} K={self.optimizer_bytes_per_param}, "
            f"offload={self.offload or 'none'}"
        )
        scale, name = _display_unit(max(v for _, v in rows))
        lines = [head] + [f"  {k:<24}{format_gb(v, scale):>10} {name}" for k, v in rows]
        if self.device_bytes is not None:
            fits = "yes" if self.fits else "NO"
            lines.append(f"  {'fits in':<24}{format_gb(self.device_bytes, scale):>10} {name}: {fits}")
        return "\n".join(lines)


def plan_memory(
    num_params: int | nn.Module,
    *,
    dp: int,
    stage: int,
    precision: Precision = "fp32",
    optimizer: str | int = "adamw",
    offload: Offload | None = None,
    offload_params: bool = False,
    bucket_mb: float = 25.0,
    buckets_in_flight: int = MAX_IN_FLIGHT,
    gradient_as_bucket_view: bool = False,
    largest_unit_params: int | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool | int = True,
    grad_dtype_bytes: int | None = None,
    nvme_subgroup_params: int = 10**9,
    device_bytes: int | None = None,
    exact: bool = True,
    wrap: Any = None,
) -> MemoryPlan:
    """Predict one rank's memory and communication for ZeRO ``stage`` (0 = DDP) over ``dp`` ranks.

    Args:
        num_params: Ψ, or a model (meta device fine) counted by :func:`count_parameters`.
        dp: data-parallel ranks N (>= 1).
        stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
        precision: ``"fp32"`` (4-byte params and grads, no master copy) or ``"bf16"``/``"fp16"``
            (2-byte params and grads, fp32 master copy and moments).
        optimizer: name in :data:`OPTIMIZER_STATE_SLOTS` or K (bytes per parameter, master incl.).
        offload: None, ``"cpu"`` (optimizer state + its step on the host) or ``"nvme"`` (optimizer
            state in files, streamed through host buffers). Stages 1-3 only.
        offload_params: stage 3 with offload: keep the parameter shard in host memory (for
            ``"nvme"`` too: only the optimizer state goes to files), plus a device staging buffer
            (1/N of the unit) per gather in flight.
        bucket_mb: gradient bucket capacity in MiB (as ``DataParallel(bucket_mb=)``).
        buckets_in_flight: buckets alive at once in stages 1-2 (one filling, one reducing).
        gradient_as_bucket_view: stage 0: grads are views of the buckets (no second copy).
        largest_unit_params: parameters of the largest ZeRO-3 unit (default: the whole model,
            one unit; see :func:`unit_sizes`).
        prefetch: units gathered ahead of the current one in stage 3.
        reshard_after_forward: stage 3 frees gathered units after forward (False keeps all of
            them until backward: one all-gather less, full parameters at the peak); an int B
            keeps a 1/B piece of each from its forward to its backward ([Note: hierarchical
            gathers]: the same payload, the backward's gathers inside blocks of B ranks).
        grad_dtype_bytes: G override, e.g. 4 for fp32 gradient reduction with bf16 params.
        nvme_subgroup_params: elements per NVMe sub-group (two are staged on the host).
        device_bytes: device memory to check :attr:`MemoryPlan.fits` against.
        exact: with a model, stages 1-2: count the flat buffers ``ShardedDataParallel`` builds
            (alignment and padding, the real buckets, the worst rank's share; see
            :func:`~shardkit.parallel.zero.plan_layout.flat_layout`); stage 3: the units
            ``wrap`` makes, their buckets and the runtime's gather/prefetch/reduce order
            (:func:`~shardkit.parallel.zero.plan_layout.stage3_transient`). False: the Ψ formulas.
        wrap: stage 3 with a model: the units, as ``ShardedDataParallel(wrap=)``.

    Returns:
        A :class:`MemoryPlan`; byte counts are per rank.

    Example:
        >>> p = plan_memory(7_500_000_000, dp=64, stage=3, precision="fp16", optimizer="adam")
        >>> p.model_state_bytes, p.comm_elements
        (1875000000, 22500000000)
    """
    if isinstance(num_params, nn.Module):
        psi, psi_t = count_parameters(num_params)
    elif isinstance(num_params, int) and not isinstance(num_params, bool):
        if num_params < 0:
            raise ValueError(f"num_params must be >= 0, got {num_params}")
        psi = psi_t = num_params
    else:
        raise TypeError(f"num_params must be an int or an nn.Module, got {type(num_params).__name__}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive int, got {dp!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    if offload is not None and stage == 0:
        raise ValueError("offload needs a ZeRO stage (1, 2 or 3), got stage=0")
    if offload_params and (stage != 3 or offload is None):
        raise ValueError("offload_params needs stage=3 and an offload target")
    for name, value in (
        ("bucket_mb", bucket_mb),
        ("buckets_in_flight", buckets_in_flight),
        ("nvme_subgroup_params", nvme_subgroup_params),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    block = 0  # hierarchical gathers' block size ([Note: hierarchical gathers]); 0: none
    if not isinstance(reshard_after_forward, bool):
        if not isinstance(reshard_after_forward, int) or reshard_after_forward < 2 or dp % reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward must be a bool or a divisor of dp={dp} greater than 1, got {reshard_after_forward!r}"
            )
        if stage != 3:
            raise ValueError(f"reshard_after_forward={reshard_after_forward} applies to stage 3, got stage={stage}")
        block = reshard_after_forward if reshard_after_forward < dp else 0
    if largest_unit_params is not None and not 0 <= largest_unit_params <= psi:
        raise ValueError(f"largest_unit_params must be in [0, num_params={psi}], got {largest_unit_params}")
    k = optimizer_state_bytes(optimizer, precision)
    pb = _PARAM_BYTES[precision]
    gb = pb if grad_dtype_bytes is None else grad_dtype_bytes
    if gb <= 0:
        raise ValueError(f"grad_dtype_bytes must be positive, got {grad_dtype_bytes}")

    # Model states, §5.1-5.3: each stage shards one more of optimizer state, grads, params.
    shard, shard_t = ceil_shard(psi, dp), ceil_shard(psi_t, dp)
    params = pb * (shard if stage == 3 else psi)
    grads = gb * (shard_t if stage >= 2 else psi_t)
    opt = k * (shard_t if stage >= 1 else psi_t)
    # The fp32 master copy inside K: 4 bytes per sharded trainable element in mixed precision.
    master = 4 * shard_t if precision != "fp32" and stage >= 1 and k >= 4 else 0
    layout = None
    if exact and isinstance(num_params, nn.Module) and stage in (1, 2):
        # The exact flat buffers of stages 1-2 (plan_layout.py): 16-element alignment per
        # parameter and padding to 16·N per bucket, the worst rank's share of the elements.
        layout = flat_layout(num_params, dp=dp, bucket_mb=bucket_mb, grad_bytes=gb)
        total, shards = sum(layout.totals), sum(layout.shards)
        params = pb * (total + layout.frozen)
        grads = gb * (total if stage == 1 else shards)
        master = 4 * shards if master else 0
        opt = (k - 4 if master else k) * layout.owned + master  # moments cover real elements only
    # Stage 3 with a model: the units and buckets the runtime builds, for the transient buffers
    # (gathered units, prefetch, gradient buckets). The persistent shards keep the Ψ formulas:
    # the layout's alignment padding is under 1% of a unit's elements.
    lay3 = None
    if exact and isinstance(num_params, nn.Module) and stage == 3:
        lay3 = stage3_layout(num_params, dp=dp, bucket_mb=bucket_mb, wrap=wrap)

    # Offload (ZeRO-Offload / ZeRO-Infinity): the optimizer step runs on the host, on an fp32
    # copy of this rank's gradient shard (copied during backward in the grad dtype: a G-byte
    # staging copy too when G ≠ 4); NVMe keeps the state in files, two sub-groups staged.
    # The host step needs an fp32 master next to the moments: in mixed precision K counts it
    # already; with fp32 params K has none (the device step updates the params in place), so the
    # offloaded state is 4 bytes per shard element more - except a cpu-offloaded fp32 parameter
    # shard, which is itself the master ([Note: offloaded parameter shards]).
    cpu = nvme = 0
    if offload is not None:
        cpu = 4 * shard_t + (gb * shard_t if gb != 4 else 0)
        host_is_master = offload == "cpu" and offload_params and precision == "fp32"
        extra = 4 if (master == 0 and precision == "fp32" and not host_is_master) else 0
        off_state = opt + extra * (sum(layout.shards) if layout is not None else shard_t)
        if offload == "cpu":
            cpu += off_state
        else:
            nvme += off_state
            cpu += 2 * (k + extra) * min(nvme_subgroup_params, shard_t)
        opt = master = 0
        if offload_params:  # host memory for both targets ([Note: offloaded parameter shards])
            cpu += params
            params = 0

    # Transient buffers (§3.2 "temporary buffers"): nothing to communicate at dp = 1.
    bucket = int(bucket_mb * 2**20)
    transient = 0
    if dp > 1:
        if stage == 0:
            # DDP allocates every bucket up front: a flat copy of all grads unless grads are views.
            transient = 0 if gradient_as_bucket_view else gb * psi_t
        elif stage in (1, 2):
            transient = zero12_transient(
                layout,
                psi_t,
                dp=dp,
                stage=stage,
                pb=pb,
                gb=gb,
                bucket=bucket,
                in_flight=buckets_in_flight,
                host_epilogue=offload is not None,
            )
        elif lay3 is not None:
            transient = stage3_transient(
                lay3,
                pb=pb,
                gb=gb,
                reshard_after_forward=bool(reshard_after_forward),
                in_flight=buckets_in_flight,
                staging=offload_params,
                host_epilogue=offload is not None,
                secondary_block=block,
            )
        else:
            unit = psi if largest_unit_params is None else largest_unit_params
            gathered = psi if not reshard_after_forward else min(psi, (1 + prefetch) * unit)
            transient = pb * gathered + gb * min(unit, psi_t)  # + one unit's unsharded grads
            if block:  # every unit's piece, from the end of forward into backward
                transient += pb * psi // block
            if offload_params:  # each gather in flight also holds its 1/N device staging buffer
                transient += pb * ceil_shard(min(psi, (1 + prefetch) * unit), dp)

    # Communication per step (§7): payload elements per collective.
    comm: list[tuple[str, int, int]] = []
    if dp > 1:
        if stage == 0:
            comm.append(("all_reduce", psi_t, gb))
        elif stage in (1, 2):
            comm += [("reduce_scatter", psi_t, gb), ("all_gather", psi_t, pb)]
        else:
            comm += [("all_gather", psi * (1 if not reshard_after_forward else 2), pb), ("reduce_scatter", psi_t, gb)]

    return MemoryPlan(
        num_params=psi,
        trainable_params=psi_t,
        dp=dp,
        stage=stage,
        precision=precision,
        optimizer=str(optimizer),
        offload=offload,
        bytes_per_param=pb,
        bytes_per_grad=gb,
        optimizer_bytes_per_param=k,
        params=params,
        grads=grads,
        optimizer_state=opt,
        transient=transient,
        master=master,
        cpu=cpu,
        nvme=nvme,
        comm=tuple(comm),
        device_bytes=device_bytes,
    )


# ---- tables over stages -----------------------------------------------------------------------
@dataclass(frozen=True)
class StageTable:
    """Plans of several stages for the same model and settings; ``str()`` renders the table."""

    plans: tuple[MemoryPlan, ...]

    def __getitem__(self, stage: int) -> MemoryPlan:
        for plan in self.plans:
            if plan.stage == stage:
                return plan
        raise KeyError(stage)

    def render(self) -> str:
        """One row per stage, sizes in GB (10^9 bytes; MB when all are below 1 GB), comm in multiples of Ψ."""
        first = self.plans[0]
        offload = next((p.offload for p in self.plans if p.offload), None)
        scale, name = _display_unit(max(max(p.device_total, p.cpu, p.nvme) for p in self.plans))
        cols = ("stage", "params", "grads", "optim", "states", "transient", "total", "cpu", "nvme", "comm", "fits")
        rows = []
        for p in self.plans:
            psi_units = p.comm_elements / p.num_params if p.num_params else 0.0
            fits = "-" if p.fits is None else ("yes" if p.fits else "NO")
            sizes = (p.params, p.grads, p.optimizer_state, p.model_state_bytes, p.transient, p.device_total, p.cpu, p.nvme)
            stage = f"{p.stage} {p.name}" + ("*" if offload and not p.offload else "")
            rows.append((stage, *(format_gb(b, scale) for b in sizes), f"{psi_units:.1f}Ψ", fits))
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        line = lambda r: "  ".join(s.ljust(w) if i == 0 else s.rjust(w) for i, (s, w) in enumerate(zip(r, widths)))  # noqa: E731
        dev = "" if first.device_bytes is None else f", device {format_gb(first.device_bytes, scale)} {name}"
        head = (
            f"Ψ = {first.num_params:,} params ({first.trainable_params:,} trainable), dp = {first.dp}, "
            f"{first.precision}, {first.optimizer} (K = {first.optimizer_bytes_per_param} B/param), "
            f"offload = {offload or 'none'}{dev}\n"
            f"bytes per rank in {name} (1e{9 if name == 'GB' else 6}); states = params + grads + optim (ZeRO paper, "
            "Table 1); comm per step in the paper's unit (all-reduce of Ψ = 2Ψ)"
        )
        foot = ["* DDP cannot offload: planned without it"] if offload and any(not p.offload for p in self.plans) else []
        return "\n".join([head, line(cols), *map(line, rows), *foot])

    __str__ = render


def plan_table(num_params: int | nn.Module, *, stages: Iterable[int] = (0, 1, 2, 3), **kwargs: object) -> StageTable:
    """:func:`plan_memory` for each of ``stages`` (default 0-3) with the same settings.

    Stage 0 (DDP) cannot offload: with ``offload`` set it is planned without offload, and
    ``offload_params`` and ``reshard_after_forward`` apply to stage 3 only.

    Example:
        >>> t = plan_table(7_500_000_000, dp=64, precision="fp16")
        >>> [format_gb(p.model_state_bytes) for p in t.plans]
        ['120', '31.4', '16.6', '1.88']
    """
    stages = tuple(stages)
    if not stages:
        raise ValueError("stages must name at least one stage")
    plans = []
    for s in stages:
        kw = dict(kwargs)
        if s == 0:
            kw.pop("offload", None)
        if s != 3:
            kw.pop("offload_params", None)
            kw.pop("reshard_after_forward", None)
        plans.append(plan_memory(num_params, stage=s, **kw))  # type: ignore[arg-type]
    return StageTable(tuple(plans))
