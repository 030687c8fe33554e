"""``shardkit consolidate DIR OUT``: a sharded checkpoint → plain ``torch.save`` files.

Runs in ONE process without ``torch.distributed``: DCP reads every key in full
(``dcp.load(..., no_dist=True)``) whatever dp size or stage wrote it, and the result is written
as plain tensors and dicts that load where shardkit is not installed:

* ``OUT/model.pt``: the unwrapped module's ``state_dict`` (tied params under every name).
* ``OUT/optimizer.pt``: a ``torch.optim`` state_dict ``{"state": {i: {...}}, "param_groups":
  [...]}``, ``i`` the parameter's index in ``model.named_parameters()``; each group lists its
  members in that order, with the saved hyperparameters and torch's default implementation
  flags. It loads into ``torch.optim.AdamW(model.parameters())`` for a one-group run, or into
  one built with the same groups (members in model order) otherwise. fp32 masters of
  bf16/fp16 params are written as ``state[i]["master_param"]`` (shardkit's fused optimizers
  read it, torch's ignore it).

Example:
    $ shardkit consolidate ckpt/latest export/
    >>> model.load_state_dict(torch.load("export/model.pt"))
    >>> opt = torch.optim.AdamW(model.parameters()); opt.load_state_dict(torch.load("export/optimizer.pt"))
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["consolidate", "fp32_state_dict", "read_checkpoint", "resolve_tag"]

log = logging.getLogger("shardkit.consolidate")

#: torch.optim's own defaults for the group entries that pick an implementation: the exported
#: state must not switch a torch target to a fused/foreach path it was not built with
_TORCH_FLAGS = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}


def consolidate(src: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``out/model.pt`` and ``out/optimizer.pt`` from the checkpoint at ``src``.

    Args:
        src: a directory written by :func:`shardkit.parallel.save_checkpoint`; or, for
            ``shardkit.initialize``'s DeepSpeed layout (``DIR/<tag>/`` plus a ``DIR/latest`` file
            naming the newest tag), ``DIR`` or ``DIR/latest`` (the tag it names is read).
        out: output directory (created); the two files are replaced.

    Returns:
        The paths of ``model.pt`` and ``optimizer.pt``.

    Raises:
        ValueError: ``src`` is not a complete checkpoint (missing/truncated/corrupt file, named).

    Example:
        >>> consolidate("ckpt/latest", "export")
        (PosixPath('export/model.pt'), PosixPath('export/optimizer.pt'))
    """
    t0 = time.perf_counter()
    src, out = resolve_tag(Path(src)), Path(out)
    meta, full = read_checkpoint(src)
    t1 = time.perf_counter()
    model = _model_state(meta, full)
    optimizer = _optimizer_state(meta, full, {k: shape for k, (shape, _) in meta["shapes"].items()})
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "model.pt", out / "optimizer.pt"
    for path, obj in zip(paths, (model, optimizer)):
        tmp = path.with_suffix(".pt.tmp")
        torch.save(obj, tmp)
        os.replace(tmp, path)  # a reader never sees half a file
    nbytes = sum(p.stat().st_size for p in paths)
    log.info("consolidate %s: read %.2fs, wrote %.1f MiB in %.2fs", src, t1 - t0, nbytes / 2**20, time.perf_counter() - t1)
    return paths


