"""Kernel runtime: one Triton source, two executors, launch accounting.

[Note: one kernel source, compiled on CUDA and interpreted on CPU]
Triton decides between compiling and interpreting when ``@triton.jit`` *decorates* a function
(it reads ``TRITON_INTERPRET`` at that moment), so a module-level ``@triton.jit`` pins one mode
for the whole process. shardkit kernels are therefore written as plain, undecorated Python
functions and wrapped in :class:`TritonKernel`, which builds both executors from that one source,
lazily and explicitly:

* ``triton.runtime.jit.JITFunction(fn)`` — compiled; used for CUDA tensors and for the
  ahead-of-time (AOT) compile checks in :mod:`shardkit.kernels.aot`.
* ``triton.runtime.interpreter.InterpretedFunction(fn)`` — Triton's interpreter; used for CPU
  tensors when a caller asks for ``backend="triton"`` (the test suite does, to check the very
  same source against torch on a machine with no GPU).

Both live in one process, no environment variable is read, and nothing is built at import time.
The interpreter is for correctness only: normal CPU use (``backend="auto"``) takes each op's
torch fast path instead. Kernels must not call other ``@triton.jit`` helpers (a helper would be
bound to one mode); they are written self-contained.

[Note: multi-tensor launches]
A multi-tensor kernel updates many tensors in one launch. Its arguments are two small int64
tables: a pointer table ``ptrs[role, t]`` (``data_ptr()`` of tensor ``t`` in role ``role``, e.g.
param/grad/exp_avg) and per-tensor element counts; and a chunk table mapping each program id to
``(tensor index, chunk index)``. The chunk table depends only on sizes and is cached; the pointer
table is rebuilt per call (gradients are reallocated by ``zero_grad(set_to_none=True)``) and
copied to the device with one small non-blocking copy. Kernels cast loaded addresses with
``.to(tl.pointer_type(DTYPE))``. When every tensor is 16-byte aligned with a size that is a
multiple of 16 the launcher passes ``ALIGNED=True`` and the kernel adds ``tl.multiple_of``
hints, which is what lets the compiler emit 128-bit vector loads/stores.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "Backend",
    "TritonKernel",
    "triton_kernel",
    "count_launches",
    "resolve_backend",
    "MultiTensorTable",
    "multi_tensor_table",
    "torch_to_triton_dtype",
    "is_aligned",
    "elementwise_launch_config",
    "live_multi_tensor_table",
]

Backend = Literal["auto", "triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")

_active_counters: contextvars.ContextVar[tuple[Counter, ...]] = contextvars.ContextVar(
    "shardkit_launch_counters", default=()
)


@contextlib.contextmanager
def count_launches() -> Iterator[Counter]:
    """Count Triton kernel launches made inside the block, by kernel name.

    Torch fast-path calls are not counted (they are not shardkit kernels).

    Example:
        >>> with count_launches() as launches:
        ...     opt.step()
        >>> launches["_adam_kernel"]
        1
    """
    counter: Counter = Counter()
    token = _active_counters.set(_active_counters.get() + (counter,))
    try:
        yield counter
    finally:
        _active_counters.reset(token)


def resolve_backend(backend: str, device: torch.device) -> Literal["triton", "torch"]:
    """Map a user-facing backend choice to the executor used for ``device``.

    ``"auto"`` is compiled Triton on CUDA and the torch fast path elsewhere; ``"triton"`` on a
    CPU device means Triton's interpreter (correctness only, slow); ``"torch"`` is torch's own
    fused/foreach ops on any device.

    Raises:
        ValueError: ``backend`` is not one of ``"auto"``, ``"triton"``, ``"torch"``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend  # type: ignore[return-value]


