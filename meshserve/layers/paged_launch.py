"""Launch geometry of the Triton paged-attention kernels, as plain arithmetic (no Triton import).

One kernel program handles the query heads that share one KV head, for a tile of a sequence's
query tokens: its rows are (token, head-in-group) pairs, so every K/V row it loads serves the whole
group. The Triton backend builds the tile list on the host with a step's metadata, which needs no
Triton, hence this module.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# tl.dot needs every dimension of its operands to be at least 16 on NVIDIA GPUs.
MIN_DOT = 16
PREFILL_ROWS = 64  # query rows (tokens x heads of one group) per prefill program
KEYS_PER_ITERATION = 64  # keys each program loads per loop iteration
# Split-K for decode: enough programs to fill the device twice over (132 SMs on an H100/H200),
# but never splits shorter than this many keys, where the combine step would cost more than it wins.
DECODE_TARGET_PROGRAMS = 264
MAX_DECODE_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256
# Shared memory one program may use: A100's per-block limit is 164 KB (H100/H200: 227 KB). The
# tiles are chosen statically against it, so that no GPU of these fails to compile them.
SHARED_MEMORY_BUDGET = 160 * 1024
# (keys per iteration, software-pipeline stages), preferred first. Float32 tiles on head_dim 128
# take (32, 2): (64, 3) would need about 240 KB.
TILE_CHOICES = ((64, 3), (64, 2), (32, 2), (32, 1), (16, 1))


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class TileShape:
    """Rows of one program: block_q query tokens x heads_padded heads (the group, padded)."""
    block_q: int
    heads_padded: int
    block_n: int = KEYS_PER_ITERATION
    num_stages: int = 3

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


def shared_memory_bytes(tile: TileShape, head_dim_p: int, q_bytes: int, kv_bytes: int) -> int:
    """A static upper estimate of one program's shared memory: the software pipeline's
    `num_stages` buffers of the K and V tiles as loaded, a K/V tile widened to q's dtype when the
    cache holds another (fp8), and the Q and weights tiles staged as tl.dot operands."""
    kv_tiles = 2 * tile.num_stages * tile.block_n * head_dim_p * kv_bytes
    widened = tile.block_n * head_dim_p * q_bytes if kv_bytes != q_bytes else 0
    return kv_tiles + widened + tile.rows * head_dim_p * q_bytes + tile.rows * tile.block_n * q_bytes


def fit_shared_memory(tile: TileShape, head_dim_p: int, q_bytes: int, kv_bytes: int,
                      budget: int = SHARED_MEMORY_BUDGET) -> TileShape:
    """`tile` with the first (block_n, num_stages) of TILE_CHOICES whose estimate fits `budget`."""
    for block_n, stages in TILE_CHOICES:
        fitted = replace(tile, block_n=block_n, num_stages=stages)
        if shared_memory_bytes(fitted, head_dim_p, q_bytes, kv_bytes) <= budget:
            return fitted
    raise ValueError(f"no attention tile of {tile.rows} rows x head_dim {head_dim_p} fits {budget} bytes")

