"""Paged attention in plain PyTorch.

The runner packs a step's sequences into one flat token dimension, prefills (query length > 1)
first, then decodes (query length 1). `AttentionMetadata` says where each new token's K/V goes
(`slot_mapping`) and which cache blocks each sequence reads, so the model code knows nothing about
batching. Per layer, all new K/V are written before any sequence attends: a sequence that shares a
prefix block computed in the same step therefore reads it fully written.

Two implementations read the cache. On CPU (and on CUDA without Triton) the PyTorch path below,
with the C++ decode kernel for float32. On CUDA the Triton kernels (`triton_attention.py`, imported
only then): one launch for all prefills and one for all decodes, each reading K/V in place through
the block tables; the runner asks for it with `use_triton` and fills `prefill_launch`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels


@dataclass
class PrefillSeq:
    q_start: int
    q_end: int
    num_cached: int  # tokens already in the cache before this chunk (prefix hit or earlier chunks)
    block_table: torch.Tensor | None  # needed only when num_cached > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of every new token
    prefills: list[PrefillSeq]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] True = attend
    decode_context_lens: torch.Tensor | None = None  # [B] tokens each decode attends to, its own included
    use_triton: bool = False  # the Triton kernels (decode_mask and PrefillSeq.block_table unused then)
    prefill_launch: PrefillLaunch | None = None  # with use_triton, when the step has prefills
    decode_splits: int = 1  # with use_triton: key ranges per decode sequence (paged_launch.decode_splits)


@dataclass
class PrefillLaunch:
    """Every prefill of a step as one Triton launch (see triton_attention.prefill_attention)."""
    query_start: torch.Tensor  # [S + 1] first row of each prefill in q, then the end
    context_lens: torch.Tensor  # [S] cached + new tokens of each
    block_tables: torch.Tensor  # [S, max_blocks]
    tile_seq: torch.Tensor  # [programs] prefill of each program
    tile_start: torch.Tensor  # [programs] its first query offset


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]. Returns [T, H, D]."""
        kvh, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
        if meta.use_triton:
            return self._triton(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        for group in fresh_runs(meta.prefills):
            a, b = group[0].q_start, group[-1].q_end
            if group[0].num_cached == 0:
                out[a:b] = self._prefill_fresh(q[a:b], k[a:b], v[a:b], len(group))
            else:
                out[a:b] = self._prefill_cached(q[a:b], k_cache, v_cache, group[0])
        if meta.decode_block_tables is not None:
            n = meta.num_prefill_tokens
            out[n:] = self._decode(q[n:], k_cache, v_cache, meta)
        return out

    def _triton(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        from meshserve.layers import triton_attention

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n, scale = meta.num_prefill_tokens, self.head_dim ** -0.5
        if meta.prefill_launch is not None:
            p = meta.prefill_launch
            triton_attention.prefill_attention(q, k_cache, v_cache, out, p.query_start, p.context_lens,
                                               p.block_tables, p.tile_seq, p.tile_start, scale)
        if meta.decode_block_tables is not None:
            triton_attention.decode_attention(q[n:], k_cache, v_cache, out[n:], meta.decode_context_lens,
                                              meta.decode_block_tables, scale, meta.decode_splits)
        return out

    def _prefill_fresh(self, q, k, v, n: int) -> torch.Tensor:
        """n prompts of equal length with nothing cached, packed back to back: one causal SDPA
        over [n, heads, L, D] views (one call per sequence was ~30% slower on CPU)."""
        def heads_first(x):
            return x.view(n, -1, *x.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(q.shape)

    def _prefill_cached(self, q, k_cache, v_cache, p: PrefillSeq) -> torch.Tensor:
        """A chunk after num_cached tokens (earlier chunks or a prefix hit): attends to the cache."""
        ctx = p.num_cached + q.shape[0]
        kk = k_cache[p.block_table].flatten(0, 1)[:ctx]  # [ctx, KVH, D]
        vv = v_cache[p.block_table].flatten(0, 1)[:ctx]
        pos = torch.arange(p.num_cached, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kk.transpose(0, 1).unsqueeze(0),
                                           vv.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if cpu_kernels.usable(q, k_cache):  # reads K/V in place of the gather below
            return cpu_kernels.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_context_lens, self.head_dim ** -0.5)
        return self._decode_torch(q, k_cache, v_cache, meta)

    def _decode_torch(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        b = q.shape[0]
        kvh, d = self.num_kv_heads, self.head_dim
        # [B, blocks, bs, KVH, D] -> [B, KVH, L, D]; query heads grouped by their KV head, so no repeat.
        kk = k_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
        vv = v_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
        qg = q.view(b, kvh, self.group, d)
        o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=meta.decode_mask)
        return o.reshape(b, self.num_heads, d)


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
