"""Split a sequence of blocks into pipeline stages (the plan is a pure function of sizes).

A model for pipelining is given as an ordered sequence of blocks — an ``nn.Sequential`` or a
list of modules, embedding first and head last — whose composition is the model: block ``j``
takes block ``j - 1``'s single output tensor. :func:`partition` decides, from per-block weights
alone, how many consecutive blocks each of ``S`` stages gets; :func:`split_blocks` applies it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["as_block_list", "partition", "split_blocks"]

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


def _balanced_min_max(weights: Sequence[int], num_stages: int) -> list[int]:
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


def partition(weights: Sequence[int], num_stages: int, split: SplitSpec = "layers") -> list[int]:
    """How many consecutive blocks each stage gets.

    Args:
        weights: per-block cost, e.g. parameter counts (only used by ``split="params"``).
        num_stages: ``S >= 1``, the number of stages (``p * v``).
        split: ``"layers"`` (equal block counts; the first ``n % S`` stages get one more, as
            ``numpy.array_split``), ``"params"`` (minimise the largest stage's total weight), or
            an explicit list of ``S`` positive sizes summing to the number of blocks.

    Returns:
        ``S`` positive block counts summing to ``len(weights)``.

    Raises:
        ValueError: more stages than blocks, a bad ``split`` (named), sizes that do not add up.

    Example:
        >>> partition([1, 1, 1, 1, 1], 2)
        [3, 2]
        >>> partition([10, 1, 1, 1, 10], 3, "params")
        [1, 3, 1]
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
        if split == "params":
            return _balanced_min_max(list(weights), num_stages)
        raise ValueError(f"split must be 'layers', 'params' or a list of stage sizes, got {split!r}")
    sizes = list(split)
    if len(sizes) != num_stages:
        raise ValueError(f"split lists {len(sizes)} stage sizes but there are {num_stages} stages")
    if any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in sizes):
        raise ValueError(f"split sizes must be ints >= 1, got {sizes}")
    if sum(sizes) != n:
        raise ValueError(f"split sizes {sizes} sum to {sum(sizes)}, but there are {n} blocks")
    return sizes


def split_blocks(
    blocks: nn.Sequential | Sequence[nn.Module], num_stages: int, split: SplitSpec = "layers"
) -> list[tuple[range, nn.Sequential]]:
    """Split ``blocks`` into ``num_stages`` stages of consecutive blocks.

    The stage modules hold the *same* block objects (no copy), so a stage's parameters are the
    original model's.

    Args:
        blocks: ``nn.Sequential`` or a sequence of modules, embedding first, head last.
        num_stages: number of stages ``S``.
        split: see :func:`partition`; ``"params"`` weighs each block by its parameter count.

    Returns:
        ``S`` pairs ``(block indices, nn.Sequential of those blocks)``.

    Example:
        >>> stages = split_blocks(nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)]), 2)
        >>> [list(r) for r, _ in stages]
        [[0, 1, 2], [3, 4]]
    """
    mods = as_block_list(blocks)
    weights = [sum(p.numel() for p in m.parameters()) for m in mods]
    sizes = partition(weights, num_stages, split)
    out, start = [], 0
    for size in sizes:
        idx = range(start, start + size)
        out.append((idx, nn.Sequential(*(mods[j] for j in idx))))
        start += size
    return out
