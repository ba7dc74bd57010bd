"""Rotary position embedding (rotate-half layout), with Llama-3 style frequency scaling."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from meshserve.layers import cpu_kernels, fused


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    params = scaling or {}
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if kind == "linear":
        return inv_freq / params["factor"]
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryRows:
    """The cos/sin rows of one step's positions, gathered once per dtype and shared by every layer
    (a step's layers all rotate at the same positions)."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor):
        self.rotary, self.positions = rotary, positions
        self._rows: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, D] in `dtype`, gathered from the float32 tables and then cast."""
        rows = self._rows.get(dtype)
        if rows is None:
            rows = self._rows[dtype] = (self.rotary.cos[self.positions].to(dtype),
                                        self.rotary.sin[self.positions].to(dtype))
        return rows


Positions = torch.Tensor | RotaryRows  # what the layers pass down: raw positions or the step's rows


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # [max_positions, head_dim] float32 buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def at(self, positions: Positions) -> RotaryRows:
        """The step's rows, for the model to gather once and hand to every layer."""
        return positions if isinstance(positions, RotaryRows) else RotaryRows(self, positions)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: Positions, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, D], k: [T, kv_heads, D]; positions: [T] (or their RotaryRows)."""
        cos, sin = self.at(positions).cos_sin(q.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def apply_qkv(self, positions: Positions, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                  store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """Split a fused QKV projection [T, (H + 2KVH) D] into q [T, H, D], k and v [T, KVH, D],
        with q and k rotated (in place in qkv on the CPU and Triton kernel paths). `store` (slots,
        k_cache, v_cache): on the Triton path, the kernel that rotates also stores k and v in
        the caches; the caller checks with `stores_kv` that it does."""
        t, d = qkv.shape[0], self.cos.shape[-1]
        rows = self.at(positions)
        if fused.triton_path(qkv) and qkv.stride(-1) == 1:
            cos, sin = rows.cos_sin(qkv.dtype)
            fused.kernels().rope_and_cache(qkv, cos, sin, num_heads, num_kv_heads, *(store or ()))
            fused_in_place = True
        else:
            fused_in_place = cpu_kernels.usable(qkv) and self.cos.dtype == torch.float32 and qkv.stride(-1) == 1
            if fused_in_place:
                cpu_kernels.rotary_(qkv, rows.positions, self.cos, self.sin, num_heads + num_kv_heads, d)
        q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
        q, k, v = q.view(t, num_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d)
        return (q, k, v) if fused_in_place else (*self(rows, q, k), v)

    @staticmethod
    def stores_kv(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether apply_qkv can store K/V into these caches as it rotates (Triton path, contiguous
        caches of the activation dtype; an fp8 cache takes the attention backend's write)."""
        return fused.triton_path(qkv) and qkv.stride(-1) == 1 and k_cache.dtype == qkv.dtype \
            and k_cache.is_contiguous()
