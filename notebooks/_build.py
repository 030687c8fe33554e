"""Build the tutorial notebooks from their cell sources (run: python notebooks/_build.py).

Each notebook's cells live in ``notebooks/_src/nbNN_*.py`` (``NAME``: the .ipynb file, ``CELLS``:
nbformat cells), which keeps diffs readable and lets each notebook be edited on its own;
`make test` executes the .ipynb files (tests/project/test_notebooks.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
from nbformat.v4 import new_notebook

HERE = Path(__file__).parent
KERNELSPEC = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}


def sources() -> list[Path]:
    """The cell-source modules, in notebook order."""
    return sorted((HERE / "_src").glob("nb[0-9][0-9]_*.py"))


def build(path: Path) -> Path:
    """Write the notebook whose cells ``path`` defines; returns the .ipynb path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = HERE / module.NAME
    nbformat.write(new_notebook(cells=module.CELLS, metadata=KERNELSPEC), out)
    return out


if __name__ == "__main__":
    for src in sources():
        print("wrote", build(src).relative_to(HERE.parent))
