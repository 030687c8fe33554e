"""``import shardkit.deepspeed as deepspeed``: the module-level names DeepSpeed scripts call.

Thin adapters over shardkit and ``torch.distributed`` (no second implementation of anything):

=============================  ==============================================================
DeepSpeed                      here
=============================  ==============================================================
``deepspeed.initialize``       :func:`shardkit.initialize` (docs/engine.md)
``deepspeed.add_config_arguments``  the same ``--deepspeed`` / ``--deepspeed_config`` flags
``deepspeed.init_distributed``  ``torch.distributed.init_process_group`` from torchrun's
                               environment (a one-process world without it)
``deepspeed.comm``             :mod:`shardkit.deepspeed.comm`: ``get_rank``, ``get_world_size``,
                               ``get_local_rank``, ``barrier``, ``all_reduce``, ``all_gather``,
                               ``broadcast``
``deepspeed.accelerator``      :mod:`shardkit.deepspeed.accelerator`: ``get_accelerator()``
``deepspeed.ops.adam``         :mod:`shardkit.deepspeed.ops.adam`: ``FusedAdam``,
                               ``DeepSpeedCPUAdam`` (DeepSpeed's signatures and defaults)
``deepspeed.utils``            :mod:`shardkit.deepspeed.utils`: ``RepeatingLoader``, ``logger``,
                               ``zero_to_fp32`` (a checkpoint → one fp32 state dict)
``deepspeed.zero``             :mod:`shardkit.deepspeed.zero`: ``Init``, ``GatheredParameters``
``deepspeed.checkpointing``    :mod:`shardkit.deepspeed.checkpointing`: ``checkpoint``,
                               ``configure``, ``is_configured``, ``reset``
``deepspeed.pipe``             :mod:`shardkit.deepspeed.pipe`: ``PipelineModule``, ``LayerSpec``,
                               ``TiedLayerSpec`` (``initialize`` runs them on shardkit's
                               pipeline; ``deepspeed.PipelineModule`` too)
=============================  ==============================================================

A script's other ``deepspeed`` import lines change the same way (``from deepspeed.pipe import
...`` → ``from shardkit.deepspeed.pipe import ...``). docs/engine.md tables what is supported, what
is adapted (and how) and what is not offered (and what to use instead).

Example:
    >>> import shardkit.deepspeed as deepspeed          # was: import deepspeed
    >>> parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    >>> args = parser.parse_args(["--deepspeed_config", "ds_config.json"])
    >>> deepspeed.init_distributed()
    >>> engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any

from . import accelerator, comm

#: submodules that import torch or shardkit's kernels: loaded when first named (PEP 562)
_LAZY_SUBMODULES = ("checkpointing", "ops", "pipe", "utils", "zero")


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    if name == "PipelineModule":  # DeepSpeed exports it at the top level too
        from .pipe import PipelineModule

        return PipelineModule
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r}: not offered under shardkit; docs/engine.md "
        '("DeepSpeed\'s module-level API") lists what is supported, adapted or not offered, and why'
    )


__all__ = [
    "PipelineModule",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "ops",
    "pipe",
    "utils",
    "zero",
]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line group to ``parser``: ``--deepspeed`` (a flag for the user's
    code), ``--deepspeed_config PATH`` (read by :func:`initialize` through ``args``) and the
    deprecated ``--deepscale`` / ``--deepscale_config``. Returns ``parser``.

    Example:
        >>> args = add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed"])
        >>> args.deepspeed, args.deepspeed_config
        (True, None)
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (a flag for user code)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated spelling of --deepspeed_config")
    return parser


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta = timedelta(minutes=10),
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start ``torch.distributed`` as DeepSpeed's ``init_distributed`` does; nothing when it
    already runs.

    Under torchrun (``RANK``/``WORLD_SIZE`` set) the default process group is made from the
    environment, with ``dist_backend`` or NCCL on CUDA / gloo on CPU. Without torchrun and without
    ``rank``/``world_size`` it is a one-process world (DeepSpeed would try MPI discovery; shardkit
    does not: ``auto_mpi_discovery``, ``verbose`` and ``config`` are accepted and unused).

    Raises:
        ValueError: ``dist_init_required=False`` while no process group exists (nothing to use).

    Example:
        >>> init_distributed()                 # under torchrun --nproc-per-node 2
        >>> comm.get_world_size()
        2
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ValueError("dist_init_required=False but torch.distributed is not initialized: nothing to use")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" in os.environ or rank >= 0:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout, rank=rank, world_size=world_size)
    else:  # plain python: a world of one, on an in-memory store (no port)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def initialize(*args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``deepspeed.initialize``: :func:`shardkit.initialize` with the same arguments."""
    from shardkit.engine.entry import initialize as shardkit_initialize

    return shardkit_initialize(*args, **kwargs)
