"""The training summary's split of communication by link."""

from __future__ import annotations

import pytest

from shardkit.comm import CommStats
from shardkit.train.comm_report import bytes_per_link, fmt_links


def _stats() -> tuple[CommStats, CommStats]:
    wrapper, model = CommStats(), CommStats()
    wrapper.record("all_gather", "shardkit_dp[0, 1, 2, 3]", 400)
    wrapper.record("all_gather", "shardkit_dp_cp_block[0, 1]", 100)
    model.record("all_gather", "shardkit_dp[0, 1, 2, 3]", 40)
    model.record("all_reduce", "shardkit_tp[0, 1]", 8)
    return wrapper, model


def test_bytes_per_link_uses_the_machine_size_torchrun_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    links = bytes_per_link(list(_stats()), world=4)
    assert links == {"within_machine": 108, "across_machines": 440, "unplaced": 0}
    assert fmt_links(links) == " (440 B across machines, 108 B within)"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert bytes_per_link(list(_stats()), world=4) is None and fmt_links(None) == ""
