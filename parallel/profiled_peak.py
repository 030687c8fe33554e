"""The measured peak of a call: what the planners' activation figures are checked against.

``torch.profiler(profile_memory=True)`` records every allocation and free of torch's allocator
during the call; replayed in time order, the running sum's maximum above the level at the start
is the call's peak (its activations, gradients it creates and temporaries; tensors alive before
the call do not count). It sees torch's allocations only (not Python objects, not a
communication library's own buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["profiled_peak_bytes"]


def profiled_peak_bytes(fn: Callable[[], Any], *, device: str = "CPU") -> int:
    """Peak bytes torch allocated on ``device`` during ``fn()`` above the level at its start.

    Args:
        fn: the call to measure (run once).
        device: the profiler's device type name: ``"CPU"`` or ``"CUDA"``.

    Returns:
        The peak, in bytes (0 when ``fn`` allocated nothing it kept past a free).

    Example:
        >>> profiled_peak_bytes(lambda: torch.ones(1024) * 2) >= 2 * 4096   # both 4 KiB tensors at once
        True
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == device]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak
