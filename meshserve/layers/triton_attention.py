"""Paged attention for CUDA in Triton: every query reads its K/V straight from the cache blocks
named by its block table, with no gathered copy and no dense mask.

One kernel serves both cases the runner builds:
- prefill (a fresh prompt, a chunk after earlier chunks, or the rest of a prompt after a prefix
  hit): one program per (tile of a sequence's query tokens, KV head); causal within the chunk, and
  every cached token before it is visible;
- decode (one query token per sequence): one program per (sequence, KV head, key split). With few
  sequences a program's keys are split into ranges whose partial softmax results a second small
  kernel combines (split-K, as flash-decoding does), so that a small batch still fills the device.

A program's rows are (query token, head of the KV group) pairs: each K/V row loaded serves the
whole group (grouped-query attention without repeating K/V). Softmax runs online in float32 with
exp2. Keys are taken `block_n` at a time with a per-key block-table lookup, so any block size works.

An fp8 cache (--kv-cache-dtype) is loaded as stored and widened to the query's dtype before the
dots (exact: every e4m3 and e5m2 value is a bfloat16 and a float16 value); the layer's k_scale
multiplies into the score scale and its v_scale into the output. Where Triton cannot convert
float8_e4m3fn (GPUs before compute capability 8.9), its bytes are turned into float16 bit patterns
instead (FP8_E4M3_BITS: the value / 2^8, made up for in the two scales).

Imported only when the Triton attention backend is made (layers/attention/triton_backend.py: on
CUDA, or by the tests, which run the same kernels on CPU tensors in the Triton interpreter,
TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshserve.layers.paged_launch import TileShape, decode_tile, fit_shared_memory, next_power_of_2, prefill_tile

LOG2_E = 1.4426950408889634


@triton.jit
def _e4m3_bytes_as_f16(x):
    """float8_e4m3fn bytes (uint8) as float16s of the same sign, exponent and mantissa bits, whose
    values are theirs / 2^8 (the exponent biases are 7 and 15)."""
    b = x.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


# The block tables' width changes from step to step (prefill tables are padded to the step's
# widest): specialized on, each new value class (1, multiple of 16, other) would be a compile.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, split_max_ptr, split_sum_ptr,
    block_tables_ptr, context_lens_ptr, query_start_ptr, tile_seq_ptr, tile_start_ptr,
    scale_log2, v_scale,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    stride_mt, stride_mh,
    GROUP: tl.constexpr, HEADS_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DECODE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_E4M3_BITS: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # program 0 axis = sequence; its single query is row `seq` of q
        seq = tl.program_id(0)
        q_first = seq
        q_len = 1
        tile_start = 0
    else:
        tile = tl.program_id(0)
        seq = tl.load(tile_seq_ptr + tile)
        tile_start = tl.load(tile_start_ptr + tile)
        q_first = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_first
    context_len = tl.load(context_lens_ptr + seq)
    num_cached = context_len - q_len

    rows = tl.arange(0, BLOCK_Q * HEADS_P)
    row_token = tile_start + rows // HEADS_P  # query offset within the sequence
    row_head = kv_head * GROUP + rows % HEADS_P
    row_valid = (rows % HEADS_P < GROUP) & (row_token < q_len)
    row_pos = num_cached + row_token  # position of the row's token: it sees keys 0..row_pos
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM

    q_offsets = (q_first + row_token).to(tl.int64)[:, None] * stride_qt + row_head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offsets + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Keys this program reads: up to its last row's position (causal), then its split's share.
    key_end = tl.minimum(context_len, num_cached + tile_start + BLOCK_Q)
    key_begin = 0
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(key_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        key_begin = split * per_split
        key_end = tl.minimum(key_end, key_begin + per_split)

    row_max = tl.full([BLOCK_Q * HEADS_P], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q * HEADS_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * HEADS_P, HEAD_DIM_P], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The first tile of every program holds a key each of its rows may see (key 0, or for a
    # decode split its first key), so row_max is finite from the first iteration on: no NaNs.
    for first_key in range(key_begin, key_end, BLOCK_N):
        keys = first_key + tl.arange(0, BLOCK_N)
        key_valid = keys < key_end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_offsets = block * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_E4M3_BITS:
            k = _e4m3_bytes_as_f16(k)
        k = k.to(q.dtype)  # an fp8 cache's values, exactly (a no-op for a cache in q's dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = key_valid[None, :] & (keys[None, :] <= row_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        weights = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(weights, 1)
        v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_E4M3_BITS:
            v = _e4m3_bytes_as_f16(v)
        v = v.to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    acc = acc * v_scale
    out_mask = row_valid[:, None] & dim_valid[None, :]
    out_rows = (q_first + row_token).to(tl.int64)[:, None] * stride_ot + row_head[:, None] * stride_oh
    if NUM_SPLITS > 1:  # unnormalised partial result, combined by _combine_splits_kernel
        tl.store(out_ptr + out_rows + split * stride_os + dims[None, :], acc, mask=out_mask)
        stat_offsets = seq * stride_mt + row_head * stride_mh + split
        tl.store(split_max_ptr + stat_offsets, row_max, mask=row_valid)
        tl.store(split_sum_ptr + stat_offsets, row_sum, mask=row_valid)
    else:
        out = acc / row_sum[:, None]
        tl.store(out_ptr + out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_splits_kernel(
    partial_ptr, split_max_ptr, split_sum_ptr, out_ptr,
    stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    split_max = tl.load(split_max_ptr + seq * stride_mt + head * stride_mh + splits)
    split_sum = tl.load(split_sum_ptr + seq * stride_mt + head * stride_mh + splits)
    # Split 0 always holds keys, so the overall max is finite; empty splits (max -inf) weigh 0.
    weight = tl.exp2(split_max - tl.max(split_max, 0))
    partial = tl.load(partial_ptr + seq * stride_pt + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
                      mask=dim_valid[None, :], other=0.0)
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(split_sum * weight, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged attention needs unit-stride head dimensions and K/V caches of one layout")


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def e4m3_as_bits(device: torch.device) -> bool:
    """Whether Triton must read float8_e4m3fn as bytes here: it converts the type natively on
    GPUs of compute capability 8.9 and later (and in the interpreter)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def _common_args(q, k_cache, v_cache, scale: float, num_heads: int, tile: TileShape, k_scale: float,
                 v_scale: float, e4m3_bits: bool | None) -> tuple[tuple, tuple, dict]:
    """((k_cache, v_cache), (score scale x log2 e, output scale, strides...), constexprs and
    num_stages) as the kernel takes them, the tile fitted to the shared memory budget
    (paged_launch.fit_shared_memory). k_scale / v_scale apply to fp8 caches only; e4m3_bits
    None: read float8_e4m3fn as bytes where e4m3_as_bits says so (True: always, as the tests do)."""
    head_dim = q.shape[-1]
    group = num_heads // k_cache.shape[2]
    bits = False
    if k_cache.dtype not in FP8_DTYPES:
        v_scale = 1.0
    else:
        scale *= k_scale
        if k_cache.dtype == torch.float8_e4m3fn and (e4m3_as_bits(q.device) if e4m3_bits is None else e4m3_bits):
            k_cache, v_cache, bits = k_cache.view(torch.uint8), v_cache.view(torch.uint8), True
            scale, v_scale = scale * 256.0, v_scale * 256.0  # the float16 patterns hold value / 2^8
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    head_dim_p = max(16, next_power_of_2(head_dim))
    tile = fit_shared_memory(tile, head_dim_p, q.element_size(), k_cache.element_size())
    consts = dict(GROUP=group, HEADS_P=tile.heads_padded, BLOCK_Q=tile.block_q, BLOCK_N=tile.block_n,
                  HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=k_cache.shape[1],
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8_E4M3_BITS=bits,
                  num_stages=tile.num_stages)
    return (k_cache, v_cache), (scale * LOG2_E, v_scale, *strides), consts


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      query_start: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                      tile_seq: torch.Tensor, tile_start: torch.Tensor, scale: float, k_scale: float = 1.0,
                      v_scale: float = 1.0, e4m3_bits: bool | None = None) -> None:
    """Attention of every prefill token, written into `out`.

    q, out: [T, H, D] (rows query_start[s]:query_start[s + 1] belong to sequence s); caches:
    [num_blocks, block_size, KVH, D], this step's K/V already written, in q's dtype or fp8 (read as
    stored x k_scale / v_scale); context_lens[s]: tokens sequence s sees after this step (cached +
    new); tile_seq / tile_start: the programs, from paged_launch.query_tiles with
    prefill_tile(group).block_q."""
    _check_layout(q, k_cache, v_cache)
    tile = prefill_tile(q.shape[1] // k_cache.shape[2])
    caches, args, consts = _common_args(q, k_cache, v_cache, scale, q.shape[1], tile, k_scale, v_scale, e4m3_bits)
    grid = (tile_seq.shape[0], k_cache.shape[2], 1)
    _paged_attention_kernel[grid](
        q, *caches, out, out, out,
        block_tables, context_lens, query_start, tile_seq, tile_start,
        *args, block_tables.stride(0), out.stride(0), out.stride(1), 0, 0, 0,
        DECODE=False, NUM_SPLITS=1, **consts)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     num_splits: int = 1, k_scale: float = 1.0, v_scale: float = 1.0,
                     e4m3_bits: bool | None = None) -> None:
    """Attention of one new token per sequence: q, out [B, H, D]; context_lens [B] counts the new
    token; block_tables [B, max_blocks]. `num_splits` (a power of two, paged_launch.decode_splits)
    splits each sequence's keys into that many ranges run in parallel. Caches as prefill_attention's."""
    _check_layout(q, k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    tile = decode_tile(num_heads // k_cache.shape[2])
    caches, args, consts = _common_args(q, k_cache, v_cache, scale, num_heads, tile, k_scale, v_scale, e4m3_bits)
    grid = (batch, k_cache.shape[2], num_splits)
    if num_splits == 1:
        _paged_attention_kernel[grid](
            q, *caches, out, out, out,
            block_tables, context_lens, context_lens, context_lens, context_lens,
            *args, block_tables.stride(0), out.stride(0), out.stride(1), 0, 0, 0,
            DECODE=True, NUM_SPLITS=1, **consts)
        return
    partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    split_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    split_sum = torch.empty_like(split_max)
    _paged_attention_kernel[grid](
        q, *caches, partial, split_max, split_sum,
        block_tables, context_lens, context_lens, context_lens, context_lens,
        *args, block_tables.stride(0), partial.stride(0), partial.stride(1), partial.stride(2),
        split_max.stride(0), split_max.stride(1),
        DECODE=True, NUM_SPLITS=num_splits, **consts)
    _combine_splits_kernel[(batch, num_heads)](
        partial, split_max, split_sum, out,
        partial.stride(0), partial.stride(1), partial.stride(2), split_max.stride(0), split_max.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_P=consts["HEAD_DIM_P"])
