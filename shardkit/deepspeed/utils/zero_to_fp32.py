"""``deepspeed.utils.zero_to_fp32``: a training checkpoint → one fp32 ``state_dict``.

DeepSpeed scripts export their ZeRO checkpoints with these functions, or with the
``zero_to_fp32.py`` script DeepSpeed copies next to each checkpoint.
:meth:`shardkit.engine.Engine.save_checkpoint` writes a ``zero_to_fp32.py`` too. It calls
:func:`main` here, with DeepSpeed's command line::

    python ckpt/zero_to_fp32.py ckpt export/            # export/pytorch_model.bin
    python ckpt/zero_to_fp32.py ckpt export/ -t global_step100 --safe_serialization

The work is :func:`shardkit.consolidate.fp32_state_dict`. It reads a shardkit checkpoint of any
layout (ZeRO 0-3, tensor or pipeline parallel, any world size) in one process. Trained
parameters come from their fp32 masters; frozen parameters and buffers keep their saved dtype.
Two things differ from DeepSpeed:

* the output is one file, never split at ``max_shard_size`` (accepted, unused);
* ``exclude_frozen_parameters=True`` is refused. The checkpoint does not record which entries
  were frozen.

Example:
    >>> from shardkit.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    >>> model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint("ckpt"))
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
]


def _checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None) -> Path:
    return Path(checkpoint_dir) / tag if tag is not None else Path(checkpoint_dir)


def _no_frozen_exclusion(exclude_frozen_parameters: bool) -> None:
    if exclude_frozen_parameters:
        raise ValueError(
            "exclude_frozen_parameters=True: not offered (a shardkit checkpoint does not record which "
            "entries were frozen); drop those keys from the returned dict"
        )


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` with fp32 trained parameters, on the CPU.

    Args:
        checkpoint_dir: the directory ``Engine.save_checkpoint`` wrote into (holding the tag
            directories and ``latest``), or one checkpoint directory.
        tag: the tag to read; default the one ``checkpoint_dir/latest`` names.
        exclude_frozen_parameters: must be False (see the module docstring).
        lazy_mode: accepted; the tensors are always read in full.

    Returns:
        ``{name: tensor}`` in the module's shapes.

    Raises:
        ValueError: not a complete checkpoint, or ``exclude_frozen_parameters=True``.

    Example:
        >>> state = get_fp32_state_dict_from_zero_checkpoint("ckpt", tag="global_step10")
        >>> state["0.weight"].dtype
        torch.float32
    """
    from shardkit.consolidate import fp32_state_dict

    _no_frozen_exclusion(exclude_frozen_parameters)
    return fp32_state_dict(_checkpoint(checkpoint_dir, tag))


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write :func:`get_fp32_state_dict_from_zero_checkpoint`'s dict to
    ``output_dir/pytorch_model.bin`` (``torch.save``), or ``output_dir/model.safetensors`` with
    ``safe_serialization=True``. The file is replaced atomically; ``max_shard_size`` is not used
    (one file).

    Returns:
        The path written.

    Example:
        >>> convert_zero_checkpoint_to_fp32_state_dict("ckpt", "export")
        PosixPath('export/pytorch_model.bin')
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    tmp = path.with_name(path.name + ".tmp")
    if safe_serialization:
        from safetensors.torch import save_file

        # safetensors stores each storage once: tied names get their own contiguous copy
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike, tag: str | None = None
) -> nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 state dict into it (``strict=False``,
    as DeepSpeed). Returns ``model``.

    Example:
        >>> model = load_state_dict_from_zero_checkpoint(build_model(), "ckpt")
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: Sequence[str] | None = None) -> None:
    """DeepSpeed's ``zero_to_fp32.py`` command line: ``CHECKPOINT_DIR OUTPUT_DIR [-t TAG]
    [--safe_serialization] [--max_shard_size S] [--exclude_frozen_parameters] [-d]``.

    Example:
        >>> main(["ckpt", "export"])        # export/pytorch_model.bin
    """
    parser = argparse.ArgumentParser(description="a shardkit checkpoint -> one fp32 state_dict file")
    parser.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (tag directories and 'latest')")
    parser.add_argument("output_dir", help="directory for pytorch_model.bin (or model.safetensors)")
    parser.add_argument("--max_shard_size", default="5GB", help="accepted; the output is one file")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1 (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="not offered: refused")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; no effect")
    args = parser.parse_args(argv)
    path = convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    print(f"wrote {path}")
