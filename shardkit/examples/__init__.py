"""DeepSpeed example configs shipped with shardkit, usable after ``pip install``.

``zero2_config_accelerate.json`` (ZeRO-2, fp16, AdamW, WarmupDecayLR) and
``zero3_offload_config_accelerate.json`` (ZeRO-3 with the optimizer and params offloaded to the
CPU) are the two configs of Hugging Face Accelerate's DeepSpeed guide, copied verbatim, "auto"
values included: ``shardkit.initialize(config=config_path(name), ...)`` fills those from its
keyword arguments, ``shardkit config check`` lists them.

Example:
    >>> from shardkit.examples import EXAMPLE_CONFIGS, config_path
    >>> EXAMPLE_CONFIGS
    ('zero2_config_accelerate.json', 'zero3_offload_config_accelerate.json')
    >>> config_path("zero2_config_accelerate.json").is_file()
    True
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EXAMPLE_CONFIGS", "config_path"]

#: the shipped configs' file names
EXAMPLE_CONFIGS = ("zero2_config_accelerate.json", "zero3_offload_config_accelerate.json")


def config_path(name: str) -> Path:
    """The installed path of a shipped example config.

    Args:
        name: one of :data:`EXAMPLE_CONFIGS`.

    Raises:
        ValueError: ``name`` is not a shipped config (the message lists them).
    """
    if name not in EXAMPLE_CONFIGS:
        raise ValueError(f"name must be one of the shipped example configs {list(EXAMPLE_CONFIGS)}, got {name!r}")
    return Path(__file__).resolve().parent / name
