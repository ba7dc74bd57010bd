"""Which implementation of the fused element-wise operations a tensor gets.

On CUDA with Triton installed the layers call the Triton kernels of layers/triton_fused.py (and
the grouped expert matmuls of layers/triton_moe.py): a handful of launches per decoder layer
instead of dozens, and no host reads, so that a decode step can be captured in a CUDA graph. On a
CPU the C++ kernels and the PyTorch formulas stay as they are, so CPU results do not move.

Triton is imported on the first call that needs it, never by importing this module: a CPU-only
install without Triton imports the layers as before. `force_triton` makes CPU tensors take the
CUDA path, for the tests, which run the kernels in Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import ModuleType

import torch

_forced = False


@cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@contextmanager
def force_triton() -> Iterator[None]:
    """Run CPU tensors through the CUDA path's Triton kernels (in the interpreter) while inside."""
    global _forced
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before


def triton_path(x: torch.Tensor) -> bool:
    """Whether `x` takes the Triton kernels: a CUDA tensor with Triton installed, or any while forced."""
    return (x.device.type == "cuda" or _forced) and _triton_installed()


def kernels() -> ModuleType:
    """layers/triton_fused.py, imported on first use (Triton's import takes seconds)."""
    from meshserve.layers import triton_fused

    return triton_fused


def moe_kernels() -> ModuleType:
    from meshserve.layers import triton_moe

    return triton_moe
