"""Kernel runtime: one Triton source, two executors, shared device helpers, launch accounting.

[Note: one kernel source, compiled on CUDA and interpreted on CPU]
Triton decides between compiling and interpreting when ``@triton.jit`` *decorates* a function
(it reads ``TRITON_INTERPRET`` at that moment), so a module-level ``@triton.jit`` pins one mode
for the whole process. shardkit kernels are therefore written as plain, undecorated Python
functions and wrapped in :class:`TritonKernel`, which builds both executors from that one source,
lazily and explicitly:

* ``triton.runtime.jit.JITFunction`` — compiled; used for CUDA tensors and for the
  ahead-of-time (AOT) compile checks in :mod:`shardkit.kernels.aot`.
* ``triton.runtime.interpreter.InterpretedFunction`` — Triton's interpreter; used for CPU
  tensors when a caller asks for ``backend="triton"`` (the test suite does, to check the very
  same source against torch on a machine with no GPU).

Both live in one process, no environment variable is read, and nothing is built at import time.
The interpreter is for correctness only: normal CPU use (``backend="auto"``) takes each op's
torch fast path instead.

[Note: device helpers]
Kernels call shared device functions (``@triton.jit`` helpers in Triton's terms) declared with
:func:`triton_helper` and called *by bare name* (``from .tl_helpers import load_chunk``). A
helper, like a kernel, is a plain function, so it cannot be bound to one mode either: each
executor is built from a copy of the function whose globals map every helper name it uses to
that helper built for the *same* executor — a ``JITFunction`` for compiled code (Triton inlines
it), the interpreter's rewritten Python function for interpreted code (called directly, since
the interpreted launch has already patched ``triton.language``; going through
``InterpretedFunction.__call__`` would re-patch the whole language on every call, ~0.5 ms).
Copying the globals also keeps the interpreter from writing its own names into our modules.
Triton's own ``@jit`` library functions (``tl.sum``, ``tl.max``, ...) are ``JITFunction`` objects
that refuse to be called from interpreted code unless the whole process runs with
``TRITON_INTERPRET=1``; an interpreted launch therefore swaps them, for its duration only, for
their interpreted form — what the interpreter itself does with ``tl.load`` and every other
builtin (so, like the interpreter, interpreted launches are not thread-safe).

[Note: multi-tensor launches]
A multi-tensor kernel updates many tensors in one launch. Its arguments are two small int64
tables: a pointer table ``ptrs[role, t]`` (``data_ptr()`` of tensor ``t`` in role ``role``, e.g.
param/grad/exp_avg) and per-tensor element counts; and a chunk table mapping each program id to
``(tensor index, chunk index)``. The chunk table depends only on sizes and is cached. The pointer
table depends only on the addresses: its device copy is cached by their values, so a launch whose
tensors kept their storage (optimizer state, masters, params, grads living in DDP/ZeRO buckets)
reuses it, and one with a moved tensor (a grad reallocated by ``zero_grad(set_to_none=True)``)
builds a new one with one small non-blocking copy. On an H200 this took the host cost of an
``adam_step`` over 51 tensors from about 55 µs to under the kernel's own 74 µs
(``perf/results/adam_sweep_cuda.json``). The shared preamble (which tensor and
chunk this program handles, each role's typed pointer) is :mod:`shardkit.kernels.tl_helpers`.

[Note: aligned full chunks]
128-bit loads/stores need the compiler to know that 4 consecutive fp32 (8 bf16) lanes are
16-byte aligned and all in bounds. Every chunk but a tensor's last is full, so kernels run the
chunk body twice in the source — unmasked for full chunks, masked for the tail — and, when the
launcher passes ``ALIGNED=True`` (every pointer of the launch 16-byte aligned: true for every
separately allocated tensor, false only for views at odd offsets), hint the pointers with
``tl.multiple_of``. A tensor's *size* no longer matters: a 1000-element bias or a 50257-row
embedding runs its full chunks vectorized and only its last chunk masked (scalar), where an
all-or-nothing ``numel % 16`` flag dropped the whole launch group to scalar accesses. Splitting
launch groups by alignment instead would cost an extra launch per group and still leave the odd
tensors' bulk scalar. Chunks start at multiples of ``BLOCK`` elements, so an aligned tensor's
chunks are all aligned.

[Note: launch device]
A compiled Triton launch runs on ``torch.cuda.current_device()`` and its current stream, while
the pointer tables live on the tensors' device; a launch is therefore made under
``torch.cuda.device(tensor.device)``, so params on ``cuda:1`` (or an optimizer whose launch
groups span two GPUs) run on their own device and its current stream.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "Backend",
    "TritonKernel",
    "triton_kernel",
    "TritonHelper",
    "triton_helper",
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

_active_counters: contextvars.ContextVar[tuple[Counter, ...]] = contextvars.ContextVar("shardkit_launch_counters", default=())


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


class TritonHelper:
    """A device function that kernels (and other helpers) call, for both executors.

    See [Note: device helpers]. Use :func:`triton_helper` as a decorator; call a helper only from
    kernel or helper source, by its bare name.

    Args:
        fn: the undecorated function (written as for ``@triton.jit``).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        functools.update_wrapper(self, fn)

    @functools.cached_property
    def jit(self) -> Any:
        """The compiled form (a ``JITFunction``, inlined by Triton at the call site)."""
        from triton.runtime.jit import JITFunction

        return JITFunction(_bind_helpers(self.fn, "jit"))

    @functools.cached_property
    def interpreted(self) -> Callable[..., Any]:
        """The interpreted form: the interpreter's rewritten Python function."""
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_bind_helpers(self.fn, "interpreted")).rewrite()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.name} is a Triton device helper: call it only from a kernel or helper")

    def __repr__(self) -> str:
        return f"TritonHelper({self.name})"


