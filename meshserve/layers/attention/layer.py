"""A model layer's attention call: the backend that built the step's metadata runs it, so the
model code never asks which backend the runner chose. The layer's KV-cache scales live here."""
from __future__ import annotations

import torch

from meshserve.layers.attention.base import UNIT_SCALES, AttentionMetadata, KVScales


class PagedAttention:
    def __init__(self) -> None:
        # vLLM's k_scale / v_scale for an fp8 cache (base.py): 1.0 unless the checkpoint has them.
        self.kv_scales: KVScales = UNIT_SCALES

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]. Returns [T, H, D]."""
        return meta.backend.forward(q, k, v, k_cache, v_cache, meta, self.kv_scales)

    @staticmethod
    def reads_cache_only(meta: AttentionMetadata) -> bool:
        """Whether the step's backend can attend once the step's K/V are in the caches, written by
        the kernel that applies the rotary embedding (rotary.apply_qkv's `store`)."""
        return callable(getattr(meta.backend, "attend_cached", None))

    def attend_cached(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q [T, H, D] over caches that already hold this step's K/V."""
        return meta.backend.attend_cached(q, k_cache, v_cache, meta, self.kv_scales)  # type: ignore[attr-defined]
