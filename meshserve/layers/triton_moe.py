"""The experts of an MoE layer on CUDA without host reads: grouping on the device, then one Triton
launch per projection for every expert at once.

The eager path (layers/moe.py) reads each expert's token count on the host to slice its rows, so
a decode step that contains it cannot be captured in a CUDA graph. Here the grouping is a handful
of device operations over buffers whose sizes depend on the batch alone:

- `group_pairs`: the (token, slot) pairs sorted by expert (stable), each expert's run padded to
  whole tiles of BLOCK_M rows; `pairs[i]` is the pair a tile row computes (the number of pairs for
  padding rows) and `tile_expert[b]` the expert of tile b (E for the unused tail of the buffer).
  A batch of P pairs over E experts needs at most P // BLOCK_M + min(E, P) tiles.
- `expert_matmul`: out[pair] = a[pair // rows_per_a] @ w[expert of pair]^T, one program per (tile,
  column block): every expert's weights are read once per tile of its rows, never gathered into a
  copy. Results land in (token, slot) order, ready for the fixed-order weighted sum of moe.py.

Accumulation is in float32 (tl.dot, IEEE in float32), so results agree with the per-expert
matmuls of the eager path to float32 rounding, not bit for bit. On CPU tensors (the tests, in
the interpreter, whose bfloat16 tl.dot is wrong) bfloat16 tiles are dotted in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tl.dot's smallest tile


def max_tiles(num_pairs: int, num_experts: int) -> int:
    return num_pairs // BLOCK_M + min(num_experts, num_pairs)


def group_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs, tile_expert, counts) for expert ids [T, k]; counts[e]: pairs routed to expert e."""
    flat = ids.flatten()
    p, dev = flat.numel(), flat.device
    # scatter_add_, not bincount: bincount sizes its output from the largest id, read on the host
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + (BLOCK_M - 1)) // BLOCK_M
    tile_end = tiles.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first = counts.cumsum(0) - counts
    dest = (tile_end - tiles)[expert_of] * BLOCK_M + torch.arange(p, device=dev) - first[expert_of]
    n_tiles = max_tiles(p, num_experts)
    pairs = torch.full((n_tiles * BLOCK_M,), p, dtype=torch.long, device=dev).scatter_(0, dest, order)
    tile_expert = torch.searchsorted(tile_end, torch.arange(n_tiles, device=dev), right=True)
    return pairs, tile_expert, counts


@triton.jit(do_not_specialize=["num_pairs"])  # one compiled kernel whatever the batch
def _expert_matmul_kernel(a_ptr, w_ptr, out_ptr, pairs_ptr, tile_expert_ptr,
                          stride_am, stride_we, stride_wn, stride_om, num_pairs, num_experts, N, K,
                          ROWS_PER_A: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    rows = tl.where(valid, pair // ROWS_PER_A, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k_end = tl.where(expert < num_experts, K, 0)  # the unused tail of the tiles computes nothing
    w_base = w_ptr + tl.minimum(expert, num_experts - 1).to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:  # bfloat16 in the interpreter, whose bfloat16 tl.dot is wrong
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def expert_matmul(a: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, tile_expert: torch.Tensor,
                  num_pairs: int, rows_per_a: int) -> torch.Tensor:
    """[num_pairs, N]: row p is a[p // rows_per_a] @ w[e]^T for the expert e that p's tile computes;
    a [rows, K] (unit stride along K), w [E, N, K] contiguous."""
    n, k = w.shape[1], w.shape[2]
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    if a.stride(-1) != 1:
        a = a.contiguous()
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (tile_expert.shape[0], triton.cdiv(n, block_n))
    _expert_matmul_kernel[grid](a, w, out, pairs, tile_expert, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                                num_pairs, w.shape[0], n, k, ROWS_PER_A=rows_per_a, BLOCK_M=BLOCK_M,
                                BLOCK_N=block_n, BLOCK_K=block_k,
                                DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                                DOT_F32=a.dtype == torch.bfloat16 and a.device.type == "cpu")
    return out
