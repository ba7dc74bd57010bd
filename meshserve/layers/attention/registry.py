"""Attention backends by name, and the choice of one for a device.

The choice depends on the device alone: on CPU the CPU backend (it falls back to PyTorch per call
where its C++ kernel cannot take the tensors, so the dtype need not be known here); on CUDA the
Triton kernels when Triton is installed, else the PyTorch reference; elsewhere the reference.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

from meshserve.layers.attention.base import AttentionBackend, AttentionSpec

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, type[AttentionBackend]] = {}

NO_TRITON = "Triton is not installed: CUDA attention gathers K/V for every step (pip install triton)"


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    known = _BACKENDS.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"two attention backends named {cls.name!r}: {known.__qualname__} and {cls.__qualname__}")
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; registered: {', '.join(backend_names())}") from None


def create_backend(name: str, spec: AttentionSpec, device: torch.device | str) -> AttentionBackend:
    return backend_class(name)(spec, torch.device(device))


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None  # without importing it: that takes seconds


def choose_backend(device: torch.device | str, triton_installed: bool | None = None) -> tuple[str, str]:
    """(backend name, why) for a device; `triton_installed` None: look for the package."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu", "CPU: PyTorch with the C++ kernels where they take the tensors"
    if device.type == "cuda":
        if _triton_installed() if triton_installed is None else triton_installed:
            return "triton", "CUDA with Triton installed"
        return "torch", NO_TRITON
    return "torch", f"no backend of its own for {device.type} devices"


def select_backend(device: torch.device | str, spec: AttentionSpec) -> AttentionBackend:
    name, reason = choose_backend(device)
    if reason == NO_TRITON:
        logger.warning(reason)
    else:
        logger.info("attention backend %s (%s)", name, reason)
    return create_backend(name, spec, device)
