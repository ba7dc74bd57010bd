from __future__ import annotations

import torch
from torch import nn

from meshserve.layers import cpu_kernels, fused


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual): the residual add of the
        previous sub-layer fused into this norm, as the decoder layers use it. The C++ and Triton
        kernels write the sum into `residual` in place."""
        if x.dim() == 2 and fused.triton_path(x):
            if residual is None:
                return fused.kernels().add_rms_norm(x, self.weight, self.eps)
            residual = residual.contiguous()
            return fused.kernels().add_rms_norm(x, self.weight, self.eps, residual), residual
        if x.dim() == 2 and cpu_kernels.usable(x, self.weight):
            if residual is None:
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            residual = residual.contiguous()
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()  # the variance in float32 even for bf16 activations
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
