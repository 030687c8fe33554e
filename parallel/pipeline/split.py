"""Split a sequence of blocks into pipeline stages (the plan is a pure function of sizes).

A model for pipelining is given as an ordered sequence of blocks — an ``nn.Sequential`` or a
list of modules, embedding first and head last — whose composition is the model: block ``j``
takes block ``j - 1``'s single output tensor. :func:`partition` decides, from per-block weights
alone, how many consecutive blocks each of ``S`` stages gets; :func:`split_blocks` applies it.
:func:`measure_block_times` supplies measured seconds as the weights of ``split="time"``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["as_block_list", "measure_block_times", "partition", "split_blocks"]

SplitSpec = str | Sequence[int]


def as_block_list(blocks: nn.Sequential | Sequence[nn.Module]) -> list[nn.Module]:
    """The blocks as a list, checking each is an ``nn.Module``.

    Raises:
        TypeError: ``blocks`` is not a sequence of modules.
    """
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        raise TypeError(
            f"blocks must be an nn.Sequential or a sequence of modules (embedding first, head last), "
            f"got a single {type(blocks).__name__}"
        )
    out = list(blocks)
    for j, b in enumerate(out):
        if not isinstance(b, nn.Module):
            raise TypeError(f"blocks[{j}] must be an nn.Module, got {type(b).__name__}")
    return out


def _balanced_min_max(weights: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous partition of ``weights`` into ``num_stages`` non-empty runs minimising the
    heaviest run (the pipeline's throughput is set by its slowest stage); exact, by dynamic
    programming over prefixes. Ties go to the split that puts fewer blocks in earlier stages."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][j]: minimal max-run weight splitting weights[:j] into k runs; cut[k][j]: last cut
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    sizes, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def partition(weights: Sequence[float], num_stages: int, split: SplitSpec = "layers") -> list[int]:
    """How many consecutive blocks each stage gets.

    Args:
        weights: per-block cost, ints or floats >= 0, e.g. parameter counts or measured seconds
            (only used by ``split="params"`` and ``"time"``).
        num_stages: ``S >= 1``, the number of stages (``p * v``).
        split: ``"layers"`` (equal block counts; the first ``n % S`` stages get one more, as
            ``numpy.array_split``), ``"params"`` or ``"time"`` (both minimise the largest stage's
            total weight; the names say what the weights are), or an explicit list of ``S``
            positive sizes summing to the number of blocks.

    Returns:
        ``S`` positive block counts summing to ``len(weights)``.

    Raises:
        ValueError: more stages than blocks, a bad ``split`` (named), sizes that do not add up.

    Example:
        >>> partition([1, 1, 1, 1, 1], 2)
        [3, 2]
        >>> partition([10, 1, 1, 1, 10], 3, "params")
        [1, 3, 1]
        >>> partition([0.5, 0.1, 0.1, 0.2], 2, "time")
        [1, 3]
    """
    n = len(weights)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(
            f"cannot split {n} blocks into {num_stages} pipeline stages (pp size x virtual_stages): "
            f"every stage needs at least one block; pass more, smaller blocks or fewer stages"
        )
    if isinstance(split, str):
        if split == "layers":
            q, rem = divmod(n, num_stages)
            return [q + (s < rem) for s in range(num_stages)]
        if split in ("params", "time"):
            ws = [float(w) for w in weights]
            if any(not w >= 0 for w in ws):  # also rejects NaN
                raise ValueError(f"weights must be finite numbers >= 0 for split={split!r}, got {list(weights)}")
            return _balanced_min_max(ws, num_stages)
        raise ValueError(f"split must be 'layers', 'params', 'time' or a list of stage sizes, got {split!r}")
    sizes = list(split)
    if len(sizes) != num_stages:
        raise ValueError(f"split lists {len(sizes)} stage sizes but there are {num_stages} stages")
    if any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in sizes):
        raise ValueError(f"split sizes must be ints >= 1, got {sizes}")
    if sum(sizes) != n:
        raise ValueError(f"split sizes {sizes} sum to {sum(sizes)}, but there are {n} blocks")
    return sizes


def split_blocks(
    blocks: nn.Sequential | Sequence[nn.Module],
    num_stages: int,
    split: SplitSpec = "layers",
    *,
    weights: Sequence[float] | None = None,
) -> list[tuple[range, nn.Sequential]]:
    """Split ``blocks`` into ``num_stages`` stages of consecutive blocks.

    The stage modules hold the *same* block objects (no copy), so a stage's parameters are the
    original model's.

    Args:
        blocks: ``nn.Sequential`` or a sequence of modules, embedding first, head last.
        num_stages: number of stages ``S``.
        split: see :func:`partition`; ``"params"`` weighs each block by its parameter count.
        weights: per-block weights replacing the parameter counts (``split="time"`` needs
            them: seconds per block, e.g. from :func:`measure_block_times`).

    Returns:
        ``S`` pairs ``(block indices, nn.Sequential of those blocks)``.

    Example:
        >>> stages = split_blocks(nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)]), 2)
        >>> [list(r) for r, _ in stages]
        [[0, 1, 2], [3, 4]]
    """
    mods = as_block_list(blocks)
    if weights is None:
        if split == "time":
            raise ValueError("split='time' needs weights= (seconds per block, see measure_block_times)")
        weights = [sum(p.numel() for p in m.parameters()) for m in mods]
    elif len(weights) != len(mods):
        raise ValueError(f"weights has {len(weights)} entries but there are {len(mods)} blocks")
    sizes = partition(weights, num_stages, split)
    out, start = [], 0
    for size in sizes:
        idx = range(start, start + size)
        out.append((idx, nn.Sequential(*(mods[j] for j in idx))))
        start += size
    return out


def _sync(t: torch.Tensor) -> None:
    # CUDA kernels run asynchronously: the clock must wait for them to count them
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


def measure_block_times(
    blocks: nn.Sequential | Sequence[nn.Module],
    example: torch.Tensor,
    *,
    repeats: int = 3,
    warmup: int = 1,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    target: torch.Tensor | None = None,
) -> list[float]:
    """Seconds of forward + backward of each block, run in sequence on ``example``.

    Block ``j`` runs on block ``j - 1``'s output, detached (so each block's backward is timed
    alone); its backward is seeded with ``ones_like`` of its output (for the last block, the
    gradient of ``output.sum()``) and computes the input (not for block 0: its input is data, as
    in the pipeline) and parameter gradients through
    ``torch.autograd.grad``, so no ``.grad`` is created or changed. Buffers (e.g. BatchNorm
    running statistics) and the RNG state are restored afterwards: measuring leaves the model
    and the random stream as they were. Local: no collectives (see ``PipelineParallel``'s
    ``split="time"`` for the agreement between ranks).

    Args:
        blocks: ``nn.Sequential`` or sequence of modules, on the device they will run on.
        example: the first block's input for one micro-batch, any shape/dtype the first block
            takes (e.g. int64 token ids ``(b, t)``).
        repeats: timed runs (``>= 1``); each block's time is the median over them.
        warmup: untimed runs before (``>= 0``; allocator and kernel caches).
        loss_fn, target: both or neither. With them the last block's time includes
            ``loss_fn(output, target)`` (the last stage computes it: a large-vocabulary
            cross-entropy can cost as much as the head) and its backward starts from that loss;
            a ``(loss_sum, count)`` return is reduced by its first element.

    Returns:
        ``len(blocks)`` floats, seconds per block.

    Raises:
        ValueError: ``repeats < 1``, ``warmup < 0``, or one of ``loss_fn``/``target`` alone.
        TypeError: ``example`` is not a tensor, or ``blocks`` not modules.

    Example:
        >>> ts = measure_block_times([nn.Linear(64, 64), nn.Linear(64, 2048)], torch.randn(32, 64))
        >>> ts[1] > ts[0]
        True
    """
    mods = as_block_list(blocks)
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"example must be a torch.Tensor (the first block's input), got {type(example).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if (loss_fn is None) != (target is None):
        raise ValueError("loss_fn and target go together: give both to time the loss with the last block, or neither")
    buffers = [(b, b.detach().clone()) for m in mods for b in m.buffers()]
    devices = [t.device for _, t in buffers] + [example.device]
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    runs: list[list[float]] = []
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        for r in range(warmup + repeats):
            x, times = example, []
            for j, m in enumerate(mods):
                # the first stage's input is data: no input gradient there, as in the pipeline
                x = x.detach().requires_grad_(j > 0 and x.is_floating_point())
                params = [q for q in m.parameters() if q.requires_grad]
                _sync(x)
                t0 = time.perf_counter()
                out = m(x)
                seed: torch.Tensor | None = torch.ones_like(out)
                if loss_fn is not None and j == len(mods) - 1:
                    loss = loss_fn(out, target)
                    out, seed = (loss[0] if isinstance(loss, tuple) else loss), None
                wrt = ([x] if x.requires_grad else []) + params
                if out.requires_grad and wrt:
                    torch.autograd.grad(out, wrt, seed, allow_unused=True)
                _sync(out)
                times.append(time.perf_counter() - t0)
                x = out
            if r >= warmup:
                runs.append(times)
    for b, saved in buffers:
        b.detach().copy_(saved)  # detach: shares storage, and autograd need not see the restore
    return [statistics.median(ts) for ts in zip(*runs, strict=True)]
