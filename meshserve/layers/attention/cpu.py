"""The CPU backend: the PyTorch reference, with decodes read in place by the C++ kernel
(cpu_kernels.paged_decode) where it takes the tensors (float32 or bfloat16, kernels built; the
cache in that dtype or fp8, widened in the kernel), and fresh prompts through
cpu_kernels.prefill_causal where it runs (float32 on AVX2 CPUs but Intel ones with AVX-512, bfloat16 on AMX).

Its metadata has a type of its own because the C++ decoder stack (models/cpu_decoder_stack.py)
runs whole layers, attention included, only for steps this backend built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers import cpu_kernels
from meshserve.layers.attention.base import KVScales
from meshserve.layers.attention.registry import register_backend
from meshserve.layers.attention.torch_ref import TorchAttentionMetadata, TorchBackend


@dataclass(kw_only=True)
class CPUAttentionMetadata(TorchAttentionMetadata):
    pass


@register_backend
class CPUBackend(TorchBackend):
    name = "cpu"
    metadata_type = CPUAttentionMetadata

    def _prefill_fresh(self, q, k, v, n: int) -> torch.Tensor:
        if cpu_kernels.prefill_usable(q, n):  # as the C++ decoder stack chooses (csrc/decoder_stack.cpp)
            return cpu_kernels.prefill_causal(q, k, v, n)
        return super()._prefill_fresh(q, k, v, n)

    def _decode(self, q, k_cache, v_cache, meta: TorchAttentionMetadata, scales: KVScales) -> torch.Tensor:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and lens is not None  # a step with decodes has both
        if cpu_kernels.decode_usable(q, k_cache):  # reads K/V in place of the reference's gather
            return cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, q.shape[-1] ** -0.5, *scales)
        return super()._decode(q, k_cache, v_cache, meta, scales)
