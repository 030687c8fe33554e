"""Which directory ``shardkit consolidate`` reads: a checkpoint directory as given, or the tag that
DeepSpeed's ``latest`` file names (``shardkit.initialize``'s ``engine.save_checkpoint`` layout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkit.consolidate import resolve_tag


def test_latest_file_or_its_directory_resolve_to_the_named_tag(tmp_path: Path) -> None:
    (tmp_path / "global_step7").mkdir()
    (tmp_path / "latest").write_text("global_step7\n")
    assert resolve_tag(tmp_path / "latest") == tmp_path / "global_step7"
    assert resolve_tag(tmp_path) == tmp_path / "global_step7"


def test_a_checkpoint_directory_is_read_as_given(tmp_path: Path) -> None:
    ckpt = tmp_path / "latest"  # shardkit train's layout: latest is the checkpoint directory itself
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{}")
    assert resolve_tag(ckpt) == ckpt
    (tmp_path / "step3").mkdir()
    (tmp_path / "step3" / "manifest.json").write_text("{}")
    (tmp_path / "step3" / "latest").write_text("elsewhere")  # a manifest wins over a stray tag file
    assert resolve_tag(tmp_path / "step3") == tmp_path / "step3"


def test_missing_paths_and_dangling_tags_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        resolve_tag(tmp_path / "nope")
    (tmp_path / "latest").write_text("gone")
    with pytest.raises(ValueError, match="names tag 'gone'"):
        resolve_tag(tmp_path / "latest")
