"""Paged decode attention for CPU: a small C++ kernel compiled on first use.

The PyTorch decode path gathers every sequence's K/V blocks into a padded copy before calling
SDPA; on CPU that copy triples the memory traffic of attention, which then costs more than the
layer's matmuls. This kernel reads K/V rows straight from their cache blocks instead. One task
is one sequence: each cached token's K/V row (all KV heads) is read once, as one contiguous run,
and serves every query head of its group (grouped-query attention).

The extension is built with torch's cpp_extension into the meshserve cache directory and reused
across runs; the build name carries a hash of the source, the compiler flags and the torch and
Python versions, so machines with different CPUs can share a cache directory. When the build
fails (no compiler) or MESHSERVE_DISABLE_CPU_KERNELS=1, `available()` is False and callers keep
the PyTorch path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// Calls f(t, row) for tokens t < L, row pointing at token t's [KVH, D] floats in its cache block.
template <typename F>
static inline void for_each_row(const float* cache, const int64_t* table, int64_t L, int64_t bs, int64_t row, F f) {
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const float* block = cache + table[t0 / bs] * bs * row;
    for (int64_t t = t0; t < std::min(L, t0 + bs); ++t) f(t, block + (t - t0) * row);
  }
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous());
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && block_tables.size(0) == B && context_lens.numel() == B);
  const int64_t G = H / KVH, row = KVH * D;  // query heads per KV head; floats per cached token
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * bs, "paged_decode: context length out of range");
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < k_cache.size(0),
                  "paged_decode: block id out of range");
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One task per sequence, all heads at once: a token's K (or V) row for every KV head is one
  // contiguous run, so each cache block streams in as a whole (reading one KV head's slice per
  // task instead measured about 2x slower, memory bound on the strided rows).
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, mx(H), inv(H);  // p: [H, L] scores, then unnormalised probabilities
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const float* qb = qp + b * H * D;
      float* ob = op + b * H * D;
      p.resize(H * L);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      for_each_row(kp, table, L, bs, row, [&](int64_t t, const float* k) {
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qb + h * D;
          const float* kh = k + (h / G) * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t i = 0; i < D; ++i) acc += qh[i] * kh[i];
          p[h * L + t] = acc * fscale;
          mx[h] = std::max(mx[h], acc * fscale);
        }
      });
      // Stable softmax: subtract the row max before exp; normalise the output once at the end.
      for (int64_t h = 0; h < H; ++h) {
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          p[h * L + t] = std::exp(p[h * L + t] - mx[h]);
          sum += p[h * L + t];
        }
        inv[h] = 1.f / sum;
      }
      std::fill(ob, ob + H * D, 0.f);
      for_each_row(vp, table, L, bs, row, [&](int64_t t, const float* v) {
        for (int64_t h = 0; h < H; ++h) {
          const float w = p[h * L + t];
          const float* vh = v + (h / G) * D;
          float* oh = ob + h * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) oh[i] += w * vh[i];
        }
      });
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D; ++i) ob[h * D + i] *= inv[h];
    }
  });
  return out;
}
"""

_lock = threading.Lock()
_module = None
_tried = False


def _cpu_flags() -> list[str]:
    """AVX2/FMA only when this CPU has them; never -march=native, whose output a machine with
    another CPU sharing the cache directory could not run (the flags are part of the build name)."""
    try:
        with open("/proc/cpuinfo") as f:
            words = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        words = []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(words) else []


def _build():
    from torch.utils.cpp_extension import load_inline

    from meshserve.models.loader import cache_dir

    # -fopenmp makes at::parallel_for use torch's OpenMP pool (same libgomp, already loaded).
    cflags = ["-O3", "-fopenmp", *_cpu_flags()]
    parts = [_SOURCE, *cflags, torch.__version__, sys.version.split()[0]]  # the module links this Python
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    name = f"meshserve_paged_decode_{key}"
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("building the CPU attention kernel in %s (once; about a minute)", build_dir)
    return load_inline(name=name, cpp_sources=[_SOURCE], functions=["paged_decode"],
                       extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir))


def _reason(e: Exception) -> str:
    """The compiler's own complaint rather than ninja's closing line."""
    lines = [line for line in str(e).strip().splitlines() if line and not line.startswith("ninja:")]
    return lines[-1] if lines else type(e).__name__


def available() -> bool:
    """True when the kernel is compiled (building it on the first call) and not disabled."""
    global _module, _tried
    if os.environ.get("MESHSERVE_DISABLE_CPU_KERNELS") == "1":
        return False
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _module = _build()
                except Exception as e:  # no compiler, no ninja, failed build: the PyTorch path still works
                    logger.warning("CPU attention kernel unavailable, using the PyTorch path: %s", _reason(e))
                _tried = True
    return _module is not None


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and available())


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_blocks, block_size, KVH, D]; block_tables: [B, max_blocks];
    context_lens: [B] tokens each sequence attends to (its new token included). Returns [B, H, D]."""
    if not available():
        raise RuntimeError("the CPU attention kernel is not available")
    return _module.paged_decode(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                block_tables.to(torch.long).contiguous(), context_lens.to(torch.long).contiguous(),
                                float(scale))
