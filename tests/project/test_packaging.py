"""The distribution ships every package: a folder with an ``__init__.py`` missing from
pyproject's explicit ``packages`` list works in the editable install (the tests' set-up) but is
silently left out of a wheel, so ``pip install .`` users would get an ImportError."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for dotted, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([dotted, *rel.parts]))
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"


def test_the_example_configs_are_package_data():
    """The DeepSpeed example configs the README names ship in the wheel: every file of
    ``shardkit/examples`` matches a package-data pattern and is listed by ``EXAMPLE_CONFIGS``."""
    from fnmatch import fnmatch

    from shardkit.examples import EXAMPLE_CONFIGS

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["shardkit.examples"]
    shipped = sorted(p.name for p in (ROOT / "shardkit" / "examples").iterdir() if p.suffix == ".json")
    assert shipped == sorted(EXAMPLE_CONFIGS)
    assert all(any(fnmatch(name, pat) for pat in patterns) for name in shipped)