class TritonKernel:
    """A Triton kernel source with a compiled (CUDA) and an interpreted (CPU) executor.

    See [Note: one kernel source, compiled on CUDA and interpreted on CPU].

    Args:
        fn: the undecorated kernel function (written as for ``@triton.jit``).

    Example:
        >>> def _scale_kernel(x_ptr, n_elements, alpha, BLOCK: tl.constexpr): ...
        >>> scale = triton_kernel(_scale_kernel)
        >>> scale[(triton.cdiv(x.numel(), 1024),)](x, x.numel(), 2.0, BLOCK=1024)
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        functools.update_wrapper(self, fn)

    @functools.cached_property
    def jit(self) -> Any:
        """The compiled executor (``JITFunction``), built on first use."""
        from triton.runtime.jit import JITFunction

        return JITFunction(self.fn)

    @functools.cached_property
    def interpreted(self) -> Any:
        """The interpreter executor (``InterpretedFunction``), built on first use."""
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(self.fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            device = _first_tensor_device(args, kwargs)
            runner = self.jit if device.type == "cuda" else self.interpreted
            for counter in _active_counters.get():
                counter[self.name] += 1
            runner[grid](*args, **kwargs)

        return launch

    def __repr__(self) -> str:
        return f"TritonKernel({self.name})"


def triton_kernel(fn: Callable[..., Any]) -> TritonKernel:
    """Wrap an undecorated kernel function; see :class:`TritonKernel`."""
    return TritonKernel(fn)


def _first_tensor_device(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    raise TypeError("a Triton launch needs at least one tensor argument")


def torch_to_triton_dtype(dtype: torch.dtype) -> Any:
    """The ``tl`` dtype for a torch floating dtype (fp32, fp16, bf16).

    Raises:
        TypeError: for any other dtype.
    """
    import triton.language as tl

    table = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if dtype not in table:
        raise TypeError(f"unsupported dtype {dtype}: expected float32, float16 or bfloat16")
    return table[dtype]


def is_aligned(tensors: Sequence[torch.Tensor]) -> bool:
    """True when every tensor starts on 16 bytes and has a multiple of 16 elements.

    Multi-tensor kernels pass this as ``ALIGNED`` (see [Note: multi-tensor launches]).
    """
    return all(t.data_ptr() % 16 == 0 and t.numel() % 16 == 0 for t in tensors)


@dataclass(frozen=True)
class MultiTensorTable:
    """Launch tables for a multi-tensor kernel (see [Note: multi-tensor launches]).

    Attributes:
        ptrs: int64 ``[n_roles, n_tensors]`` data pointers, on the tensors' device.
        numels: int64 ``[n_tensors]`` element counts.
        chunk_tensor: int32 ``[n_chunks]``: tensor index of each program.
        chunk_index: int32 ``[n_chunks]``: chunk (of ``block`` elements) within that tensor.
            Contract relied on by kernels (e.g. the grad epilogue's fixed-order reduction): a
            tensor's chunks have consecutive program ids, in chunk order, tensors in order, so
            ``pid - chunk_index`` is the tensor's first program.
        n_tensors: number of tensors per role.
        n_chunks: grid size.
        aligned: every tensor 16-byte aligned with a multiple of 16 elements.
    """

    ptrs: torch.Tensor
    numels: torch.Tensor
    chunk_tensor: torch.Tensor
    chunk_index: torch.Tensor
    n_tensors: int
    n_chunks: int
    aligned: bool


# Bounded: entries are device tensors (~8 bytes per chunk: about 55 MB for a 7B-param launch group
# at BLOCK=1024), and each distinct size pattern (e.g. params that skip steps) adds one.
@functools.lru_cache(maxsize=16)
def _chunk_tables(
    numels: tuple[int, ...], block: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tensor_ids: list[int] = []
    chunk_ids: list[int] = []
    for t, n in enumerate(numels):
        n_chunks = -(-n // block)
        tensor_ids.extend([t] * n_chunks)
        chunk_ids.extend(range(n_chunks))
    as_dev = functools.partial(torch.tensor, device=device)
    return (
        as_dev(list(numels), dtype=torch.int64),
        as_dev(tensor_ids, dtype=torch.int32),
        as_dev(chunk_ids, dtype=torch.int32),
    )


def multi_tensor_table(roles: Sequence[Sequence[torch.Tensor]], block: int) -> MultiTensorTable:
    """Build the launch tables for tensors grouped by role.

    Args:
        roles: ``roles[r][t]`` is tensor ``t`` in role ``r`` (e.g. params, grads, exp_avgs).
            Every role lists the same number of tensors, and tensor ``t`` has the same number of
            elements in every role. All tensors are contiguous, on one device.
        block: elements per program (the kernel's ``BLOCK``).

    Returns:
        The :class:`MultiTensorTable`; zero-element tensors get no chunk.
    """
    first = roles[0]
    device = first[0].device
    numels = tuple(t.numel() for t in first)
    ptr_rows = [[t.data_ptr() for t in role] for role in roles]
    ptrs = torch.tensor(ptr_rows, dtype=torch.int64)
    if device.type == "cuda":
        ptrs = ptrs.pin_memory().to(device, non_blocking=True)
    numel_t, chunk_tensor, chunk_index = _chunk_tables(numels, block, device)
    return MultiTensorTable(
        ptrs=ptrs,
        numels=numel_t,
        chunk_tensor=chunk_tensor,
        chunk_index=chunk_index,
        n_tensors=len(first),
        n_chunks=int(chunk_tensor.numel()),
        aligned=all(is_aligned(role) for role in roles),
    )


def elementwise_launch_config(device: torch.device, max_numel: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` shared by the elementwise multi-tensor optimizer kernels.

    A pure function of device and size. CUDA: 1024 elements and 4 warps — 8 fp32 per thread, two
    128-bit accesses per tensor, no spills at sm_80/sm_90 (``perf/results/kernel_report.json``).
    Interpreter: it pays per program instance, so one large block per tensor, 1024 to 2^16.

    Example:
        >>> elementwise_launch_config(torch.device("cuda"), 1 << 20)
        (1024, 4)
    """
    if device.type == "cuda":
        return 1024, 4
    return min(max(1 << (max(max_numel, 1) - 1).bit_length(), 1024), 65536), 4


def live_multi_tensor_table(
    roles: Sequence[Sequence[torch.Tensor]],
    launch_config: Callable[[torch.device, int], tuple[int, int]] = elementwise_launch_config,
) -> tuple[MultiTensorTable, int, int] | None:
    """Drop zero-element tensors from every role, pick the launch config, build the tables.

    Args:
        roles: as for :func:`multi_tensor_table`; ``roles[0]`` decides which tensors are empty.
        launch_config: ``(device, max_numel) -> (BLOCK, num_warps)``.

    Returns:
        ``(table, BLOCK, num_warps)``, or None when every tensor is empty (launch nothing).

    Example:
        >>> built = live_multi_tensor_table([params, grads])
        >>> if built is not None:
        ...     table, block, num_warps = built
    """
    live = [i for i, t in enumerate(roles[0]) if t.numel() > 0]
    if not live:
        return None
    if len(live) < len(roles[0]):
        roles = [[role[i] for i in live] for role in roles]
    block, num_warps = launch_config(roles[0][0].device, max(t.numel() for t in roles[0]))
    return multi_tensor_table(roles, block), block, num_warps
