"""The measured peak of a call: what the planners' activation figures are checked against.

``torch.profiler(profile_memory=True)`` records every allocation and free of torch's allocator
during the call; replayed in time order, the running sum's maximum above the level at the start
is the call's peak (its activations, gradients it creates and temporaries; tensors alive before
the call do not count). It sees torch's allocations only (not Python objects, not a
communication library's own buffers).

[Note: frees the profiler does not see]
The profiler records the allocator's events on the thread that profiles, only. A collective's
tensors are also held by the communication backend's work object; when gloo's worker thread
drops that object after the caller has dropped its own reference, the tensor is freed *on that
thread*, a few microseconds after the collective, and the trace never sees the free: replayed,
the tensor looks alive to the end of the call. Whether the caller or gloo lets go last is a race,
so the same step measures 0, 1, 2 or more such tensors too high (all-to-all and ring buffers,
gradient buckets: up to about 5% of a context-parallel step's peak in perf/context_parallel.py). :func:`profiled_memory` counts the bytes
a call allocated and never freed in its trace; a call that keeps nothing (a training step after
its first, whose result is dropped) is exact when that count is 0. :func:`settled_peak_bytes`
repeats the call until one is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ProfiledMemory", "profiled_memory", "profiled_peak_bytes", "settled_peak_bytes"]


@dataclass(frozen=True)
class ProfiledMemory:
    """One profiled call's memory (see [Note: frees the profiler does not see]).

    Attributes:
        peak_bytes: the running sum's maximum above the level at the call's start.
        unfreed_bytes: bytes the call allocated whose free is not in its trace: tensors it kept
            (returned values are dropped inside the trace), or tensors freed by another thread
            (including those whose address the allocator handed out again: that free happened,
            unseen, before the reuse; the replay drops them there).
    """

    peak_bytes: int
    unfreed_bytes: int


def _device_kind(device: object) -> str:
    """``"cpu"`` or ``"cuda"`` from the ``device`` argument (either case), else a ``ValueError``."""
    if not isinstance(device, str) or device.lower() not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'CPU' or 'CUDA' (the profiler's device type), got {device!r}")
    return device.lower()


def profiled_memory(fn: Callable[[], Any], *, device: str = "CPU") -> ProfiledMemory:
    """Profile one ``fn()`` (its return value dropped inside the trace) and replay the allocator's
    events on ``device``.

    Args:
        fn: the call to measure (run once).
        device: ``"CPU"`` or ``"CUDA"``.

    Returns:
        A :class:`ProfiledMemory`.

    Example:
        >>> m = profiled_memory(lambda: torch.ones(1024) * 2)
        >>> m.peak_bytes >= 2 * 4096, m.unfreed_bytes      # both 4 KiB tensors at once; nothing kept
        (True, 0)
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    kind = _device_kind(device)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int, int]] = []  # (time, ptr, +size / -size)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.typed[1].device.type == kind:
            events.append((node.start_time_ns, node.typed[1].ptr, node.typed[1].alloc_size))
        stack.extend(node.children)
    cur = peak = missed = 0
    live: dict[int, int] = {}  # ptr -> bytes, for the allocations made inside the call
    for _, ptr, size in sorted(events, key=lambda e: e[0]):
        if size > 0 and ptr in live:  # the address is reused: the tensor there was freed unseen
            missed += live[ptr]
            cur -= live[ptr]
        cur += size
        peak = max(peak, cur)
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)  # absent: a tensor from before the call
    return ProfiledMemory(peak, missed + sum(live.values()))


def profiled_peak_bytes(fn: Callable[[], Any], *, device: str = "CPU") -> int:
    """Peak bytes torch allocated on ``device`` during ``fn()`` above the level at its start.

    One call, as traced: a collective's tensor freed by the backend's thread counts as alive to
    the end (see [Note: frees the profiler does not see]; :func:`settled_peak_bytes` avoids it).

    Args:
        fn: the call to measure (run once).
        device: the profiler's device type name: ``"CPU"`` or ``"CUDA"``.

    Returns:
        The peak, in bytes (0 when ``fn`` allocated nothing it kept past a free).

    Example:
        >>> profiled_peak_bytes(lambda: torch.ones(1024) * 2) >= 2 * 4096   # both 4 KiB tensors at once
        True
    """
    return profiled_memory(fn, device=device).peak_bytes


def settled_peak_bytes(
    fn: Callable[[], Any], *, tries: int = 8, group: dist.ProcessGroup | None = None, device: str = "CPU"
) -> tuple[int, int]:
    """The peak of ``fn()`` measured without the frees the trace misses: calls are profiled until
    one frees everything it allocated (see [Note: frees the profiler does not see]).

    ``fn`` must keep nothing between calls (e.g. a forward + backward after a first, warm-up
    call; its return value is dropped), else no call settles and the smallest peak is returned.
    With ``group``, every rank of it calls ``fn`` equally often, until each has had a settled
    call (one all-reduce per call, outside the traces). ``group`` must hold every rank that
    takes part in ``fn``'s collectives (a training step's gradient reduction spans dp x cp: pass
    that group or the world), else ranks stop at different calls and the next collectives pair
    up across calls.

    Args:
        fn: the call to measure; run up to ``tries`` times.
        tries: the most calls to profile (at least 1).
        group: a group holding every rank ``fn``'s collectives involve (e.g. ``dist.group.WORLD``),
            or ``None`` for a local ``fn``.
        device: ``"CPU"`` or ``"CUDA"``.

    Returns:
        ``(peak_bytes, call)``: the first settled call's peak and its number (1-based), or the
        smallest peak of the calls and ``-tries`` when none settled.

    Example:
        >>> settled_peak_bytes(lambda: par.forward_backward(x, y), group=dist.group.WORLD)  # after a first step
        (10567692, 2)
    """
    if isinstance(tries, bool) or not isinstance(tries, int) or tries < 1:
        raise ValueError(f"tries must be a positive int, got {tries!r}")
    kind = _device_kind(device)
    settled: tuple[int, int] | None = None
    peaks = []
    for call in range(1, tries + 1):
        m = profiled_memory(fn, device=device)
        peaks.append(m.peak_bytes)
        if settled is None and m.unfreed_bytes == 0:
            settled = (m.peak_bytes, call)
        done = settled is not None
        if group is not None:
            flag = torch.tensor([int(done)], device="cuda" if kind == "cuda" else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            done = bool(flag.item())
        if done:
            break
    return settled if settled is not None else (min(peaks), -tries)
