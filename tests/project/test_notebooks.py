"""Execute every tutorial notebook end to end (their cells assert their own claims)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts its own processes: run first (conftest.py)

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist() -> None:
    names = {p.name for p in NOTEBOOKS}
    assert {
        "01_fused_optimizers.ipynb",
        "02_data_parallel.ipynb",
        "03_zero.ipynb",
        "04_tensor_parallel.ipynb",
        "05_pipeline.ipynb",
        "06_from_deepspeed.ipynb",
        "07_context_parallel.ipynb",
    } <= names


@pytest.mark.timeout(900)  # DeepSpeed JIT-builds its CPU extensions on a fresh checkout
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


def test_notebooks_pin_the_cpu_path() -> None:
    """The notebooks train on CPU; on a GPU machine an unpinned ``from_env()`` picks NCCL and
    ``shardkit train`` (``--device auto``) picks CUDA, and both break the CPU cells. Every
    process-group construction must name gloo and every ``shardkit train`` run ``--device cpu``."""
    for path in NOTEBOOKS:
        source = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        for call in re.findall(r"from_env\([^)]*\)", source):
            assert 'backend="gloo"' in call, (path.name, call)
        if '"shardkit.cli", "train"' in source:
            assert '"--device", "cpu"' in source, path.name
