"""shardkit: Triton-kernel-centric parallelism for PyTorch.

The library lives in three sub-packages, imported explicitly (nothing is imported here, so
``import shardkit`` does no work):

* :mod:`shardkit.kernels`  — Triton kernels, launchers and fused optimizers.
* :mod:`shardkit.comm`     — the parallel context and collectives over ``torch.distributed``.
* :mod:`shardkit.parallel` — data / sharded / tensor / pipeline parallelism built on the two above.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
