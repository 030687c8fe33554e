"""Every ```python block of README.md runs as written, from a directory that is not the checkout.

A block whose first line is ``# torchrun --nproc-per-node N NAME.py`` is saved as ``NAME.py``
and launched that way (``--standalone`` added: a free rendezvous port, so tests can run side by
side); any other block runs with ``python``. Blocks that share files run in README order in one
directory, so the resume block reads the checkpoint the ZeRO block wrote, as a reader following
the README would: a block joins the chain of every earlier block whose file or directory names
it mentions (``"ckpt/step1"`` written by one and read by the next; ``"ckpt"`` saved over it
later). Each chain is its own test, so pytest-xdist's workers share them. CUDA is hidden: the
blocks take the CPU/gloo path they document.
"""

from __future__ import annotations

import ast
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
PATH_LIKE = re.compile(r"^[\w.\-]+(/[\w.\-]+)*$")  # a relative file or directory name
WORD = re.compile(r"^[\w\-]+$")


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


def _names(block: str) -> tuple[set[str], set[str]]:
    """``(roots, words)`` of a block's string literals: the first component of each relative path
    it names (``"ckpt/step1"``: ``ckpt``; ``"out.json"``: itself), and every one-word literal."""
    literals = [n.value for n in ast.walk(ast.parse(block)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    roots = {s.split("/")[0] for s in literals if PATH_LIKE.match(s) and ("/" in s or "." in s.strip("."))}
    return roots, {s for s in literals if WORD.match(s)} | roots


def chains(blocks: list[str]) -> list[list[int]]:
    """The blocks grouped so that a block runs after, in the same directory, every earlier block
    that names a file or directory it names; each group in README order, groups by first block."""
    names = [_names(b) for b in blocks]
    group = list(range(len(blocks)))

    def find(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for j, (roots_j, words_j) in enumerate(names):
        for i, (roots_i, words_i) in enumerate(names[:j]):
            if roots_j & words_i or words_j & roots_i:
                group[find(j)] = find(i)
    out: dict[int, list[int]] = {}
    for index in range(len(blocks)):
        out.setdefault(find(index), []).append(index)
    return sorted(out.values())


def test_python_blocks_are_found() -> None:
    """The extraction sees the README's blocks (a broken fence would silently test nothing), and
    every block is in exactly one chain, the resume block after the checkpoint it reads."""
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 8
    assert sum(TORCHRUN.match(b.splitlines()[0]) is not None for b in blocks) >= 5
    groups = chains(blocks)
    assert sorted(i for g in groups for i in g) == list(range(len(blocks)))
    saves = [i for i, b in enumerate(blocks) if "save_checkpoint(" in b]
    loads = [i for i, b in enumerate(blocks) if "load_checkpoint(" in b]
    assert saves and loads
    for j in loads:
        assert any(j in g and any(i in g and i < j for i in saves) for g in groups), (j, groups)


def _chain_ids() -> list[str]:
    return ["blocks-" + "-".join(map(str, g)) for g in chains(python_blocks(README.read_text()))]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("chain", range(len(_chain_ids())), ids=_chain_ids())
def test_readme_python_blocks_run_as_written(tmp_path: Path, chain: int) -> None:
    blocks = python_blocks(README.read_text())
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # the installed package, as a user has it
    failures = []
    for index in chains(blocks)[chain]:
        block = blocks[index]
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
