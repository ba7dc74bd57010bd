"""A step's sequences packed into one flat token batch, which every attention backend takes.

`pack_step` orders the sequences as the kernels want them (prefills first, then decodes) and
works out on the host, as plain lists, everything the device needs: token ids, positions, the
cache slot of every new token, what each sequence reads, and the rows that sample. Each backend
turns that into its own tensors (AttentionBackend.build_inputs, layers/attention/).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.worker.step import StepInput


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
