"""The quantized weights' block formats, torch-free: what the engine's kernels read
(meshserve/layers/quantization/blocks.py re-exports all of it) and what the planner counts and splits
(meshserve/plan imports no torch and nothing of meshserve.layers, so the one table lives here).

- GGUF's block types, byte for byte as llama.cpp writes them (Q4_0 ... Q6_K): a block of 32 or 256
  consecutive values of one row carries its own scale (and offset), so a row, and a run of whole
  blocks inside a row, can be cut out and read alone;
- INT8_ROWS and FP8_E4M3_ROWS: one byte per value (int8, or float8 e4m3) with one float32 scale per
  output channel (ROW_SCALE_BYTES per row), made at load from a float checkpoint
  (quantization="int8"/"fp8") or read from an fp8 checkpoint.

The rule every split obeys (tensor parallelism, the planner's layouts): rows split anywhere, and a
row's values split only at block boundaries (`check_block_split`).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class BlockType(IntEnum):
    """GGML's type ids for its block formats; ours (from 100) for one-byte rows with row scales."""
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14
    INT8_ROWS = 100
    FP8_E4M3_ROWS = 101


@dataclass(frozen=True)
class BlockFormat:
    values: int  # per block
    bytes: int  # per block
    bits: float  # storage bits per value, block scales included (row scales are not)


def _fmt(values: int, nbytes: int) -> BlockFormat:
    return BlockFormat(values, nbytes, nbytes * 8 / values)


# Keep in step with quant_format in meshserve/layers/csrc/quant_gemv.cpp.
BLOCK_FORMATS: dict[BlockType, BlockFormat] = {
    BlockType.Q4_0: _fmt(32, 18), BlockType.Q4_1: _fmt(32, 20), BlockType.Q5_0: _fmt(32, 22),
    BlockType.Q5_1: _fmt(32, 24), BlockType.Q8_0: _fmt(32, 34), BlockType.Q4_K: _fmt(256, 144),
    BlockType.Q6_K: _fmt(256, 210), BlockType.INT8_ROWS: _fmt(32, 32), BlockType.FP8_E4M3_ROWS: _fmt(32, 32),
}
ROW_SCALED = frozenset({BlockType.INT8_ROWS, BlockType.FP8_E4M3_ROWS})
GGUF_BLOCK_TYPES = frozenset(BLOCK_FORMATS) - ROW_SCALED
ROW_SCALE_BYTES = 4  # the ROW_SCALED types' float32 scale per output row


def block_type_of(ggml_type: int) -> BlockType | None:
    """Our BlockType for a GGUF tensor type id, or None where it is not a block format we read."""
    try:
        t = BlockType(int(ggml_type))
    except ValueError:
        return None
    return t if t in GGUF_BLOCK_TYPES else None


def check_block_split(what: str, values: int, parts: int, block_type: BlockType,
                      name: str = "tensor_parallel_size") -> None:
    """ValueError when `values` (a row's length) cannot be cut into `parts` runs of whole blocks;
    the message names the part counts that work (the planner applies the same rule)."""
    per_block = BLOCK_FORMATS[block_type].values
    if values % parts == 0 and (values // parts) % per_block == 0:
        return
    ok = [p for p in range(1, min(values // per_block, 64) + 1)
          if values % p == 0 and (values // p) % per_block == 0]
    raise ValueError(f"{what}: {values} values per row in {block_type.name} blocks of {per_block} cannot be split "
                     f"into {parts} parts at block boundaries; {name} that work: {', '.join(map(str, ok))}")
