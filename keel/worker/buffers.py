"""CpuGpuBuffer: one buffer, three faces (the naming scheme of STYLE.md).

`.cpu` is a (pinned, on CUDA) CPU tensor, `.np` the NumPy view of the same memory, `.gpu` the
tensor on the compute device. Sized once at start-up; each pass overwrites a prefix and, on
CUDA, `copy_to_gpu(n)` ships that prefix. On the CPU `.gpu` *is* `.cpu`, so the copy is free.
"""

from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(*size, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = torch.zeros_like(self.cpu, device=device) if on_cuda else self.cpu
        self._separate = on_cuda

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        if n is None:
            if self._separate:
                self.gpu.copy_(self.cpu, non_blocking=True)
            return self.gpu
        if self._separate:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]
