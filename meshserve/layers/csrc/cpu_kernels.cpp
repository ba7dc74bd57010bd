// CPU kernels for the float32 path: paged decode attention and the fused element-wise steps
// around the matmuls (RMSNorm with the residual add, SiLU-and-multiply, rotary embedding).
// Each fused kernel reads and writes every element once where the PyTorch sequence of ops makes
// several passes over activations that no longer fit in cache during prefill.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// exp(x) for float32, written so that `omp simd` loops vectorise it: x = n ln2 + r with
// |r| <= ln2 / 2, then a degree-6 polynomial for exp(r) (max relative error ~2 ulp) scaled by 2^n.
static inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split in two for precision
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The decode attention proper; HD > 0 fixes the head size at compile time (fully unrolled inner
// loops for the common sizes), HD == 0 takes it at run time.
template <int64_t HD>
static void paged_decode_impl(const float* qp, const float* kp, const float* vp, float* op, const int64_t* tables,
                              const int64_t* lens, int64_t B, int64_t H, int64_t D_rt, int64_t KVH, int64_t bs,
                              int64_t max_blocks, float fscale) {
  const int64_t D = HD > 0 ? HD : D_rt;
  const int64_t G = H / KVH, row = KVH * D;  // query heads per KV head; floats per cached token
  // One task per sequence, all heads at once, one cache block at a time: a block holds bs tokens'
  // K (or V) rows for every KV head as one contiguous run, streamed in from memory once and then
  // used by all query heads of each group from L1 (reading one KV head's slice per task instead
  // measured about 2x slower, memory bound on the strided rows).
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, inv_sum(H);  // p: [H, L] scores, then unnormalised probabilities
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const float* qb = qp + b * H * D;
      float* ob = op + b * H * D;
      p.resize(H * L);
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const float* kb = kp + table[t0 / bs] * bs * row;
        const int64_t n = std::min(bs, L - t0);
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qb + h * D;
          const float* kh = kb + (h / G) * D;
          float* ph = p.data() + h * L + t0;
          for (int64_t j = 0; j < n; ++j) {
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < D; ++i) acc += qh[i] * kh[j * row + i];
            ph[j] = acc * fscale;
          }
        }
      }
      // Stable softmax: subtract the row max before exp; normalise the output once at the end.
      std::fill(ob, ob + H * D, 0.f);
      for (int64_t h = 0; h < H; ++h) {
        float* ph = p.data() + h * L;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < L; ++t) mx = std::max(mx, ph[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) {
          ph[t] = exp_approx(ph[t] - mx);
          sum += ph[t];
        }
        inv_sum[h] = 1.f / sum;
      }
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const float* vb = vp + table[t0 / bs] * bs * row;
        const int64_t n = std::min(bs, L - t0);
        for (int64_t h = 0; h < H; ++h) {
          const float* ph = p.data() + h * L + t0;
          const float* vh = vb + (h / G) * D;
          float* oh = ob + h * D;
          // 16 output columns at a time, their accumulators held in registers across the
          // block's tokens (a fixed-size inner loop the compiler unrolls and vectorises).
          int64_t i0 = 0;
          for (; i0 + 16 <= D; i0 += 16) {
            float acc[16];
            for (int64_t i = 0; i < 16; ++i) acc[i] = oh[i0 + i];
            for (int64_t j = 0; j < n; ++j) {
              const float w = ph[j];
              const float* v = vh + j * row + i0;
#pragma omp simd
              for (int64_t i = 0; i < 16; ++i) acc[i] += w * v[i];
            }
            for (int64_t i = 0; i < 16; ++i) oh[i0 + i] = acc[i];
          }
          for (; i0 < D; ++i0)
            for (int64_t j = 0; j < n; ++j) oh[i0] += ph[j] * vh[j * row + i0];
        }
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D; ++i) ob[h * D + i] *= inv_sum[h];
    }
  });
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

  const int64_t* lp = lens;
  switch (D) {
    case 64: paged_decode_impl<64>(qp, kp, vp, op, tables, lp, B, H, D, KVH, bs, max_blocks, fscale); break;
    case 128: paged_decode_impl<128>(qp, kp, vp, op, tables, lp, B, H, D, KVH, bs, max_blocks, fscale); break;
    default: paged_decode_impl<0>(qp, kp, vp, op, tables, lp, B, H, D, KVH, bs, max_blocks, fscale);
  }
  return out;
}


static void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              name, ": expected a float32 [rows, cols] tensor with contiguous rows");
}

// out = weight * (x / rms(x)); with a residual, x + residual is normalised and also written back
// into residual (the stream the next sub-layer adds to).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> residual, double eps) {
  check_rows(x, "rms_norm");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == H && weight.scalar_type() == at::kFloat);
  float* rp = nullptr;
  int64_t rstride = 0;
  if (residual) {
    check_rows(*residual, "rms_norm residual");
    TORCH_CHECK(residual->size(0) == T && residual->size(1) == H);
    rp = residual->data_ptr<float>();
    rstride = residual->stride(0);
  }
  auto out = torch::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xstride = x.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * xstride;
      float* o = op + t * H;
      const float* src = xr;
      if (rp) {
        float* rr = rp + t * rstride;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) rr[i] += xr[i];
        src = rr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += src[i] * src[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = wp[i] * (src[i] * inv);
    }
  });
  return out;
}

// gate_up: [T, 2I] (gate then up) -> silu(gate) * up: [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "silu_and_mul: odd last dimension");
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * stride;
      const float* u = g + I;
      float* o = op + t * I;
      // Two passes over the (L1-resident) row: fused in one loop, the exp and division latencies
      // chain up and the loop ran 3x slower.
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = exp_approx(-g[i]);
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + o[i]) * u[i];
    }
  });
  return out;
}

// Rotates, in place, the first `num_heads` heads of each row of x ([T, >= num_heads * D], rows
// contiguous: the query and key heads at the front of a fused QKV output) by the rotate-half rule
// with the cos/sin tables ([max_positions, D], both halves equal).
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
             int64_t num_heads, int64_t head_dim) {
  check_rows(x, "rotary_");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.size(1) == head_dim && sin.sizes() == cos.sizes());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0));
  TORCH_CHECK(x.size(1) >= num_heads * head_dim && head_dim % 2 == 0);
  const int64_t T = x.size(0), half = head_dim / 2, stride = x.stride(0), max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_: position out of range");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * head_dim;
      const float* s = sp + pos[t] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* a = xp + t * stride + h * head_dim;
        float* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[half + i] + x1 * s[half + i];
        }
      }
    }
  });
}
