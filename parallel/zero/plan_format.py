"""Number formatting shared by the planner and its tables: the paper's GB, rounded as it prints them."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

__all__ = ["format_gb"]

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


def _unit(largest: int) -> tuple[int, str]:
    """GB unless everything is below 1 GB (a small model): then MB (10^6)."""
    return (_GB, "GB") if largest >= _GB else (10**6, "MB")
