"""After a model's weights are loaded: which quantization it runs with, and each layer's quantized
weight, from the blocks its loader kept (a GGUF file's, an fp8 checkpoint's) or made from its float
weight (int8, fp8 at load).

What each method quantizes, as vLLM does: `gguf` every tensor the file stores in a block type the
kernels read (the token embedding and the LM head included); `int8` and `fp8` made at load the
decoder's column- and row-parallel linear layers and MoE experts, the embedding, the LM head and
MoE routers staying in the compute dtype; `none`
dequantizes whatever arrives as blocks. On CUDA a quantized token embedding is dequantized to the
compute dtype at load (a lookup reads a few rows, its kernels are for matmuls).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from meshserve.layers.cpu_gemm import PrepackedMatmul
from meshserve.layers.embedding import VocabParallelEmbedding
from meshserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from meshserve.layers.moe import GroupedExperts
from meshserve.layers.quantization.blocks import QuantizedWeight
from meshserve.layers.quantization.matmul import QuantizedMatmul
from meshserve.layers.quantization.reference import fp8_rows, int8_rows
from meshserve.layers.weight_loader import take_quantized_pieces

logger = logging.getLogger(__name__)

MADE_AT_LOAD = {"int8": int8_rows, "fp8": fp8_rows}


def resolve_method(asked: str | None, is_gguf: bool, checkpoint_method: str | None) -> str:
    """The method a model runs with: the one asked for, or what the checkpoint holds."""
    if asked is None:
        if is_gguf:
            return "gguf"
        return "fp8" if checkpoint_method == "fp8" else "none"
    if asked == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' keeps a GGUF file's blocks: give a .gguf model, or use none, int8 "
                         "or fp8 for this checkpoint")
    if checkpoint_method not in (None, "fp8"):
        raise ValueError(f"the checkpoint is quantized with {checkpoint_method!r}, which is not read here "
                         "(fp8 checkpoints and GGUF files are)")
    return asked


@dataclass
class WeightBytes:
    """What a rank's weights hold in memory, by kind."""
    quantized: int = 0
    dense: int = 0
    quantized_layers: int = 0
    block_types: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.quantized + self.dense

    def describe(self) -> str:
        kinds = f" in {', '.join(self.block_types)}" if self.block_types else ""
        return (f"{self.total / 2**20:,.1f} MiB of weights resident ({self.quantized / 2**20:,.1f} MiB "
                f"quantized{kinds} in {self.quantized_layers} tensors, {self.dense / 2**20:,.1f} MiB dense)")


def _layer_parts(module: nn.Module, weight: nn.Parameter, method: str) -> list[QuantizedWeight]:
    """The layer's quantized weight in row order, or [] where it stays dense."""
    pieces = take_quantized_pieces(weight)
    if pieces:
        rows = weight.shape[0]
        parts, at = [], 0
        for offset, piece in pieces:
            if offset != at:
                raise ValueError(f"quantized weight pieces leave rows [{at}, {offset}) of a "
                                 f"{list(weight.shape)} weight unloaded")
            parts.append(piece)
            at += piece.out_features
        if at < rows:  # a vocabulary padded to a multiple of the TP size: zero rows read as zeros
            last = parts[-1]
            pad = torch.zeros(rows - at, last.data.shape[1], dtype=torch.uint8)
            scale = None if last.row_scale is None else torch.zeros(rows - at)
            parts.append(QuantizedWeight(pad, last.block_type, last.in_features, scale))
        return parts
    if method in MADE_AT_LOAD and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return [MADE_AT_LOAD[method](weight.detach())]
    return []


def assemble_quantized(model: nn.Module, method: str, device: torch.device, dtype: torch.dtype) -> WeightBytes:
    """Give every layer its quantized weight (an empty dense `weight` stays, of the compute dtype);
    returns what the weights hold."""
    quantized: dict[int, int] = {}  # storage -> bytes (a tied embedding and LM head share theirs)
    block_types: set[str] = set()
    shared: dict[int, QuantizedMatmul] = {}  # by the dense weight's id
    count = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            if module.quantize(MADE_AT_LOAD.get(method), device, dense=method == "none"):
                assert module.quant is not None
                for matmul in (m for pair in module.quant for m in pair):
                    count += 1
                    block_types.update(matmul.block_types)
                    quantized[id(matmul)] = matmul.nbytes
                module.w13.data = torch.empty(0, dtype=dtype, device=device)
                module.w2.data = torch.empty(0, dtype=dtype, device=device)
            continue
        if not isinstance(module, (PrepackedMatmul, VocabParallelEmbedding)):
            continue
        weight = module.weight
        if id(weight) in shared:  # a tied embedding and LM head: one table
            module.quant = shared[id(weight)]
            continue
        parts = _layer_parts(module, weight, method)
        if not parts:
            continue
        dense_lookup = not isinstance(module, PrepackedMatmul) and device.type == "cuda"
        if method == "none" or dense_lookup:
            weight.data = torch.cat([p.to(weight.device).dequantize(dtype) for p in parts])
            continue
        module.quant = shared[id(weight)] = QuantizedMatmul(parts, device)
        weight.data = torch.empty(0, weight.shape[1], dtype=dtype, device=device)
        count += 1
        block_types.update(module.quant.block_types)
        for seg in module.quant.segments:
            key = seg.blocks.data.data_ptr() if seg.blocks is not None else id(seg)
            quantized[key] = seg.nbytes
    dense = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return WeightBytes(sum(quantized.values()), sum(dense.values()), count, tuple(sorted(block_types)))
