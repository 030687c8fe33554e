"""Stage splitting (no processes): partitions against brute force, explicit sizes, errors."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardkit.parallel.pipeline.split import partition, split_blocks


def _brute_min_max(weights: list[int], k: int) -> int:
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        cost = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.data())
def test_params_split_is_optimal_and_contiguous(weights, data):
    k = data.draw(st.integers(1, len(weights)))
    sizes = partition(weights, k, "params")
    assert len(sizes) == k and sum(sizes) == len(weights) and min(sizes) >= 1
    starts = [0, *itertools.accumulate(sizes)]
    cost = max(sum(weights[a:b]) for a, b in itertools.pairwise(starts))
    assert cost == _brute_min_max(weights, k)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.data())
def test_layer_split_is_balanced(n, data):
    k = data.draw(st.integers(1, n))
    sizes = partition([1] * n, k, "layers")
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the remainder goes to the first stages


def test_examples():
    assert partition([1] * 5, 2) == [3, 2]
    assert partition([10, 1, 1, 1, 10], 3, "params") == [1, 3, 1]
    assert partition([1] * 5, 2, [1, 4]) == [1, 4]


@pytest.mark.parametrize(
    "args, match",
    [
        (([1, 1, 1], 4), "cannot split 3 blocks into 4 pipeline stages"),
        (([1, 1, 1], 2, "flops"), "split must be"),
        (([1, 1, 1], 2, [1, 1]), "sum to 2, but there are 3 blocks"),
        (([1, 1, 1], 2, [3]), "lists 1 stage sizes but there are 2"),
        (([1, 1, 1], 2, [3, 0]), "ints >= 1"),
        (([1, 1, 1], 0), "num_stages"),
    ],
)
def test_bad_splits(args, match):
    with pytest.raises(ValueError, match=match):
        partition(*args)


def test_split_blocks_keeps_the_same_modules():
    blocks = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 100), nn.Linear(100, 4))
    stages = split_blocks(blocks, 2, "params")
    # params: 40, 20, 500, 404 -> [40 + 20 + 500 | 404]
    assert [list(r) for r, _ in stages] == [[0, 1, 2], [3]]
    assert stages[1][1][0] is blocks[3]
    with pytest.raises(TypeError, match="single Linear"):
        split_blocks(nn.Linear(2, 2), 1)
    with pytest.raises(TypeError, match=r"blocks\[1\] must be an nn.Module"):
        split_blocks([nn.Linear(2, 2), "relu"], 1)