def triton_helper(fn: Callable[..., Any]) -> TritonHelper:
    """Declare a device helper callable from :class:`TritonKernel` kernels.

    Example:
        >>> @triton_helper
        ... def leaky_relu(x):
        ...     return tl.where(x >= 0, x, 0.01 * x)
        >>> def _act_kernel(x_ptr, n, BLOCK: tl.constexpr):
        ...     offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ...     x = tl.load(x_ptr + offs, mask=offs < n)
        ...     tl.store(x_ptr + offs, leaky_relu(x), mask=offs < n)
    """
    return TritonHelper(fn)


def _bind_helpers(fn: Callable[..., Any], mode: Literal["jit", "interpreted"]) -> Callable[..., Any]:
    """A copy of ``fn`` whose globals map each helper it names to that helper's ``mode`` form."""
    glob = dict(fn.__globals__)
    for name in fn.__code__.co_names:
        value = glob.get(name)
        if isinstance(value, TritonHelper):
            glob[name] = getattr(value, mode)
    copy = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return copy


@functools.cache
def _interpreted_tl_library() -> tuple[tuple[str, Callable[..., Any]], ...]:
    """``(name, interpreted form)`` of every Triton ``@jit`` library function in ``tl``."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    found = []
    for name, value in vars(tl).items():
        if isinstance(value, JITFunction):
            # A copy with copied globals: the rewriter must not write into triton's module, and
            # the function keeps referring to the library's own combine functions (the
            # interpreter reduces with numpy when it recognises e.g. ``_sum_combine``).
            found.append((name, InterpretedFunction(_bind_helpers(value.fn, "interpreted")).rewrite()))
    return tuple(found)


@contextlib.contextmanager
def _interpreted_tl_functions() -> Iterator[None]:
    """Make ``tl.sum`` & co. callable from interpreted code for the duration of a launch."""
    import triton.language as tl

    saved = [(name, getattr(tl, name)) for name, _ in _interpreted_tl_library()]
    try:
        for name, interpreted in _interpreted_tl_library():
            setattr(tl, name, interpreted)
        yield
    finally:
        for name, original in saved:
            setattr(tl, name, original)


class TritonKernel:
    """A Triton kernel source with a compiled (CUDA) and an interpreted (CPU) executor.

    See [Note: one kernel source, compiled on CUDA and interpreted on CPU]; the kernel may call
    helpers declared with :func:`triton_helper` (see [Note: device helpers]). A launch on CUDA
    tensors runs on their device (see [Note: launch device]).

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

        return JITFunction(_bind_helpers(self.fn, "jit"))

    @functools.cached_property
    def interpreted(self) -> Any:
        """The interpreter executor (``InterpretedFunction``), built on first use."""
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_bind_helpers(self.fn, "interpreted"))

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            device = _first_tensor_device(args, kwargs)
            for counter in _active_counters.get():
                counter[self.name] += 1
            if device.type == "cuda":
                with torch.cuda.device(device):  # [Note: launch device]
                    self.jit[grid](*args, **kwargs)
            else:
                with _interpreted_tl_functions():
                    self.interpreted[grid](*args, **kwargs)

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
    """True when every tensor starts on a 16-byte boundary (its size does not matter).

    Multi-tensor kernels pass this as ``ALIGNED`` (see [Note: aligned full chunks]).
    """
    return _all_aligned(t.data_ptr() for t in tensors)


def _all_aligned(ptrs: Iterable[int]) -> bool:
    """The one alignment rule: every address on a 16-byte boundary."""
    return all(ptr % 16 == 0 for ptr in ptrs)


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
        aligned: every tensor of every role starts on 16 bytes (see [Note: aligned full chunks]).
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
def _chunk_tables(numels: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    ptr_rows = tuple(tuple(t.data_ptr() for t in role) for role in roles)
    numel_t, chunk_tensor, chunk_index = _chunk_tables(numels, block, device)
    return MultiTensorTable(
        ptrs=_pointer_table(ptr_rows, device),
        numels=numel_t,
        chunk_tensor=chunk_tensor,
        chunk_index=chunk_index,
        n_tensors=len(first),
        n_chunks=int(chunk_tensor.numel()),
        aligned=_all_aligned(ptr for row in ptr_rows for ptr in row),  # is_aligned, from the same pointers
    )


# See [Note: multi-tensor launches]. Kernels only read the table, and freed then reused addresses
# give the same values, hence the same table. Entries are 8 bytes a pointer.
@functools.lru_cache(maxsize=64)
def _pointer_table(ptr_rows: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    ptrs = torch.tensor(ptr_rows, dtype=torch.int64)
    if device.type == "cuda":
        ptrs = ptrs.pin_memory().to(device, non_blocking=True)
    return ptrs


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
