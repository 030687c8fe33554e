"""The import layering of docs/architecture.md, read from the source with ``ast`` (nothing imported).

Every import statement counts, at any depth: module level, inside functions (lazy imports) and
under ``if TYPE_CHECKING:``. A lazy import still makes one module depend on another, and a cycle
hidden behind one is a cycle.

* kernels/ (shardkit.kernels) never imports torch.distributed, comm/, parallel/ or the app.
* comm/ (shardkit.comm) never imports triton, kernels/, parallel/ or the app.
* parallel/ (shardkit.parallel) never imports the app (shardkit.train/cli/bench/models/data).
* No import cycles among shardkit modules (relative imports resolved).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# source folder -> package name (pyproject's package-dir)
PACKAGES = {"shardkit": "shardkit", "kernels": "shardkit.kernels", "comm": "shardkit.comm", "parallel": "shardkit.parallel"}
APP = (
    "shardkit.train",
    "shardkit.cli",
    "shardkit.bench",
    "shardkit.models",
    "shardkit.data",
    "shardkit.engine",
    "shardkit.consolidate",
)
FORBIDDEN = {
    "shardkit.kernels": ("torch.distributed", "shardkit.comm", "shardkit.parallel", *APP),
    "shardkit.comm": ("triton", "shardkit.kernels", "shardkit.parallel", *APP),
    "shardkit.parallel": APP,
}


def _module_files() -> dict[str, Path]:
    """Module name -> file, for every .py file of the four import packages."""
    modules: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = _module_files()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py" if name in MODULES else False


def imports_of(name: str, source: str) -> set[str]:
    """Absolute names of every module ``source`` (the code of module ``name``) imports.

    ``from X import y`` yields ``X.y`` when that is a module of ours, else ``X``; relative
    imports are resolved against ``name``'s package.
    """
    package = name if _is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in imports_of(name, path.read_text()) if m in MODULES} for name, path in MODULES.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


# ---- the checker itself, on known inputs ------------------------------------------------------
def test_imports_of_resolves_relative_lazy_and_type_checking_imports() -> None:
    src = (
        "import torch.distributed as dist\n"
        "from typing import TYPE_CHECKING\n"
        "from .grad_utils import clip_grad_norm_\n"
        "from . import buckets\n"
        "from ..comm import ParallelContext\n"
        "if TYPE_CHECKING:\n    from shardkit.train import TrainConfig\n"
        "def f():\n    import triton\n"
    )
    got = imports_of("shardkit.parallel.loss_scaler", src)
    assert {
        "torch.distributed",
        "shardkit.parallel.grad_utils",
        "shardkit.parallel.buckets",
        "shardkit.comm",
        "shardkit.train",
        "triton",
    } <= got
    assert imports_of("shardkit.parallel", "from .data_parallel import DataParallel\n") == {"shardkit.parallel.data_parallel"}


def test_find_cycle_on_known_graphs() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"a"}}) == ["a", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is no cycle


def test_every_package_is_scanned() -> None:
    for package in PACKAGES.values():
        assert package in MODULES
    assert "shardkit.parallel.strategy" in MODULES and "shardkit.train.loop" in MODULES


# ---- the rules -----------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(layer: str) -> None:
    bad = []
    for name, path in MODULES.items():
        if name != layer and not name.startswith(layer + "."):
            continue
        for imported in imports_of(name, path.read_text()):
            for banned in FORBIDDEN[layer]:
                if imported == banned or imported.startswith(banned + "."):
                    bad.append(f"{path.relative_to(REPO)} imports {imported}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


#: the libraries shardkit is measured against: only the benchmarks in perf/ (not shipped) import them
PEER_LIBRARIES = (
    "deepspeed",
    "cupy",
    "apex",
    "megatron",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
    "torch.distributed.optim",
    "torch.nn.parallel",
)


def test_no_module_the_package_ships_imports_a_peer_library() -> None:
    """The wheel holds shardkit's own code; the peers it is compared with are the benchmarks'
    business. ``shardkit/engine`` reads DeepSpeed configs without importing DeepSpeed."""
    found = {
        name: sorted(i for i in imports_of(name, path.read_text()) if i.startswith(PEER_LIBRARIES))
        for name, path in MODULES.items()
    }
    assert {name: peers for name, peers in found.items() if peers} == {}
