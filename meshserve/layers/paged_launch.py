"""Launch geometry of the Triton paged-attention kernels, as plain arithmetic (no Triton import).

One kernel program handles the query heads that share one KV head, for a tile of a sequence's
query tokens: its rows are (token, head-in-group) pairs, so every K/V row it loads serves the whole
group. The Triton backend builds the tile list on the host with a step's metadata, which needs no
Triton, hence this module.
"""
from __future__ import annotations

from dataclasses import dataclass

# tl.dot needs every dimension of its operands to be at least 16 on NVIDIA GPUs.
MIN_DOT = 16
PREFILL_ROWS = 64  # query rows (tokens x heads of one group) per prefill program
KEYS_PER_ITERATION = 64  # keys each program loads per loop iteration
# Split-K for decode: enough programs to fill the device twice over (132 SMs on an H100/H200),
# but never splits shorter than this many keys, where the combine step would cost more than it wins.
DECODE_TARGET_PROGRAMS = 264
MAX_DECODE_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class TileShape:
    """Rows of one program: block_q query tokens x heads_padded heads (the group, padded)."""
    block_q: int
    heads_padded: int
    block_n: int = KEYS_PER_ITERATION

    @property
    def rows(self) -> int:
        return self.block_q * self.heads_padded


def prefill_tile(group: int) -> TileShape:
    """Several query tokens per program, all heads of one KV group in each."""
    heads = next_power_of_2(group)
    return TileShape(block_q=max(1, PREFILL_ROWS // heads), heads_padded=heads)


def decode_tile(group: int) -> TileShape:
    """One query token per program; the group padded up to the smallest tile tl.dot accepts."""
    return TileShape(block_q=1, heads_padded=max(MIN_DOT, next_power_of_2(group)))


def query_tiles(query_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """(sequence index, first query offset) of every prefill program, sequences in order."""
    tile_seq, tile_start = [], []
    for s, n in enumerate(query_lens):
        for start in range(0, n, block_q):
            tile_seq.append(s)
            tile_start.append(start)
    return tile_seq, tile_start


def decode_splits(batch: int, kv_heads: int, max_context: int | None = None) -> int:
    """How many key ranges each decode program's work is split into (a power of two). Small batches
    split long contexts so that the device is busy; `max_context` (unknown to a CUDA graph, which
    serves every context length) caps the splits so that none is shorter than MIN_KEYS_PER_SPLIT."""
    want = -(-DECODE_TARGET_PROGRAMS // max(1, batch * kv_heads))
    splits = min(MAX_DECODE_SPLITS, next_power_of_2(want))
    if max_context is not None:
        fits = max(1, max_context // MIN_KEYS_PER_SPLIT)
        splits = min(splits, 1 << (fits.bit_length() - 1))  # largest power of two <= fits
    return splits
