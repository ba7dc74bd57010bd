"""The Triton backend for CUDA (kernels in layers/triton_attention.py): one launch for all of a
step's prefills and one for all its decodes, each reading K/V in place through the block tables
(an fp8 cache as stored, widened in the kernel).

Every integer of a step goes to the device in one copy, through persistent staging buffers, each
array 16-byte aligned (host_to_device.py); decode block tables stay on the device and a step
sends only the entries that changed. A decode batch's metadata depends only on its size, so this
backend's decodes can be captured in CUDA graphs (worker/cuda_graphs.py).
Triton itself is imported when a backend object is made, never by importing this module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    ForwardInputs,
    KVScales,
    PackedStep,
    padded_tables,
)
from meshserve.layers.attention.registry import register_backend
from meshserve.layers.host_to_device import BlockTableRows, HostStaging
from meshserve.layers.paged_launch import decode_splits, prefill_tile, query_tiles


@dataclass
class PrefillLaunch:
    """Every prefill of a step as one Triton launch (see triton_attention.prefill_attention)."""
    query_start: torch.Tensor  # [S + 1] first row of each prefill in q, then the end
    context_lens: torch.Tensor  # [S] cached + new tokens of each
    block_tables: torch.Tensor  # [S, max_blocks]
    tile_seq: torch.Tensor  # [programs] prefill of each program
    tile_start: torch.Tensor  # [programs] its first query offset


@dataclass(kw_only=True)
class TritonAttentionMetadata(AttentionMetadata):
    prefill_launch: PrefillLaunch | None = None  # when the step has prefills
    decode_splits: int = 1  # key ranges per decode sequence (paged_launch.decode_splits)


@register_backend
class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    metadata_type = TritonAttentionMetadata
    # Decode block tables stay on the device between steps, only their changes sent (False: the
    # whole padded tables every step, the baseline of benchmarks/host_step.py).
    incremental_tables = True

    def __init__(self, spec, device):
        super().__init__(spec, device)
        from meshserve.layers import triton_attention

        self._kernels = triton_attention
        self.staging = HostStaging(self.device)
        self.decode_tables = BlockTableRows(self.device)

    def build_inputs(self, packed: PackedStep) -> ForwardInputs:
        arrays = [packed.input_ids, packed.positions, packed.slot_mapping]
        if packed.prefills:
            q_lens = [p.q_end - p.q_start for p in packed.prefills]
            tile_seq, tile_start = query_tiles(q_lens, prefill_tile(self.spec.group).block_q)
            tables, width = padded_tables([p.block_table for p in packed.prefills])
            arrays += [[p.q_start for p in packed.prefills] + [packed.prefills[-1].q_end],
                       [p.num_cached + n for p, n in zip(packed.prefills, q_lens)],
                       [b for t in tables for b in t], tile_seq, tile_start]
        if packed.decode_context_lens:
            if self.incremental_tables:
                arrays += [packed.decode_context_lens, *self.decode_tables.delta(packed.decode_block_tables)]
            else:
                dec_tables, dec_width = padded_tables(packed.decode_block_tables)
                arrays += [packed.decode_context_lens, [b for t in dec_tables for b in t]]
        tensors = self.staging.to_device(arrays)
        ids, positions, slots = tensors[:3]
        meta = TritonAttentionMetadata(backend=self, slot_mapping=slots, num_prefill_tokens=packed.num_prefill_tokens)
        rest = tensors[3:]
        if packed.prefills:
            starts, lens, flat_tables, tile_seq_t, tile_start_t = rest[:5]
            rest = rest[5:]
            meta.prefill_launch = PrefillLaunch(starts, lens, flat_tables.view(len(packed.prefills), width),
                                                tile_seq_t, tile_start_t)
        if packed.decode_context_lens:
            lens = rest[0]
            meta.decode_context_lens = lens
            if self.incremental_tables:
                self.decode_tables.apply(*rest[1:])
                meta.decode_block_tables = self.decode_tables.rows(len(lens))
            else:
                meta.decode_block_tables = rest[1].view(len(lens), dec_width)
            meta.decode_splits = decode_splits(len(lens), self.spec.num_kv_heads, max(packed.decode_context_lens))
        return ForwardInputs(ids, positions, meta)

    def attend_cached(self, q, k_cache, v_cache, meta: TritonAttentionMetadata, scales: KVScales) -> torch.Tensor:
        """Attention once the step's K/V are in the caches (stored by the rotary kernel,
        layers/triton_fused.rope_and_cache): the kernels read nothing else."""
        return self._attend(q, None, None, k_cache, v_cache, meta, scales)

    def _attend(self, q, k, v, k_cache, v_cache, meta: TritonAttentionMetadata, scales: KVScales) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n, scale = meta.num_prefill_tokens, q.shape[-1] ** -0.5
        if meta.prefill_launch is not None:
            p = meta.prefill_launch
            self._kernels.prefill_attention(q, k_cache, v_cache, out, p.query_start, p.context_lens,
                                            p.block_tables, p.tile_seq, p.tile_start, scale, *scales)
        if meta.decode_block_tables is not None:
            assert meta.decode_context_lens is not None  # set with the tables
            self._kernels.decode_attention(q[n:], k_cache, v_cache, out[n:], meta.decode_context_lens,
                                           meta.decode_block_tables, scale, meta.decode_splits, *scales)
        return out

    def decode_graph_metadata(self, slot_mapping, block_tables, context_lens) -> TritonAttentionMetadata:
        # No max_context: one graph serves every context length, so the splits follow the batch alone.
        return TritonAttentionMetadata(backend=self, slot_mapping=slot_mapping, num_prefill_tokens=0,
                                       decode_block_tables=block_tables, decode_context_lens=context_lens,
                                       decode_splits=decode_splits(block_tables.shape[0], self.spec.num_kv_heads))