def fp32_state_dict(src: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` from the checkpoint at ``src`` with every trained parameter at
    fp32: a bf16/fp16 run's parameters are replaced by their fp32 masters (exact, not widened
    16-bit values); fp32 runs, frozen parameters and buffers are as saved. One process, no
    ``torch.distributed``; ``src`` as for :func:`consolidate`.

    Returns:
        ``{name: tensor}``, CPU tensors in the module's shapes (tied parameters under every name).

    Raises:
        ValueError: ``src`` is not a complete checkpoint.

    Example:
        >>> model.load_state_dict(fp32_state_dict("ckpt"))     # ckpt/latest names the tag
    """
    meta, full = read_checkpoint(resolve_tag(Path(src)))
    model = _model_state(meta, full)
    for name in meta["masters"]:
        master = full[f"master.{name}"].view(meta["shapes"][name][0])
        model[name] = master
        for alias, canonical in meta["aliases"].items():
            if canonical == name:
                model[alias] = master
    return model


def read_checkpoint(src: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(meta, tensors)`` of the checkpoint directory ``src``: its ``meta.pt`` and every stored
    tensor in full under its DCP key (``model.<name>``, ``master.<name>``,
    ``optim.<name>.<state>``), read in one process after the files are verified.

    Raises:
        ValueError: a missing/truncated/corrupt file (named).

    Example:
        >>> meta, tensors = read_checkpoint(Path("ckpt/step-100"))
        >>> tensors["model.0.weight"].shape
        torch.Size([16, 8])
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from shardkit.parallel.checkpoint import load_meta, read_manifest, verify_files

    errors = verify_files(src, read_manifest(src))
    if errors:
        raise ValueError(f"checkpoint {src}: " + "; ".join(errors))
    meta = load_meta(src)
    md = FileSystemReader(src).read_metadata().state_dict_metadata
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items() if hasattr(m, "size")}
    with warnings.catch_warnings():  # one process without torch.distributed is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(full, checkpoint_id=src, no_dist=True)
    _to_module_layout(meta, full)
    return meta, full


def _to_module_layout(meta: dict[str, Any], full: dict[str, torch.Tensor]) -> None:
    """Give the weights a TP plan held transposed (HF ``Conv1D``) back in the module's own
    ``[in, out]`` layout, with their fp32 masters and optimizer state: [Note: Conv1D weights in
    checkpoints] (``shardkit.parallel.checkpoint.content``). Rewrites ``full`` and
    ``meta["shapes"]``."""
    elementwise = meta.get("optim", {}).get("elementwise", {})
    for key in meta.get("transposed", ()):
        (rows, cols), dtype = meta["shapes"][key]
        for name in (f"model.{key}", f"master.{key}", *(f"optim.{key}.{s}" for s in elementwise.get(key, []))):
            if name in full:
                full[name] = full[name].view(rows, cols).t().contiguous().view(-1)
        meta["shapes"][key] = ((cols, rows), dtype)


def _model_state(meta: dict[str, Any], full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model = {k: full[f"model.{k}"].view(shape) for k, (shape, _) in meta["shapes"].items()}
    for alias, canonical in meta["aliases"].items():
        model[alias] = model[canonical]
    return model


def resolve_tag(src: Path) -> Path:
    """The checkpoint directory ``src`` means: ``src`` itself, or with DeepSpeed's layout (a
    ``latest`` file holding the newest tag, as ``Engine.save_checkpoint`` writes) the tag it names,
    whether ``src`` is that file or the directory holding it.

    Raises:
        ValueError: ``src`` does not exist, or its ``latest`` names no directory beside it.

    Example:
        >>> resolve_tag(Path("ckpt/latest"))     # a tag file holding "global_step100"
        PosixPath('ckpt/global_step100')
    """
    from shardkit.parallel.checkpoint.api import MANIFEST

    if not src.exists():
        raise ValueError(f"checkpoint {src}: no such file or directory")
    latest = src if src.is_file() and src.name == "latest" else src / "latest"
    if not latest.is_file() or (src.is_dir() and (src / MANIFEST).exists()):
        return src
    tag = latest.read_text().strip()
    target = latest.parent / tag
    if not tag or not target.is_dir():
        raise ValueError(f"checkpoint {latest}: names tag {tag!r}, but {target} is not a directory")
    return target


def _optimizer_state(meta: dict[str, Any], full: dict[str, torch.Tensor], shapes: dict[str, Any]) -> dict[str, Any]:
    index = {n: i for i, n in enumerate(meta["param_order"])}
    opt = meta["optim"]
    state: dict[int, dict[str, Any]] = {}
    for name in meta["param_order"]:
        keys = opt["elementwise"].get(name, [])
        if name not in opt["scalars"] and not keys:
            continue
        s: dict[str, Any] = {}
        for k, v in opt["scalars"].get(name, {}).items():
            # torch.optim keeps ``step`` as a 0-d fp32 tensor
            s[k] = v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float32)
        for k in keys:
            s[k] = full[f"optim.{name}.{k}"].view(shapes[name])
        if name in meta["masters"]:
            s["master_param"] = full[f"master.{name}"].view(shapes[name])
        state[index[name]] = s
    groups = []
    for g in opt["groups"]:
        hyper = {k: (_TORCH_FLAGS[k] if k in _TORCH_FLAGS else v) for k, v in g["hyper"].items()}
        groups.append({**hyper, "params": [index[n] for n in g["params"]]})
    return {"state": state, "param_groups": groups}
