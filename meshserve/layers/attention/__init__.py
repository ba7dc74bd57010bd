"""Paged attention over the KV cache, as a registry of backends (registry.py), each with its own
metadata type and builder (base.py says what they share):

- cpu (cpu.py): on CPU; the PyTorch reference with the C++ decode kernel;
- torch (torch_ref.py): the plain PyTorch reference; CUDA without Triton, and any device;
- triton (triton_backend.py): CUDA with Triton; the only one CUDA graphs can capture.

Importing this package registers all three and imports no Triton.
"""
from meshserve.layers.attention import cpu, torch_ref, triton_backend  # noqa: F401  (importing registers them)
from meshserve.layers.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    ForwardInputs,
    KVScales,
    kv_cache_dtype,
)
from meshserve.layers.attention.layer import PagedAttention
from meshserve.layers.attention.registry import (
    backend_class,
    backend_names,
    choose_backend,
    create_backend,
    register_backend,
    select_backend,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "ForwardInputs", "KVScales", "PagedAttention",
           "backend_class", "backend_names", "choose_backend", "create_backend", "register_backend",
           "kv_cache_dtype", "select_backend"]
