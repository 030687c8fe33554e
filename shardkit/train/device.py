"""Which device a rank of ``shardkit train`` trains on, checked before any worker starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["check_device", "resolve_device"]


def check_device(choice: str, *, ranks_per_node: int = 1, local_rank: int = 0) -> str:
    """``"cpu"`` or ``"cuda"``: what :func:`resolve_device` would pick, or its error.

    Imports torch only to look for CUDA (not for ``"cpu"``), so the ``shardkit train --nproc N
    --device cpu`` launcher checks its flags and starts its workers without loading torch.

    Raises:
        ValueError: as :func:`resolve_device`.

    Example:
        >>> check_device("cpu", ranks_per_node=4)
        'cpu'
    """
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {choice!r}")
    if choice == "cpu":
        return "cpu"
    import torch

    if choice == "auto" and not torch.cuda.is_available():
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available here; pass --device cpu")
    count = torch.cuda.device_count()
    if max(ranks_per_node, local_rank + 1) > count:
        raise ValueError(
            f"{max(ranks_per_node, local_rank + 1)} ranks on this machine but only {count} CUDA device(s): "
            f"more ranks than GPUs. Pass --nproc {count} or fewer, or --device cpu (gloo backend)."
        )
    return "cuda"


def resolve_device(choice: str, *, ranks_per_node: int = 1, local_rank: int = 0) -> torch.device:
    """The device of local rank ``local_rank`` among ``ranks_per_node`` ranks on this machine.

    ``"auto"`` is CUDA when available. On CUDA, local rank r uses ``cuda:r`` (torchrun's
    contract), so every rank of the node needs its own GPU: more ranks than GPUs is an error
    that names both numbers, raised before any process is started or device is set.

    Args:
        choice: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        ranks_per_node: processes on this machine (``--nproc``).
        local_rank: this process's rank on the machine.

    Raises:
        ValueError: CUDA requested but absent, or more ranks than CUDA devices.

    Example:
        >>> resolve_device("cpu", ranks_per_node=4)
        device(type='cpu')
    """
    import torch

    kind = check_device(choice, ranks_per_node=ranks_per_node, local_rank=local_rank)
    return torch.device("cpu") if kind == "cpu" else torch.device("cuda", local_rank)
