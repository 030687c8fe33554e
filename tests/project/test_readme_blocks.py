"""Every ```python block of README.md runs as written, from a directory that is not the checkout.

A block whose first line is ``# torchrun --nproc-per-node N NAME.py`` is saved as ``NAME.py``
and launched that way (``--standalone`` added: a free rendezvous port, so tests can run side by
side); any other block runs with ``python``. The blocks run in README order in one directory,
so the resume block reads the checkpoint the ZeRO block wrote, as a reader following the README
would. CUDA is hidden: the blocks take the CPU/gloo path they document.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts its own processes: run first (conftest.py)

README = Path(__file__).resolve().parents[2] / "README.md"
TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+) (\w+\.py)\s*$")
MAX_PROCESSES = 4


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def launch_command(block: str, index: int) -> tuple[str, list[str]]:
    """``(file name, command)`` that runs ``block`` as its first line says."""
    first = block.splitlines()[0]
    match = TORCHRUN.match(first)
    if match is None:
        name = f"readme_block_{index}.py"
        return name, [sys.executable, name]
    nproc, name = int(match.group(1)), match.group(2)
    assert nproc <= MAX_PROCESSES, f"block {index} asks for {nproc} processes (at most {MAX_PROCESSES} on this machine)"
    return name, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), name]


def test_python_blocks_are_found() -> None:
    """The extraction sees the README's blocks (a broken fence would silently test nothing)."""
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 8
    assert sum(TORCHRUN.match(b.splitlines()[0]) is not None for b in blocks) >= 5


@pytest.mark.timeout(1200)
def test_readme_python_blocks_run_as_written(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # the installed package, as a user has it
    failures = []
    for index, block in enumerate(python_blocks(README.read_text())):
        name, command = launch_command(block, index)
        (tmp_path / name).write_text(block)
        run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            errors = [line for line in run.stderr.splitlines() if re.search(r"\w(Error|Exception): ", line)][-4:]
            failures.append(
                f"--- block {index} ({' '.join(command[1:])}) exited {run.returncode}: {errors}\n"
                f"{run.stdout[-2000:]}{run.stderr[-3000:]}"
            )
    assert not failures, "\n".join(failures)
