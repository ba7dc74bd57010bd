"""A step's sequences packed into one flat token batch, then into the tensors each attention path takes.

`pack_step` orders the sequences as the kernels want them (prefills first, then decodes) and
works out on the host, as plain lists, everything the device needs: token ids, positions, the
cache slot of every new token, what each sequence reads, and the rows that sample.
`torch_inputs` turns that into the PyTorch path's metadata (CPU, and CUDA without Triton);
`triton_inputs` into the Triton kernels' metadata, all of it in one host-to-device copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshserve.worker.step import StepInput
from meshserve.layers.attention import AttentionMetadata, PrefillLaunch, PrefillSeq
from meshserve.layers.host_to_device import arrays_to_device, to_device
from meshserve.layers.paged_launch import decode_splits, prefill_tile, query_tiles


@dataclass
class PrefillSpan:
    q_start: int
    q_end: int
    num_cached: int  # tokens in the cache before this chunk
    block_table: list[int]  # the blocks the chunk reads (cached and new tokens)


@dataclass
class PackedStep:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_context_lens: list[int] = field(default_factory=list)  # the new token included
    decode_block_tables: list[list[int]] = field(default_factory=list)  # the blocks each decode reads
    sample_rows: list[int] = field(default_factory=list)  # last row of each sampling sequence, step order

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - len(self.decode_context_lens)

    @property
    def is_decode_only(self) -> bool:
        return not self.prefills and bool(self.decode_context_lens)


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def pack_step(step: StepInput, block_size: int) -> PackedStep:
    out = PackedStep()
    decodes = [s for s in step.seqs if len(s.token_ids) == 1]
    ordered = [s for s in step.seqs if len(s.token_ids) > 1] + decodes
    last_row = {}
    for s in ordered:
        q_start = out.num_tokens
        out.input_ids.extend(s.token_ids)
        pos = range(s.start, s.start + len(s.token_ids))
        out.positions.extend(pos)
        bt = s.block_table
        out.slot_mapping.extend(bt[p // block_size] * block_size + p % block_size for p in pos)
        context = s.start + len(s.token_ids)
        table = bt[:_blocks(context, block_size)]
        if len(s.token_ids) > 1:
            out.prefills.append(PrefillSpan(q_start, out.num_tokens, s.start, table))
        else:
            out.decode_context_lens.append(context)
            out.decode_block_tables.append(table)
        last_row[s.seq_id] = out.num_tokens - 1
    out.sample_rows = [last_row[s.seq_id] for s in step.seqs if s.sample]
    return out


def _padded(tables: list[list[int]], fill: int = 0) -> tuple[list[list[int]], int]:
    width = max(len(t) for t in tables)
    return [t + [fill] * (width - len(t)) for t in tables], width


def torch_inputs(packed: PackedStep, block_size: int, device: torch.device):
    """(input ids, positions, metadata) for the PyTorch attention path."""
    long = torch.long
    prefills = [PrefillSeq(p.q_start, p.q_end, p.num_cached,
                           to_device(p.block_table, long, device) if p.num_cached > 0 else None)
                for p in packed.prefills]
    meta = AttentionMetadata(to_device(packed.slot_mapping, long, device), prefills, packed.num_prefill_tokens)
    if packed.decode_context_lens:
        tables, width = _padded(packed.decode_block_tables)
        lens = to_device(packed.decode_context_lens, long, device)
        meta.decode_block_tables = to_device(tables, long, device)
        meta.decode_mask = (torch.arange(width * block_size, device=device)[None, :] < lens[:, None])[:, None, None, :]
        meta.decode_context_lens = lens
    return to_device(packed.input_ids, long, device), to_device(packed.positions, long, device), meta


def triton_inputs(packed: PackedStep, group: int, kv_heads: int, device: torch.device):
    """(input ids, positions, metadata) for the Triton kernels; every integer of the step goes to
    the device in one copy."""
    arrays = [packed.input_ids, packed.positions, packed.slot_mapping]
    if packed.prefills:
        q_lens = [p.q_end - p.q_start for p in packed.prefills]
        tile_seq, tile_start = query_tiles(q_lens, prefill_tile(group).block_q)
        tables, width = _padded([p.block_table for p in packed.prefills])
        arrays += [[p.q_start for p in packed.prefills] + [packed.prefills[-1].q_end],
                   [p.num_cached + n for p, n in zip(packed.prefills, q_lens)],
                   [b for t in tables for b in t], tile_seq, tile_start]
    if packed.decode_context_lens:
        dec_tables, dec_width = _padded(packed.decode_block_tables)
        arrays += [packed.decode_context_lens, [b for t in dec_tables for b in t]]
    tensors = arrays_to_device(arrays, torch.long, device)
    ids, positions, slots = tensors[:3]
    meta = AttentionMetadata(slots, [], packed.num_prefill_tokens, use_triton=True)
    rest = tensors[3:]
    if packed.prefills:
        starts, lens, flat_tables, tile_seq_t, tile_start_t = rest[:5]
        rest = rest[5:]
        meta.prefill_launch = PrefillLaunch(starts, lens, flat_tables.view(len(packed.prefills), width),
                                            tile_seq_t, tile_start_t)
    if packed.decode_context_lens:
        lens, flat_tables = rest
        meta.decode_context_lens = lens
        meta.decode_block_tables = flat_tables.view(len(lens), dec_width)
        meta.decode_splits = decode_splits(len(lens), kv_heads, max(packed.decode_context_lens))
    return ids, positions, meta
