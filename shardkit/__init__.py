"""shardkit: Triton-kernel-centric parallelism for PyTorch.

The library lives in three sub-packages, imported explicitly (nothing is imported here, so
``import shardkit`` does no work):

* :mod:`shardkit.kernels`  — Triton kernels, launchers and fused optimizers.
* :mod:`shardkit.comm`     — the parallel context and collectives over ``torch.distributed``.
* :mod:`shardkit.parallel` — data / sharded / tensor / pipeline parallelism built on the two above.

``shardkit.initialize`` (DeepSpeed's ``deepspeed.initialize``, see docs/engine.md) is looked up
on first use, so ``import shardkit`` still imports neither torch nor the kernels.

Example:
    >>> import shardkit
    >>> engine, optimizer, _, scheduler = shardkit.initialize(model=model, config="ds_config.json")
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "initialize"]


def __getattr__(name: str) -> Any:
    # PEP 562: the engine (and torch) load only when shardkit.initialize is first touched
    if name == "initialize":
        from shardkit.engine.entry import initialize

        return initialize
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
