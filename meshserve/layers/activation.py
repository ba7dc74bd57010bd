"""The gated activation of SwiGLU MLPs, shared by the dense MLP and the experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels, fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension (one pass on the CPU and
    Triton kernel paths)."""
    if gate_up.dim() == 2 and fused.triton_path(gate_up):
        return fused.kernels().silu_and_mul(gate_up)
    if cpu_kernels.usable(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
