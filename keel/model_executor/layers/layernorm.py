from __future__ import annotations

import torch
from torch import nn

from keel.cpu_ops import cpu_ops_for


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as transformers does), with an optional fused residual add:
    `norm(x, residual)` returns `(normed(x + residual), x + residual)`.

    On the CPU, keel's compiled kernels do each in one pass; the fused add then works in place,
    as vLLM's `fused_add_rms_norm` does: `residual` becomes `x + residual` and `x` its
    normalised value, and those two tensors are returned. Callers hand over both tensors."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = cpu_ops_for(x)
        if ops is not None and x.dtype == self.weight.dtype:
            if residual is None:
                return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(
                    x.shape
                )
            if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
                ops.fused_add_rms_norm_(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
