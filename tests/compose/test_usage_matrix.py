"""The usage matrix: model families x usage patterns x layouts, each cell against the
dense single-process model (tests/usage_matrix.py has the axes, constraints, generator and runner).

``make test`` runs the pairwise cover (every pair of values of any two axes in some cell; SGD with
momentum, robust to another order of additions by construction, so not re-run under the guard);
``make test-matrix`` runs the full product (``-m slow_matrix``).
A cell that hits a known open bug is ``xfail(strict=True)`` naming the item, so it
fails loudly once fixed; a failure not in that list is a new bug (``reason="new: ..."``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import usage_matrix as um


# ---- known open bugs ------------------------------------------------------------------------------
# (reason, predicate over the cell, e.g. ``lambda c: um.LAYOUTS[c["layout"]].pp is not None``). Only
# open bugs; a cell matching none is expected to pass. Strict: a fixed bug turns its cells into
# failures to delete. Empty: every cell of the full matrix passed when it last ran (docs/testing.md).
KNOWN: tuple[tuple[str, Callable[[Mapping[str, str]], bool]], ...] = (
    # (reason, applies(cell)): cells expected to fail, run as strict xfails until fixed
)


def _known(cell: Mapping[str, str]) -> str | None:
    for reason, applies in KNOWN:
        if applies(cell):
            return reason
    return None


def _allowed(cell: Mapping[str, str]) -> bool:
    return um.impossible(cell) is None


def _params(cells: list[dict[str, str]]) -> list:
    out = []
    for cell in cells:
        reason = _known(cell)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(cell["model"], cell["usage"], cell["layout"], marks=marks, id=um.cell_id(cell)))
    return out


PAIRWISE = um.pairwise(um.AXES, _allowed)
FULL = um.full_product(um.AXES, _allowed)


def _run(dist_pool, model: str, usage: str, layout: str) -> None:
    dist_pool.run(um.run_cell, model, usage, layout, world_size=um.LAYOUTS[layout].world, timeout=300)


@pytest.mark.parametrize(("model", "usage", "layout"), _params(PAIRWISE))
def test_pairwise_cell(dist_pool, model: str, usage: str, layout: str) -> None:
    _run(dist_pool, model, usage, layout)


# Cells the full matrix found failing once, outside the pairwise cover: run in make test so that a
# regression shows there too (an MoE expert no token reached on one dp replica, with and without
# a pipeline).
FOUND_BY_THE_FULL_MATRIX = [
    {"model": "moe", "usage": "train", "layout": "ddp"},  # a param no rank used kept grad=None
    {"model": "moe", "usage": "train", "layout": "pp:interleaved*ddp"},  # the dp all-reduce sizes agree
]


@pytest.mark.parametrize(("model", "usage", "layout"), _params(FOUND_BY_THE_FULL_MATRIX))
def test_cell_found_by_the_full_matrix(dist_pool, model: str, usage: str, layout: str) -> None:
    _run(dist_pool, model, usage, layout)


@pytest.mark.slow_matrix
@pytest.mark.parametrize(("model", "usage", "layout"), _params(FULL))
def test_full_matrix_cell(dist_pool, model: str, usage: str, layout: str) -> None:
    _run(dist_pool, model, usage, layout)


# ---- the generator and the axes, without processes ------------------------------------------------
def test_pairwise_cover_holds_every_possible_pair_of_the_matrix():
    names = list(um.AXES)
    assert all(_allowed(c) for c in PAIRWISE)
    assert um.covered_pairs(PAIRWISE, names) == um.covered_pairs(FULL, names)
    # every value of every axis can run somewhere (no constraint empties a value)
    for name, values in um.AXES.items():
        assert {c[name] for c in FULL} == set(values), name
    assert len(PAIRWISE) < len(FULL)


def test_constraints_exclude_exactly_the_documented_combinations():
    assert um.impossible({"usage": "generate", "layout": "pp:gpipe"})
    assert um.impossible({"model": "gpt2", "layout": "sp*zero3"})
    assert um.impossible({"usage": "generate"}) is None  # a partial cell: no axis it reads is missing
    assert um.impossible({"model": "tinygpt", "usage": "generate", "layout": "sp*zero3"}) is None
    assert um.impossible({"usage": "generate", "layout": "cp:ulysses*zero2"})
    assert um.impossible({"model": "llama_gqa", "usage": "padded", "layout": "cp:ulysses*zero2"})
    assert um.impossible({"model": "tinygpt", "usage": "padded", "layout": "cp:ulysses*zero2"}) is None
    excluded = [c for c in um.full_product(um.AXES, lambda c: True) if not _allowed(c)]
    assert um.impossible({"usage": "dropout", "layout": "cp:ring*tp"})
    assert um.impossible({"usage": "dropout", "layout": "cp:hybrid"})
    assert um.impossible({"usage": "dropout", "layout": "cp:ulysses*zero2"}) is None
    # generate x (4 pp + 3 cp layouts) x 4 models; 3 HF models x sp (every usage, generate counted
    # once); 3 HF models x padded x 3 cp layouts; dropout x (ring, hybrid) x 4 models
    assert len(excluded) == len(um.MODELS) * 7 + 3 * (len(um.USAGES) - 1) + 3 + 3 * 3 + 2 * len(um.MODELS)


@st.composite
def _axes_and_forbidden(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=2, max_size=4))
    axes = {f"a{i}": tuple(f"v{j}" for j in range(n)) for i, n in enumerate(sizes)}
    pairs = [
        ((a, x), (b, y)) for a, b in itertools.combinations(axes, 2) for x in axes[a] for y in axes[b]
    ]  # fmt: skip
    forbidden = draw(st.sets(st.sampled_from(pairs), max_size=4))
    return axes, forbidden


@settings(max_examples=60, deadline=None)
@given(_axes_and_forbidden())
def test_pairwise_covers_every_allowed_pair_of_any_two_axes(case):
    """The generator on random axes with random forbidden pairs: each returned cell is allowed,
    and each pair of values that some allowed cell holds appears in a returned cell."""
    axes, forbidden = case

    def allowed(cell: Mapping[str, str]) -> bool:
        return not any(cell.get(a) == x and cell.get(b) == y for (a, x), (b, y) in forbidden)

    cells = um.pairwise(axes, allowed)
    assert all(allowed(c) and set(c) == set(axes) for c in cells)
    names = list(axes)
    assert um.covered_pairs(cells, names) == um.covered_pairs(um.full_product(axes, allowed), names)
    assert len(cells) <= len(um.full_product(axes, allowed))


def test_pairwise_is_small_on_a_classic_case():
    # 3 binary axes: 4 cells suffice (the full product has 8)
    assert len(um.pairwise({"a": "xy", "b": "xy", "c": "xy"}, lambda c: True)) == 4
    # 4 ternary axes: the orthogonal array has 9 cells; greedy stays within a few of it
    assert len(um.pairwise({k: "xyz" for k in "abcd"}, lambda c: True)) <= 12


def test_moe_routes_experts_unevenly():
    """The MoE cells exercise what they claim: at the first step some expert gets tokens from one
    dp half of the batch only (a gradient on one rank), and some from neither (no gradient)."""
    model = um.build_model("moe")
    ids, _, _ = um.batch(0)
    seen: list[set[int]] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(set(out[2].flatten().tolist())))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(ids[: um.B // 2]), model(ids[um.B // 2 :])
    for hook in hooks:
        hook.remove()
    (first0, second0), (first1, second1) = (seen[0], seen[2]), (seen[1], seen[3])
    assert first0 ^ second0, seen  # layer 0: hit on one replica only
    assert set(range(um.N_EXPERTS)) - (first1 | second1), seen  # layer 1: an expert nobody reached
