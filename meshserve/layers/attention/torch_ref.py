"""The PyTorch reference backend: SDPA over K/V gathered from the paged cache, any device.

Chosen for CUDA without Triton and for devices without a backend of their own; the CPU backend
(cpu.py) is this one with the C++ decode kernel. Equal-length fresh prompts share one causal SDPA
call, a prefill after cached tokens reads its blocks through its block table, and decodes read
their padded tables under a mask of each one's context length. An fp8 cache is widened (and
scaled) in the gathered copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from meshserve.layers.attention.base import (
    UNIT_SCALES,
    AttentionBackend,
    AttentionMetadata,
    ForwardInputs,
    KVScales,
    PackedStep,
    from_cache,
    padded_tables,
)
from meshserve.layers.attention.registry import register_backend
from meshserve.layers.host_to_device import to_device


@dataclass
class PrefillSeq:
    q_start: int
    q_end: int
    num_cached: int  # tokens already in the cache before this chunk (prefix hit or earlier chunks)
    block_table: torch.Tensor | None  # needed only when num_cached > 0


@dataclass(kw_only=True)
class TorchAttentionMetadata(AttentionMetadata):
    prefills: list[PrefillSeq] = field(default_factory=list)
    # [B, 1, 1, max_blocks * block_size] True = attend: made at the first layer that reads the
    # gathered blocks (the CPU backend's kernel reads the lengths instead, and never needs it)
    decode_mask: torch.Tensor | None = None


@register_backend
class TorchBackend(AttentionBackend):
    name = "torch"
    metadata_type = TorchAttentionMetadata

    def build_inputs(self, packed: PackedStep) -> ForwardInputs:
        long, device = torch.long, self.device
        prefills = [PrefillSeq(p.q_start, p.q_end, p.num_cached,
                               to_device(p.block_table, long, device) if p.num_cached > 0 else None)
                    for p in packed.prefills]
        meta = self.metadata_type(backend=self, slot_mapping=to_device(packed.slot_mapping, long, device),
                                  prefills=prefills, num_prefill_tokens=packed.num_prefill_tokens)
        if packed.decode_context_lens:
            tables, _ = padded_tables(packed.decode_block_tables)
            lens = to_device(packed.decode_context_lens, long, device)
            meta.decode_block_tables = to_device(tables, long, device)
            meta.decode_context_lens = lens
        return ForwardInputs(to_device(packed.input_ids, long, device), to_device(packed.positions, long, device),
                             meta)

    def _attend(self, q, k, v, k_cache, v_cache, meta: TorchAttentionMetadata, scales: KVScales) -> torch.Tensor:
        out = torch.empty_like(q)
        for group in fresh_runs(meta.prefills):
            a, b = group[0].q_start, group[-1].q_end
            if group[0].num_cached == 0:
                out[a:b] = self._prefill_fresh(q[a:b], k[a:b], v[a:b], len(group))
            else:
                out[a:b] = _prefill_cached(q[a:b], k_cache, v_cache, group[0], scales)
        if meta.decode_block_tables is not None:
            n = meta.num_prefill_tokens
            out[n:] = self._decode(q[n:], k_cache, v_cache, meta, scales)
        return out

    def _prefill_fresh(self, q, k, v, n: int) -> torch.Tensor:
        return _prefill_fresh(q, k, v, n)

    def _decode(self, q, k_cache, v_cache, meta: TorchAttentionMetadata, scales: KVScales) -> torch.Tensor:
        """Only for a step with decodes, whose tables and lengths build_inputs set together."""
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and lens is not None
        if meta.decode_mask is None:
            positions = torch.arange(tables.shape[1] * self.spec.block_size, device=lens.device)
            meta.decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        return gathered_decode(q, k_cache, v_cache, tables, meta.decode_mask, scales)


def fresh_runs(prefills: list[PrefillSeq]) -> list[list[PrefillSeq]]:
    """Consecutive prefills with nothing cached and the same length, grouped; every other prefill
    (one that reads cached tokens) on its own."""
    runs: list[list[PrefillSeq]] = []
    for p in prefills:
        last = runs[-1][-1] if runs else None
        if (last is not None and p.num_cached == 0 and last.num_cached == 0
                and p.q_end - p.q_start == last.q_end - last.q_start):
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _prefill_fresh(q, k, v, n: int) -> torch.Tensor:
    """n prompts of equal length with nothing cached, packed back to back: one causal SDPA
    over [n, heads, L, D] views (one call per sequence was ~30% slower on CPU)."""
    def heads_first(x):
        return x.view(n, -1, *x.shape[1:]).transpose(1, 2)

    o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(q.shape)


def _prefill_cached(q, k_cache, v_cache, p: PrefillSeq, scales: KVScales) -> torch.Tensor:
    """A chunk after num_cached tokens (earlier chunks or a prefix hit): attends to the cache."""
    ctx = p.num_cached + q.shape[0]
    kk = from_cache(k_cache[p.block_table].flatten(0, 1)[:ctx], q.dtype, scales.k)  # [ctx, KVH, D]
    vv = from_cache(v_cache[p.block_table].flatten(0, 1)[:ctx], q.dtype, scales.v)
    pos = torch.arange(p.num_cached, ctx, device=q.device)
    mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kk.transpose(0, 1).unsqueeze(0),
                                       vv.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def gathered_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    mask: torch.Tensor, scales: KVScales = UNIT_SCALES) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] over its blocks, copied out of the cache (block_tables
    [B, max_blocks]) and masked past its context (mask [B, 1, 1, max_blocks * block_size])."""
    b, heads, d = q.shape
    kvh = k_cache.shape[2]
    # [B, blocks, bs, KVH, D] -> [B, KVH, L, D]; query heads grouped by their KV head, so no repeat.
    kk = from_cache(k_cache[block_tables], q.dtype, scales.k).flatten(1, 2).transpose(1, 2)
    vv = from_cache(v_cache[block_tables], q.dtype, scales.v).flatten(1, 2).transpose(1, 2)
    qg = q.view(b, kvh, heads // kvh, d)
    o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=mask)
    return o.reshape(b, heads, d)
