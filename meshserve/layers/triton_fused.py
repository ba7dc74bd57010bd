"""The element-wise work of a decoder layer on CUDA, one Triton launch each:

- `add_rms_norm`: the previous sub-layer's output added into the residual stream (in place) and
  the sum RMS-normalised, in one pass over the row (the PyTorch formula is nine kernels);
- `rope_and_cache`: the rotary embedding of every query and key head, rotated in place in the fused
  QKV output, with the step's K and V stored into their cache slots by the same programs (the
  PyTorch path gathers cos/sin, rotates in a dozen kernels and scatters K/V in two more);
- `silu_and_mul`: silu(gate) * up.

Each rounds where the PyTorch formula of its layer rounds (the variance and the rotation in float32,
results cast to the activation dtype before the weight multiply, products rounded before their sum),
so in float32 they agree with the CPU path to float32 rounding, and in bf16 to one rounding step.
The cos/sin rows are gathered once per step by the model (RotaryEmbedding.at), not per layer.

Imported by layers/fused.py on first use; the tests run these kernels in Triton's interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=0) / N
    y = (x32 * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """norm(x) * weight for x [T, N]; with `residual`, norm(x + residual) * weight, the sum written
    into `residual` (which must be contiguous in its last dimension)."""
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(t,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps,
                               N=n, BLOCK=_pow2(n), HAS_RESIDUAL=residual is not None)
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    # silu as torch computes it (x / (1 + e^-x)), rounded to the activation dtype before the product
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, (s.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = [gate | up]; returns [T, I]."""
    t, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, _pow2(n))
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out


@triton.jit
def _rope_and_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                           stride_t, stride_cos, stride_slot,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           HALF_P: tl.constexpr, WRITE_KV: tl.constexpr):
    """One program per (token, query or key head): the head rotated in place; a key head's
    program also stores the rotated key and its value head into the token's cache slot."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HALF_P)
    mask = d < HALF
    dtype = qkv_ptr.dtype.element_ty
    base = qkv_ptr + t * stride_t + head * (2 * HALF)
    x1 = tl.load(base + d, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + d, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + t * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_cos + HALF + d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_cos + HALF + d, mask=mask, other=0.0).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as the PyTorch formula rounds it
    o1 = ((a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + d, o1, mask=mask)
    tl.store(base + HALF + d, o2, mask=mask)
    if WRITE_KV:  # noqa: SIM102  (compile-time, unlike the head test inside)
        if head >= NUM_HEADS:
            kv_head = head - NUM_HEADS
            slot = tl.load(slots_ptr + t)
            row = slot * stride_slot + kv_head * (2 * HALF)
            tl.store(k_cache_ptr + row + d, o1, mask=mask)
            tl.store(k_cache_ptr + row + HALF + d, o2, mask=mask)
            v = qkv_ptr + t * stride_t + (NUM_HEADS + NUM_KV_HEADS + kv_head) * (2 * HALF)
            tl.store(v_cache_ptr + row + d, tl.load(v + d, mask=mask), mask=mask)
            tl.store(v_cache_ptr + row + HALF + d, tl.load(v + HALF + d, mask=mask), mask=mask)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   slots: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                   v_cache: torch.Tensor | None = None) -> None:
    """Rotate the query and key heads of qkv [T, (H + 2 KVH) D] in place by cos/sin [T, D] (the
    step's rows, in qkv's dtype). With the caches ([num_blocks, block_size, KVH, D], qkv's dtype,
    contiguous) and the slot of each token, also store the rotated keys and the values there."""
    t, d = qkv.shape[0], cos.shape[-1]
    if t == 0:
        return
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope_and_cache needs unit-stride rows")
    write = k_cache is not None
    if k_cache is not None:
        assert slots is not None and v_cache is not None
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == qkv.dtype == v_cache.dtype):
            raise ValueError("rope_and_cache writes contiguous caches of the activation dtype only")
        slots_arg, caches = slots, (k_cache, v_cache)
    else:
        slots_arg, caches = qkv, (qkv, qkv)  # unread: WRITE_KV is off
    _rope_and_cache_kernel[(t, num_heads + num_kv_heads)](
        qkv, cos, sin, slots_arg, *caches, qkv.stride(0), cos.stride(0),
        num_kv_heads * d, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=d // 2, HALF_P=_pow2(d // 2),
        WRITE_KV=write)
