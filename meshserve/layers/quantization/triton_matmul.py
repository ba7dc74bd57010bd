"""The matmul of quantized weights on CUDA, in Triton: weight-only, dequantized in registers.

`prepare_cuda_weight` converts a `QuantizedWeight` once, at load, into a `CudaQuantWeight`: the
levels of every value in one of three layouts, with their scales (and offsets) per group of values
along a row, folded so that `scale * level + offset` in float32 is bit for bit what
reference.dequantize reads from the blocks (every product there is exact; the one addition rounds
exactly as the reference's does):

    block type      levels                              scale per               offset
    Q4_0            4-bit, two per byte, minus 8        32 values: d (f16)      -
    Q4_1            4-bit, two per byte                 32 values: d (f16)      m (f16)
    Q4_K            4-bit, two per byte                 32 values: d*sc (f32)   -dmin*m (f32)
    Q5_0            int8, q - 16                        32 values: d (f16)      -
    Q5_1            int8, q                             32 values: d (f16)      m (f16)
    Q8_0            int8                                32 values: d (f16)      -
    Q6_K            int8, q - 32                        16 values: d*sc (f32)   -
    INT8_ROWS       int8                                row: float32            -
    FP8_E4M3_ROWS   float8_e4m3fn                       row: float32            -

4-bit levels pack values 2j and 2j + 1 of a row into byte j (low, high nibble).

One kernel reads them all (constexprs: bits 4 or 8, fp8, group 32 / 16 / 0 = per row, offset or
not, the 4-bit zero point): each program computes a [BLOCK_M, BLOCK_N] tile of the output; per
BLOCK_K step it loads the x tile and the weight tile's levels, scales them per group in float32
(`[BLOCK_N, BLOCK_K // GROUP, GROUP] * scale[:, :, None] + offset`), casts the tile to x's dtype
(float32 x stays float32, with an IEEE-precision tl.dot) and accumulates `tl.dot` in float32.
Row-scaled weights (int8, fp8) are dotted as their levels, which float16/bfloat16 hold exactly,
and the row scale multiplies the accumulator once at the end. Bias is added in float32; the
output is written in x's dtype. Ragged M, N and K edges are masked (K is always a multiple of 32).

Tiles: decode (M <= 16) uses 16 x 32 x 128 tiles and, where the output tiles would not fill the
GPU, split-K (each split writes a float32 partial, summed by torch; deterministic, capturable in
a CUDA graph); prefill uses up to 128 x 128 x 64 tiles.

fp8 levels are converted by Triton natively where it supports float8e4nv (compute capability >=
8.9, and the interpreter); on older GPUs the kernel decodes the e4m3 bits through float16 (exact
for every finite value; NaN bytes, which fp8_rows never writes, read as +-480).

W8A8 (opt-in, GPU only): a CudaQuantWeight of fp8 rows with `w8a8=True` runs prefill-sized
bfloat16 matmuls (at least W8A8_MIN_ROWS rows, K and N multiples of 16) with torch._scaled_mm on
GPUs with fp8 tensor cores (compute capability >= 8.9): x is quantized per token to e4m3
(amax / 448) and the product is scaled per token and per output channel. It changes numerics
(x is rounded to 3 mantissa bits), never runs on CPU tensors, and is untested without a GPU.

The tests run the same kernels on CPU tensors in the Triton interpreter (TRITON_INTERPRET=1 set
before this module is imported): tests/engine/test_triton_quant.py. The interpreter's bfloat16
tl.dot is wrong (numpy has no bfloat16), so on CPU tensors bfloat16 x is dotted in float32 (the
float16 tests take the 16-bit tl.dot path that bfloat16 takes on GPUs).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from meshserve.layers.quantization.blocks import BLOCK_FORMATS, BlockType, QuantizedWeight
from meshserve.layers.quantization.reference import FP8_E4M3_MAX

W8A8_MIN_ROWS = 64  # below this the weight read dominates and the weight-only kernel is as fast


@dataclass
class CudaQuantWeight:
    """A quantized weight [out_features, in_features] in the layout the Triton kernel reads.

    levels: uint8 [N, K // 2] (bits 4: values 2j, 2j+1 in the low, high nibble of byte j), int8
    [N, K] (bits 8) or float8_e4m3fn [N, K]; scales: [N, K // group] float16 / float32, or float32
    [N] where group == 0 (one scale per output row); offsets: like scales where the format has one.
    A value is scale * (level - zero) + offset, in float32."""
    block_type: BlockType
    in_features: int
    levels: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int  # 4 or 8 (int8 and fp8)
    group: int  # values per scale along a row: 32, 16, or 0 (a row scale)
    zero: int = 0  # subtracted from a 4-bit level before scaling (Q4_0's 8)
    w8a8: bool = False  # fp8 rows only: allow the torch._scaled_mm path on capable GPUs (see module doc)

    @property
    def out_features(self) -> int:
        return self.levels.shape[0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.levels.device

    @property
    def fp8(self) -> bool:
        return self.levels.dtype == torch.float8_e4m3fn

    @property
    def nbytes(self) -> int:
        parts = [self.levels, self.scales] + ([] if self.offsets is None else [self.offsets])
        return sum(t.numel() * t.element_size() for t in parts)


# ---------------------------------------------------------------------------------------------
# Conversion, once at load: plain torch on the blocks' device.

def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 field at byte `at` of every block: [N, blocks]."""
    return blocks[:, :, at:at + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> [..., 2n]: the low nibbles of all n bytes, then the high ones (GGUF's
    order inside a run of 32 values)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q5_levels(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5 blocks' 5-bit levels [N, blocks, 32]: the nibbles, with bit j of the 32-bit qh on top."""
    bits = torch.arange(32, device=qh.device)
    high = (qh[:, :, bits // 8] >> (bits % 8).to(torch.uint8)) & 1
    return _nibbles(qs) | (high << 4)


def _q4k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's eight 6-bit sub-scales and sub-mins from the 12 packed bytes: [N, blocks, 8] each."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q6k_levels(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's 6-bit levels [N, blocks, 256] (0..63): value j of a super-block takes the nibble of
    ql byte h*64 + r%64 (high nibble where r >= 64) and 2 bits of qh byte h*32 + r%32 at shift
    2*(r//32), with h = j // 128, r = j % 128."""
    j = torch.arange(256, device=ql.device)
    h, r = j // 128, j % 128
    low = (ql[:, :, h * 64 + r % 64] >> ((r // 64) * 4).to(torch.uint8)) & 0x0F
    high = (qh[:, :, h * 32 + r % 32] >> ((r // 32) * 2).to(torch.uint8)) & 0x03
    return low | (high << 4)


def _pack4(levels: torch.Tensor) -> torch.Tensor:
    """uint8 levels [N, K] of 0..15 -> [N, K // 2]: values 2j, 2j + 1 in byte j's low, high nibble."""
    return (levels[:, 0::2] | (levels[:, 1::2] << 4)).contiguous()


def _convert(qw: QuantizedWeight) -> CudaQuantWeight:
    t, n, k = qw.block_type, qw.out_features, qw.in_features
    if t == BlockType.INT8_ROWS or t == BlockType.FP8_E4M3_ROWS:
        assert qw.row_scale is not None
        dtype = torch.int8 if t == BlockType.INT8_ROWS else torch.float8_e4m3fn
        return CudaQuantWeight(t, k, qw.data.contiguous().view(dtype), qw.row_scale.float().contiguous(), None,
                               bits=8, group=0)
    fmt = BLOCK_FORMATS[t]
    blocks = qw.data.contiguous().view(n, k // fmt.values, fmt.bytes)
    if t == BlockType.Q4_0:
        levels = _nibbles(blocks[:, :, 2:18]).reshape(n, k)
        return CudaQuantWeight(t, k, _pack4(levels), _half(blocks, 0), None, bits=4, group=32, zero=8)
    if t == BlockType.Q4_1:
        levels = _nibbles(blocks[:, :, 4:20]).reshape(n, k)
        return CudaQuantWeight(t, k, _pack4(levels), _half(blocks, 0), _half(blocks, 2), bits=4, group=32)
    if t == BlockType.Q5_0:
        levels = (_q5_levels(blocks[:, :, 2:6], blocks[:, :, 6:22]).to(torch.int8) - 16).reshape(n, k)
        return CudaQuantWeight(t, k, levels, _half(blocks, 0), None, bits=8, group=32)
    if t == BlockType.Q5_1:
        levels = _q5_levels(blocks[:, :, 4:8], blocks[:, :, 8:24]).to(torch.int8).reshape(n, k)
        return CudaQuantWeight(t, k, levels, _half(blocks, 0), _half(blocks, 2), bits=8, group=32)
    if t == BlockType.Q8_0:
        levels = blocks[:, :, 2:34].contiguous().view(torch.int8).reshape(n, k)
        return CudaQuantWeight(t, k, levels, _half(blocks, 0), None, bits=8, group=32)
    if t == BlockType.Q4_K:
        # value = d*sc * q - dmin*m: both products exact in float32 (11-bit x 6-bit significands)
        d, dmin = _half(blocks, 0).float(), _half(blocks, 2).float()
        sc, mn = _q4k_scale_min(blocks[:, :, 4:16])
        qs = blocks[:, :, 16:144].reshape(n, k // 256, 4, 32)
        levels = _nibbles(qs).reshape(n, k)  # per 32 bytes: 32 low nibbles, then 32 high
        scales = (d[:, :, None] * sc.float()).reshape(n, k // 32)
        offsets = (-(dmin[:, :, None] * mn.float())).reshape(n, k // 32)
        return CudaQuantWeight(t, k, _pack4(levels), scales.contiguous(), offsets.contiguous(), bits=4, group=32)
    if t == BlockType.Q6_K:
        # value = d*sc * (q - 32): d*sc exact in float32 (11-bit x 8-bit), times 6 bits still exact
        levels = (_q6k_levels(blocks[:, :, 0:128], blocks[:, :, 128:192]).to(torch.int8) - 32).reshape(n, k)
        sc = blocks[:, :, 192:208].contiguous().view(torch.int8).float()
        scales = (_half(blocks, 208).float()[:, :, None] * sc).reshape(n, k // 16)
        return CudaQuantWeight(t, k, levels, scales.contiguous(), None, bits=8, group=16)
    raise ValueError(f"no CUDA layout for {t.name} blocks")


def prepare_cuda_weight(qw: QuantizedWeight, device: torch.device) -> CudaQuantWeight:
    """Once at load: the GPU layout of these blocks on `device`."""
    w = _convert(qw)
    w.levels = w.levels.to(device).contiguous()
    w.scales = w.scales.to(device).contiguous()
    w.offsets = None if w.offsets is None else w.offsets.to(device).contiguous()
    return w


# ---------------------------------------------------------------------------------------------
# The kernel.

@triton.jit(do_not_specialize=["M", "stride_os"])  # the row count varies by step; one compile serves all
def _quant_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os,
    BITS: tl.constexpr, FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, GROUP: tl.constexpr,
    ZERO: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)  # a multiple of 32: groups and byte pairs are whole

    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < k_end)[None, :], other=0.0)
        if DOT_F32:  # bfloat16 x in the interpreter, whose bfloat16 tl.dot is wrong
            x = x.to(tl.float32)
        if BITS == 4:
            byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_rows + byte[None, :], mask=col_ok[:, None] & (byte < k_end // 2)[None, :], other=0)
            levels = tl.reshape(tl.join(packed & 0x0F, packed >> 4), [BLOCK_N, BLOCK_K])
            w = (levels.to(tl.int32) - ZERO).to(tl.float32)
        else:
            w_mask = col_ok[:, None] & (ks < k_end)[None, :]
            if FP8 and FP8_NATIVE:  # float8e4nv pointer; `other` would be cast to fp8, so zero after
                w = tl.where(w_mask, tl.load(w_rows + ks[None, :], mask=w_mask).to(tl.float32), 0.0)
            elif FP8:  # uint8 bytes of e4m3: sign, 4-bit exponent, 3-bit mantissa
                bits = tl.load(w_rows + ks[None, :], mask=w_mask, other=0).to(tl.int32)
                half = ((bits & 0x7F) << 7).to(tl.int16)  # float16 bits of |value| * 2**-8
                magnitude = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
                w = tl.where((bits & 0x80) != 0, -magnitude, magnitude)
            else:  # int8
                w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0).to(tl.float32)
        if GROUP > 0:
            groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            g_mask = col_ok[:, None] & (groups < k_end // GROUP)[None, :]
            g_offsets = cols.to(tl.int64)[:, None] * stride_sn + groups[None, :]
            scale = tl.load(scale_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)
            w3 = tl.reshape(w, [BLOCK_N, BLOCK_K // GROUP, GROUP]) * scale[:, :, None]
            if HAS_OFFSET:
                offset = tl.load(offset_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)
                w3 = w3 + offset[:, :, None]
            w = tl.reshape(w3, [BLOCK_N, BLOCK_K])
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)

    if GROUP == 0:  # one scale per output row: applied once to the sums of levels
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    out_offsets = rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if SPLIT_K > 1:  # float32 partial sums of this split; the caller adds them, and the bias
        tl.store(out_ptr + pid_k * stride_os + out_offsets, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# ---------------------------------------------------------------------------------------------
# Launch.

@dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


DECODE_ROWS = 16  # up to this many rows of x: the GEMV-like tiles (tl.dot needs >= 16 anyway)
MAX_SPLIT_K = 16


def _tiles(m: int, n: int, k: int, sms: int) -> _Tiles:
    """Tile sizes for an [m, k] x [k, n] product on a device with `sms` multiprocessors: every
    tl.dot dimension >= 16, BLOCK_K a multiple of 32 (a group, and whole byte pairs)."""
    if m <= DECODE_ROWS:
        block_k = 128 if k >= 128 else 64 if k >= 64 else 32
        tiles = _Tiles(16, 32, block_k, num_warps=4, num_stages=4)
        programs = triton.cdiv(n, tiles.block_n)
        k_blocks = triton.cdiv(k, tiles.block_k)
        split = 1
        while split < MAX_SPLIT_K and programs * split < 2 * sms and split * 2 <= k_blocks:
            split *= 2
        return _Tiles(tiles.block_m, tiles.block_n, tiles.block_k, split, tiles.num_warps, tiles.num_stages)
    if m <= 64:
        return _Tiles(32 if m <= 32 else 64, 64, 64, num_warps=4, num_stages=4)
    return _Tiles(128 if m >= 128 else 64, 128, 64, num_warps=8 if m >= 128 else 4, num_stages=3)


@functools.cache
def _device_info(device: torch.device) -> tuple[int, tuple[int, int]]:
    """(multiprocessors, compute capability) of a CUDA device; CPU (the interpreter): (1, (0, 0))."""
    if device.type != "cuda":
        return 1, (0, 0)
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, (props.major, props.minor)


def _fp8_native(device: torch.device) -> bool:
    """Whether Triton converts float8e4nv itself here: the interpreter, and GPUs of capability >= 8.9."""
    return device.type != "cuda" or _device_info(device)[1] >= (8, 9)


def _launch(x: torch.Tensor, w: CudaQuantWeight, bias: torch.Tensor | None, tiles: _Tiles,
            fp8_native: bool | None = None) -> torch.Tensor:
    m, k = x.shape
    n = w.out_features
    split = tiles.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, tiles.block_k), split) * tiles.block_k
    split = triton.cdiv(k, k_per_split)  # no empty splits
    if fp8_native is None:
        fp8_native = _fp8_native(x.device)
    dot_f32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.device.type != "cuda")
    levels = w.levels if (not w.fp8 or fp8_native) else w.levels.view(torch.uint8)
    if split > 1:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    _quant_matmul_kernel[grid](
        x, levels, w.scales, w.scales if w.offsets is None else w.offsets,
        out if bias is None else bias, out,
        m, n, k, k_per_split,
        x.stride(0), levels.stride(0), w.scales.stride(0), out.stride(-2), out.stride(0) if split > 1 else 0,
        BITS=w.bits, FP8=w.fp8, FP8_NATIVE=fp8_native, GROUP=w.group, ZERO=w.zero,
        HAS_OFFSET=w.offsets is not None, HAS_BIAS=bias is not None, SPLIT_K=split,
        DOT_F32=dot_f32 and x.dtype != torch.float32,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION="ieee" if dot_f32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if split == 1:
        return out
    total = out.sum(0)
    if bias is not None:
        total += bias.float()
    return total.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# W8A8 fp8 (GPU only, opt-in): torch._scaled_mm with per-token activation scales.

def _w8a8_usable(x: torch.Tensor, w: CudaQuantWeight) -> bool:
    return (w.w8a8 and w.fp8 and x.is_cuda and hasattr(torch, "_scaled_mm") and x.dtype == torch.bfloat16
            and x.shape[0] >= W8A8_MIN_ROWS and w.in_features % 16 == 0 and w.out_features % 16 == 0
            and _device_info(x.device)[1] >= (8, 9))


def _w8a8_matmul(x: torch.Tensor, w: CudaQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x quantized per token to e4m3 (scale amax / 448), the fp8 x fp8 product on the tensor cores
    scaled by (token scale) x (row scale): rowwise-scaled _scaled_mm, bfloat16 out."""
    xf = x.float()
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    xq = (xf / x_scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(xq, w.levels.t(), scale_a=x_scale, scale_b=w.scales.view(1, -1),
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def cuda_quantized_matmul(x: torch.Tensor, w: CudaQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, dequantized weight, bias) for x [M, K] (float16/bfloat16/float32) -> [M, N] in x's dtype.

    Leading dimensions beyond one are flattened ([..., K] -> [..., N])."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"quantized matmul: x has {x.shape[-1]} features, the weight {w.in_features}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"quantized matmul: x must be float16, bfloat16 or float32, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    m, n = x2.shape[0], w.out_features
    if m == 0 or n == 0:
        out = torch.zeros(m, n, dtype=x.dtype, device=x.device)
        if bias is not None:
            out += bias.to(x.dtype)
        return out.reshape(*lead, n)
    if _w8a8_usable(x2, w):
        return _w8a8_matmul(x2, w, bias).reshape(*lead, n)
    tiles = _tiles(m, n, w.in_features, _device_info(x.device)[0])
    return _launch(x2, w, bias, tiles).reshape(*lead, n)
