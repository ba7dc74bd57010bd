"""A stage's dense decoder layers in one C++ call on CPU (csrc/decoder_stack.cpp).

The module path spends a few microseconds of Python per module call and per operator; over 30
layers that adds up to a noticeable share of a small model's decode step on a CPU. The C++ loop
runs the same operators in the same order, so its output is bit-identical
(tests/engine/test_cpu_decoder_stack.py compares the two). It takes Llama-family layers with the
dense SwiGLU MLP (bias on QKV allowed: Qwen2) on one tensor-parallel rank, float32 or bfloat16 on
CPU with the CPU kernels built (the KV cache in that dtype or fp8), for steps of the CPU attention
backend; anything else (MoE, Qwen3's query/key norm, TP all-reduces, CUDA, another attention
backend) keeps the module path.
MESHSERVE_DISABLE_CPU_KERNELS=1 turns it off with the other kernels.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import nn

from meshserve.layers import cpu_gemm, cpu_kernels
from meshserve.layers.attention import AttentionMetadata, PagedAttention
from meshserve.layers.attention.cpu import CPUAttentionMetadata
from meshserve.layers.attention.torch_ref import fresh_runs
from meshserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from meshserve.layers.norm import RMSNorm
from meshserve.layers.rotary import RotaryEmbedding

_NONE = torch.empty(0)


# What the loop reads of a Llama-family layer (models/llama.py, which imports this module).
class StackAttention(Protocol):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: RotaryEmbedding
    attn: PagedAttention  # holds the layer's KV-cache scales
    qkv_proj: QKVParallelLinear
    o_proj: RowParallelLinear


class StackMLP(Protocol):
    gate_up_proj: MergedColumnParallelLinear
    down_proj: RowParallelLinear


class StackLayer(Protocol):
    @property
    def input_layernorm(self) -> RMSNorm: ...
    @property
    def self_attn(self) -> nn.Module: ...
    @property
    def post_attention_layernorm(self) -> RMSNorm: ...
    @property
    def mlp(self) -> nn.Module: ...
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class _Layer(NamedTuple):
    """One layer whose attention and MLP are the classes the loop repeats (CPUDecoderStack.build)."""
    input_layernorm: RMSNorm
    attn: StackAttention
    post_attention_layernorm: RMSNorm
    mlp: StackMLP


class CPUDecoderStack:
    def __init__(self, layers: list[_Layer]):
        attn = layers[0].attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.eps = layers[0].input_layernorm.eps
        self.cos, self.sin = attn.rotary.cos, attn.rotary.sin
        self.packed_rows = cpu_gemm.packed_rows(attn.qkv_proj.weight.dtype)
        self.row_multiple = cpu_gemm.row_multiple(attn.qkv_proj.weight.dtype)
        self.dtype = attn.qkv_proj.weight.dtype
        self.weights: list[torch.Tensor] = []
        self.paged = [layer.attn.attn for layer in layers]  # their kv_scales, read at each call
        for layer in layers:  # the order of LayerWeight in decoder_stack.cpp
            a, m = layer.attn, layer.mlp
            self.weights += [layer.input_layernorm.weight, *_linear(a.qkv_proj), _or_none(a.qkv_proj.bias),
                             *_linear(a.o_proj), layer.post_attention_layernorm.weight,
                             *_linear(m.gate_up_proj), *_linear(m.down_proj)]

    @classmethod
    def build(cls, layers: Sequence[StackLayer], tp_size: int, attention: type[StackAttention],
              mlp: type[StackMLP]) -> CPUDecoderStack | None:
        """The stack for these layers, or None when any of them needs the module path. `attention`
        and `mlp`: the model's own classes, the only ones whose operators the C++ loop repeats."""
        if not layers or tp_size != 1:
            return None
        checked: list[_Layer] = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            if type(a) is not attention or type(m) is not mlp or a.o_proj.bias is not None:
                return None
            if not all(_runs_in_loop(x) for x in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)):
                return None
            checked.append(_Layer(layer.input_layernorm, a, layer.post_attention_layernorm, m))
            if a.rotary is not checked[0].attn.rotary or layer.input_layernorm.eps != layers[0].input_layernorm.eps:
                return None
            if not cpu_kernels.usable(*layer.parameters()) or a.rotary.cos.dtype != torch.float32:
                return None
        return cls(checked)

    def accepts(self, h: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> bool:
        """Only steps the CPU attention backend built: the loop repeats that backend's attention."""
        return isinstance(meta, CPUAttentionMetadata) and h.dim() == 2 and cpu_kernels.decode_usable(h, kv_caches[0])

    def __call__(self, positions: torch.Tensor, h: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: CPUAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) after the last layer, as the module loop leaves them."""
        groups, tables = [], []
        for run in fresh_runs(meta.prefills):
            first = run[0]
            groups += [first.q_start, run[-1].q_end, len(run), first.num_cached]
            tables.append(first.block_table if first.num_cached > 0 else _NONE)
        decode = meta.decode_block_tables is not None
        h, residual = cpu_kernels.decoder_stack(
            h, self.weights, kv_caches, positions, self.cos, self.sin, meta.slot_mapping, groups, tables,
            meta.num_prefill_tokens, meta.decode_block_tables if decode else _NONE,
            meta.decode_context_lens if decode else _NONE, self.num_heads, self.num_kv_heads, self.head_dim,
            self.eps, *self.packed_rows, self.row_multiple, cpu_gemm.gemv_max_rows(self.dtype),
            cpu_gemm.panel_max_rows(self.dtype),
            [s for a in self.paged for s in a.kv_scales])
        return h, residual


def _or_none(t: torch.Tensor | None) -> torch.Tensor:
    return _NONE if t is None else t


def _linear(m: cpu_gemm.PrepackedMatmul) -> list[torch.Tensor]:
    """[weight, oneDNN-packed weight or none, panels or none], or for a quantized weight [blocks,
    block type, row scales or none]."""
    if m.quant is None:
        return [m.weight, _or_none(m._packed), _or_none(m._panels)]
    blocks = m.quant.blocks
    assert blocks is not None, "CPUDecoderStack.build takes quantized weights of one run of CPU blocks only"
    return [blocks.data, torch.tensor([int(blocks.block_type)]), _or_none(blocks.row_scale)]


def _runs_in_loop(m: cpu_gemm.PrepackedMatmul) -> bool:
    """A float weight, or quantized blocks of one type on the CPU (a weight in several block types
    keeps the module path)."""
    return m.quant is None or m.quant.blocks is not None
