"""The gated activation of SwiGLU MLPs, shared by the dense MLP and the experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension (one pass on the CPU kernel path)."""
    if cpu_kernels.usable(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
