"""A model layer's attention call: the backend that built the step's metadata runs it, so the
model code never asks which backend the runner chose."""
from __future__ import annotations

import torch

from meshserve.layers.attention.base import AttentionMetadata


class PagedAttention:
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]. Returns [T, H, D]."""
        return meta.backend.forward(q, k, v, k_cache, v_cache, meta)
