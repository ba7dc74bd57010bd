"""Quantized linear weights as rows of blocks: the formats, and the one object that carries them.

A `QuantizedWeight` is the weight [out_features, in_features] of a linear layer stored as `data`, a
[out_features, row_bytes] uint8 tensor whose every row holds that output channel's in_features
values in blocks of one `BlockType`:

- GGUF's block types, byte for byte as llama.cpp writes them (Q4_0 ... Q6_K): a block of 32 or 256
  consecutive values of one row carries its own scale (and offset), so a row, and a run of whole
  blocks inside a row, can be cut out and read alone;
- INT8_ROWS and FP8_E4M3_ROWS: one byte per value (int8, or float8 e4m3) with one float32 scale per
  output channel in `row_scale`, made at load from a float checkpoint (quantization="int8"/"fp8")
  or read from an fp8 checkpoint.

The rule every split obeys (tensor parallelism, the planner's layouts): rows split anywhere, and a
row's values split only at block boundaries (`check_block_split`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The formats and the split rule are torch-free (the planner reads them too); re-exported here.
from meshserve.block_formats import (  # noqa: F401
    BLOCK_FORMATS,
    GGUF_BLOCK_TYPES,
    ROW_SCALE_BYTES,
    ROW_SCALED,
    BlockFormat,
    BlockType,
    block_type_of,
    check_block_split,
)


@dataclass
class QuantizedWeight:
    data: torch.Tensor  # uint8 [out_features, row_bytes]
    block_type: BlockType
    in_features: int
    row_scale: torch.Tensor | None = None  # float32 [out_features]: ROW_SCALED types only

    def __post_init__(self) -> None:
        fmt = BLOCK_FORMATS[self.block_type]
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"quantized weight: uint8 [rows, row_bytes] data, got {self.data.dtype} "
                             f"{list(self.data.shape)}")
        if self.in_features % fmt.values or self.data.shape[1] != self.in_features // fmt.values * fmt.bytes:
            raise ValueError(f"quantized weight: {self.data.shape[1]} bytes per row do not hold "
                             f"{self.in_features} values in {self.block_type.name} blocks")
        if (self.row_scale is not None) != (self.block_type in ROW_SCALED):
            raise ValueError(f"quantized weight: {self.block_type.name} rows "
                             f"{'need' if self.block_type in ROW_SCALED else 'take no'} row scales")

    @property
    def shape(self) -> torch.Size:
        """The float weight's shape, [out_features, in_features]."""
        return torch.Size((self.data.shape[0], self.in_features))

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        scale = 0 if self.row_scale is None else self.row_scale.numel() * self.row_scale.element_size()
        return self.data.numel() + scale

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Tensor.narrow of the float weight: output rows (dim 0), or a run of whole blocks of every row (dim 1)."""
        if dim == 0:
            rs = None if self.row_scale is None else self.row_scale.narrow(0, start, length)
            return QuantizedWeight(self.data.narrow(0, start, length), self.block_type, self.in_features, rs)
        if dim != 1:
            raise IndexError(f"a quantized weight has 2 dimensions, got dim={dim}")
        fmt = BLOCK_FORMATS[self.block_type]
        if start % fmt.values or length % fmt.values:
            raise ValueError(f"quantized weight: columns [{start}, {start + length}) cut {self.block_type.name} "
                             f"blocks of {fmt.values} values")
        data = self.data.narrow(1, start // fmt.values * fmt.bytes, length // fmt.values * fmt.bytes)
        return QuantizedWeight(data, self.block_type, length, self.row_scale)

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """The weight with its output rows taken in `order` (a row's blocks move with it)."""
        rs = None if self.row_scale is None else self.row_scale[order]
        return QuantizedWeight(self.data[order], self.block_type, self.in_features, rs)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        rs = None if self.row_scale is None else self.row_scale.to(device)
        return QuantizedWeight(self.data.to(device), self.block_type, self.in_features, rs)

    def contiguous(self) -> QuantizedWeight:
        rs = None if self.row_scale is None else self.row_scale.contiguous()
        return QuantizedWeight(self.data.contiguous(), self.block_type, self.in_features, rs)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out_features, in_features] these blocks stand for."""
        from meshserve.layers.quantization.reference import dequantize

        return dequantize(self).to(dtype)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight of the parts' rows in order (all of one block type and row length)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(p.block_type != first.block_type or p.in_features != first.in_features for p in parts):
        raise ValueError("cat_rows: parts of different block types or row lengths")
    rs = None if first.row_scale is None else torch.cat([p.row_scale for p in parts if p.row_scale is not None])
    return QuantizedWeight(torch.cat([p.data for p in parts]), first.block_type, first.in_features, rs)
