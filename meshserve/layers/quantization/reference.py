"""Quantized weights made at load (int8, fp8) and read back to floats on any device.

`dequantize` is the reference every kernel is tested against: the C++ kernels where they are built
(they equal the `gguf` package's own dequantization, tests/engine/test_quant_gemv.py), the `gguf`
package's numpy code elsewhere, and plain torch for the one-byte row formats.
"""
from __future__ import annotations

import numpy as np
import torch

from meshserve.layers.quantization.blocks import BlockType, QuantizedWeight

FP8_E4M3_MAX = 448.0


def int8_rows(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8, one scale per output channel (max |w| of the row over 127)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    levels = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(levels.view(torch.uint8).contiguous(), BlockType.INT8_ROWS, w.shape[1],
                           scale.contiguous())


def fp8_rows(weight: torch.Tensor, row_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """float8 e4m3 with one scale per output channel: the checkpoint's (`weight` already fp8, or
    to be divided by it), or max |w| of the row over e4m3's largest value."""
    if weight.dtype == torch.float8_e4m3fn:
        if row_scale is None:
            raise ValueError("an fp8 weight needs its scale")
        values = weight
    else:
        w = weight.detach().float()
        if row_scale is None:
            row_scale = (w.abs().amax(dim=1) / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        values = (w / row_scale[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    scale = row_scale.float().reshape(-1).expand(weight.shape[0]).contiguous()
    return QuantizedWeight(values.contiguous().view(torch.uint8), BlockType.FP8_E4M3_ROWS, weight.shape[1], scale)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [out_features, in_features] on the blocks' device."""
    if qw.block_type == BlockType.INT8_ROWS:
        assert qw.row_scale is not None
        return qw.data.view(torch.int8).float() * qw.row_scale[:, None]
    if qw.block_type == BlockType.FP8_E4M3_ROWS:
        assert qw.row_scale is not None
        return qw.data.view(torch.float8_e4m3fn).float() * qw.row_scale[:, None]
    from meshserve.layers import cpu_kernels

    if qw.data.device.type == "cpu" and cpu_kernels.available():
        return cpu_kernels.qdequantize(qw.data.contiguous(), int(qw.block_type), qw.in_features)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    host = np.ascontiguousarray(qw.data.cpu().numpy())
    values = gguf_dequantize(host, GGMLQuantizationType(int(qw.block_type))).reshape(qw.out_features, qw.in_features)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(qw.data.device)
