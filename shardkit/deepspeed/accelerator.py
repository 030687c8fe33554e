"""``deepspeed.accelerator.get_accelerator()`` for the two devices shardkit runs on: CUDA when
torch sees one, else the CPU (gloo).

Example:
    >>> from shardkit.deepspeed.accelerator import get_accelerator
    >>> get_accelerator().device_name()        # on a CPU machine
    'cpu'
"""

from __future__ import annotations

import torch

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """The device queries DeepSpeed scripts make, answered by torch.

    Args:
        cuda: whether this is the CUDA accelerator (else the CPU).
    """

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cuda:i"``, or ``"cpu"``."""
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device(self) -> int:
        """The current CUDA device index (0 on the CPU)."""
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        """``"cuda:i"`` of the current device, or ``"cpu"``."""
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        """The ``torch.device``."""
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` current (CUDA; nothing on the CPU)."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        """Whether the device can be used."""
        return torch.cuda.is_available() if self._cuda else True

    def device_count(self) -> int:
        """CUDA devices on this machine (1 for the CPU)."""
        return torch.cuda.device_count() if self._cuda else 1

    def communication_backend_name(self) -> str:
        """``"nccl"`` on CUDA, ``"gloo"`` on the CPU."""
        return "nccl" if self._cuda else "gloo"

    def manual_seed(self, seed: int) -> None:
        """Seed the device's generator."""
        torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the device's queued work (nothing on the CPU)."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_bf16_supported(self) -> bool:
        """Whether bf16 runs here."""
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        """Whether fp16 runs here."""
        return True

    def empty_cache(self) -> None:
        """Release the caching allocator's unused blocks (nothing on the CPU)."""
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by tensors on the device now (0 on the CPU: torch does not count them)."""
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """The peak of :meth:`memory_allocated` (0 on the CPU)."""
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart the peak that :meth:`max_memory_allocated` reports (nothing on the CPU)."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)


def get_accelerator() -> Accelerator:
    """The accelerator of this process: CUDA when torch sees a GPU, else the CPU.

    Example:
        >>> x = torch.zeros(4, device=get_accelerator().device_name())
    """
    return Accelerator(cuda=torch.cuda.is_available())
