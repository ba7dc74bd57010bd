"""x @ W^T for a quantized W, on the device the blocks live on.

CPU: the C++ kernels (csrc/quant_gemv.cpp) read the blocks as stored, never expanding the weight:
a decode step's few rows at the memory's pace, and on the integer paths (activations rounded to
int8 per 32 values) prefill's many rows too, a panel of rows against each tile of the weight; on
the float path more than GEMV_MAX_ROWS rows take the float matmul of the dequantized weight.
CUDA: the Triton kernels of
triton_matmul.py on the layout prepared at load. Anything else: the reference dequantization.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels
from meshserve.layers.quantization.blocks import QuantizedWeight, cat_rows
from meshserve.layers.quantization.reference import dequantize


class _Segment:
    """Output rows of one block type, on their device: the blocks (CPU) or the layout the CUDA
    kernels read (prepared once)."""

    def __init__(self, qw: QuantizedWeight, device: torch.device):
        self.out_features = qw.out_features
        self.blocks: QuantizedWeight | None = None
        self.cuda_weight: Any = None
        if device.type == "cuda":
            from meshserve.layers.quantization.triton_matmul import prepare_cuda_weight

            self.cuda_weight = prepare_cuda_weight(qw, device)
        else:
            self.blocks = qw.to(device).contiguous()

    @property
    def nbytes(self) -> int:
        if self.blocks is not None:
            return self.blocks.nbytes
        return sum(v.numel() * v.element_size() for v in vars(self.cuda_weight).values()
                   if isinstance(v, torch.Tensor))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.blocks is None:
            from meshserve.layers.quantization.triton_matmul import cuda_quantized_matmul

            return cuda_quantized_matmul(x, self.cuda_weight, bias)
        qw = self.blocks
        if x.dim() == 2 and cpu_kernels.usable(x):
            return cpu_kernels.qmatmul(x, qw.data, int(qw.block_type), qw.row_scale, bias)
        return F.linear(x, dequantize(qw).to(x.dtype), bias)


class QuantizedMatmul:
    """A linear layer's quantized weight: its output rows in segments of one block type each (a
    fused projection whose parts a file stores in different types has several; most have one)."""

    def __init__(self, parts: list[QuantizedWeight], device: torch.device):
        merged: list[list[QuantizedWeight]] = []
        for part in parts:
            if merged and merged[-1][0].block_type == part.block_type:
                merged[-1].append(part)
            else:
                merged.append([part])
        self.segments = [_Segment(cat_rows(run), device) for run in merged]
        self.block_types = sorted({p.block_type.name for p in parts})

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds on its device."""
        return sum(s.nbytes for s in self.segments)

    @property
    def blocks(self) -> QuantizedWeight | None:
        """The whole weight as one run of CPU blocks, or None (several segments, or on CUDA)."""
        return self.segments[0].blocks if len(self.segments) == 1 else None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.segments) == 1:
            return self.segments[0](x, bias)
        outs, at = [], 0
        for seg in self.segments:
            outs.append(seg(x, None if bias is None else bias[at:at + seg.out_features]))
            at += seg.out_features
        return torch.cat(outs, dim=-1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight rows `ids` (an embedding lookup), [*ids.shape, in_features]."""
        blocks = self.blocks
        if blocks is None:
            raise RuntimeError("an embedding lookup needs one run of CPU blocks")
        flat = ids.reshape(-1)
        rs = None if blocks.row_scale is None else blocks.row_scale[flat]
        picked = QuantizedWeight(blocks.data[flat], blocks.block_type, blocks.in_features, rs)
        return dequantize(picked).to(dtype).reshape(*ids.shape, blocks.in_features)
