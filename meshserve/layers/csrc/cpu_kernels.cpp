// CPU kernels for the float32 and bfloat16 paths: the shared element conversions, and the fused
// element-wise steps around the matmuls (RMSNorm with the residual add, SiLU-and-multiply, rotary
// embedding). Each fused kernel reads and writes every element once where the PyTorch sequence of
// ops makes several passes over activations that no longer fit in cache during prefill.
// bfloat16 tensors are read into float32, computed in float32 and rounded once when stored.
// paged_decode.cpp (decode attention) and decoder_stack.cpp follow this file in one translation unit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

using bf16 = at::BFloat16;

// Conversions written as plain bit operations so that `omp simd` loops vectorise them (c10's
// own go through a NaN branch that kept the loops scalar: 3-7x slower element-wise kernels).
static inline float f32(float v) { return v; }
static inline float f32(bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T>
static inline T store(float v);
template <>
inline float store<float>(float v) { return v; }
template <>
inline bf16 store<bf16>(float v) {  // round to nearest even, as torch does; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = v != v ? 0x7FC00000u : bits + 0x7FFFu + ((bits >> 16) & 1u);
  bf16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}

// body(begin, end) over [0, n) in runs the threads take from a shared counter as they finish;
// run(begin, threads) is the length of the run that starts at begin. at::parallel_for splits a
// range once, in equal parts; on memory-bound work the cores finish theirs at different times
// (they share the memory bus unevenly, and with other machines' work) and the first one waits.
// One thread's share: runs taken from `next` until none of [0, n) is left.
template <typename Run, typename Body>
static void take_runs(std::atomic<int64_t>& next, int64_t n, int64_t threads, const Run& run, const Body& body) {
  for (int64_t begin = next.load(std::memory_order_relaxed); begin < n;) {
    const int64_t end = std::min(n, begin + std::max<int64_t>(1, run(begin, threads)));
    if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {  // else begin is reread
      body(begin, end);
      begin = next.load(std::memory_order_relaxed);
    }
  }
}

template <typename Run, typename Body>
static void parallel_runs(int64_t n, const Run& run, const Body& body) {
  const int64_t threads = at::get_num_threads();
  if (n <= 1 || threads == 1 || at::in_parallel_region()) {
    if (n > 0) body(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { take_runs(next, n, threads, run, body); });
}

// About eight equal chunks a thread, of at least `grain` items (decode attention: sequences; the
// row-wise kernels: rows). Fewer than two grains run on the calling thread, where at::parallel_for
// would also have made one task. Split once into halves, as at::parallel_for splits, the prompt
// steps' SiLU and RMSNorm left one thread waiting for the other: ~4% of a prompt step.
template <typename Body>
static void parallel_chunks(int64_t n, const Body& body, int64_t grain = 1) {
  if (n < 2 * grain) {
    if (n > 0) body(0, n);
    return;
  }
  parallel_runs(n, [n, grain](int64_t, int64_t threads) { return std::max(grain, n / (8 * threads)); }, body);
}

// Each run what is left divided by the threads: a thread's first run is long and contiguous, so a
// kernel that asks for the item after its current one asks for its own next item, and the last
// runs are single items, so neither thread waits long for the other. The weight panels measured
// 1.03-1.24x faster this way than in parallel_chunks' chunks (1 to 64 rows, both dtypes);
// decode attention measured no faster and keeps those.
static auto guided_runs(int64_t n) {
  return [n](int64_t begin, int64_t threads) { return (n - begin) / threads; };
}

template <typename Body>
static void parallel_guided(int64_t n, const Body& body) {
  parallel_runs(n, guided_runs(n), body);
}

// Calls body(T{}) with T the element type of x: float or bfloat16.
template <typename Body>
static void dispatch(const torch::Tensor& x, const char* name, Body&& body) {
  if (x.scalar_type() == at::kFloat) return body(float{});
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16 only");
  body(bf16{});
}

// exp_approx's constants, shared with its vector forms (exp_avx512 below, exp8 in
// prefill_attention.cpp): ln 2 split in two for precision, and exp(r)'s polynomial from its
// highest coefficient down (then r^2 times it, plus r, plus 1).
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for float32, written so that `omp simd` loops vectorise it: x = n ln2 + r with
// |r| <= ln2 / 2, then a degree-6 polynomial for exp(r) (max relative error ~2 ulp) scaled by 2^n.
static inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * kLn2Hi) + n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}


// The element-wise row loops are compiled twice: for the build's baseline (AVX2 where the CPU has
// it) and for AVX-512 with 512-bit vectors, chosen at run time (1.7x faster SiLU-and-multiply on
// a Sapphire Rapids core). The rest of the build keeps the baseline.
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,prefer-vector-width=512")))

static bool avx512_allowed = true;

static bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has && avx512_allowed;
}

static bool cpu_is_intel() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// Lets the tests run the baseline paths on a CPU with AVX-512; returns the previous setting.
bool allow_avx512(bool allowed) {
  const bool previous = avx512_allowed;
  avx512_allowed = allowed;
  return previous;
}

static void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2 &&
                  x.stride(1) == 1,
              name, ": expected a float32 or bfloat16 [rows, cols] tensor with contiguous rows");
}

// One row of rms_norm (rr: the residual row, or null).
template <typename T>
__attribute__((always_inline)) static inline void rms_norm_row(const T* xr, const T* wp, T* rr, T* o, int64_t H,
                                                               float eps) {
  const T* src = xr;
  if (rr) {
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) rr[i] = store<T>(f32(rr[i]) + f32(xr[i]));
    src = rr;
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += f32(src[i]) * f32(src[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) o[i] = store<T>(f32(wp[i]) * f32(store<T>(f32(src[i]) * inv)));
}

template <typename T>
AVX512 static void rms_norm_row_avx512(const T* xr, const T* wp, T* rr, T* o, int64_t H, float eps) {
  rms_norm_row(xr, wp, rr, o, H, eps);
}

// Rows begin..end of rms_norm (rp: the residual, or null; out's rows H values apart).
template <typename T>
static void rms_norm_rows(const T* xp, int64_t xstride, const T* wp, T* rp, int64_t rstride, T* op, int64_t begin,
                          int64_t end, int64_t H, double eps) {
  const bool wide = cpu_has_avx512();
  const float feps = static_cast<float>(eps);
  for (int64_t t = begin; t < end; ++t) {
    T* rr = rp ? rp + t * rstride : nullptr;
    if (wide) rms_norm_row_avx512(xp + t * xstride, wp, rr, op + t * H, H, feps);
    else rms_norm_row(xp + t * xstride, wp, rr, op + t * H, H, feps);
  }
}

// out = weight * (x / rms(x)); with a residual, x + residual is normalised and also written back
// into residual (the stream the next sub-layer adds to). In bfloat16 the roundings are those of
// the usual formula: the sum is stored, x / rms(x) is rounded before the weight multiplies it.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> residual, double eps) {
  check_rows(x, "rms_norm");
  const int64_t T_ = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == H && weight.scalar_type() == x.scalar_type());
  int64_t rstride = 0;
  if (residual) {
    check_rows(*residual, "rms_norm residual");
    TORCH_CHECK(residual->size(0) == T_ && residual->size(1) == H && residual->scalar_type() == x.scalar_type());
    rstride = residual->stride(0);
  }
  auto out = torch::empty({T_, H}, x.options());
  const int64_t xstride = x.stride(0);
  dispatch(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T* rp = residual ? residual->data_ptr<T>() : nullptr;
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    parallel_chunks(T_, [&](int64_t begin, int64_t end) {
      rms_norm_rows(xp, xstride, wp, rp, rstride, op, begin, end, H, eps);
    }, 16);
  });
  return out;
}

// One row of silu_and_mul; e: I floats of scratch.
template <typename T>
__attribute__((always_inline)) static inline void silu_and_mul_row(const T* g, const T* u, T* o, float* e, int64_t I) {
  // Two passes over the (L1-resident) row: fused in one loop, the exp and division latencies
  // chain up and the loop ran 3x slower.
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) e[i] = exp_approx(-f32(g[i]));
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) o[i] = store<T>(f32(g[i]) / (1.f + e[i]) * f32(u[i]));
}

AVX512 static void silu_and_mul_row_avx512(const float* g, const float* u, float* o, float* e, int64_t I) {
  silu_and_mul_row(g, u, o, e, I);
}

// exp_approx on 16 lanes: the same clamp, range reduction and polynomial; 2^n applied by vscalefps.
AVX512 static inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

AVX512 static inline __m512 load_bf16x16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// store<bf16> on 16 lanes: round to nearest even, NaN stays NaN.
AVX512 static inline void store_bf16x16(bf16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

// silu_and_mul_row for bfloat16 in one pass: the widening, the exponential and the rounding as
// vector instructions, where the compiler's loops above take two passes through e.
AVX512 static void silu_and_mul_row_avx512(const bf16* g, const bf16* u, bf16* o, float* e, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) {
    const __m512 gv = load_bf16x16(g + i);
    const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(zero, gv))));
    store_bf16x16(o + i, _mm512_mul_ps(silu, load_bf16x16(u + i)));
  }
  if (i < I) silu_and_mul_row(g + i, u + i, o + i, e, I - i);
}

// Rows begin..end of silu_and_mul (gate_up rows `stride` values apart, out's I).
template <typename T>
static void silu_and_mul_rows(const T* gp, int64_t stride, T* op, int64_t begin, int64_t end, int64_t I) {
  const bool wide = cpu_has_avx512();
  thread_local std::vector<float> e;
  e.resize(I);
  for (int64_t t = begin; t < end; ++t) {
    const T* g = gp + t * stride;
    if (wide) silu_and_mul_row_avx512(g, g + I, op + t * I, e.data(), I);
    else silu_and_mul_row(g, g + I, op + t * I, e.data(), I);
  }
}

// gate_up: [T, 2I] (gate then up) -> silu(gate) * up: [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t T_ = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "silu_and_mul: odd last dimension");
  auto out = torch::empty({T_, I}, gate_up.options());
  const int64_t stride = gate_up.stride(0);
  dispatch(gate_up, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    parallel_chunks(T_, [&](int64_t begin, int64_t end) { silu_and_mul_rows(gp, stride, op, begin, end, I); }, 4);
  });
  return out;
}

// rotary_ of one row, c and s its position's rows of the tables.
template <typename T>
static inline void rotary_row(T* row, const float* c, const float* s, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    T* a = row + h * head_dim;
    T* b = a + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = f32(a[i]), x2 = f32(b[i]);
      a[i] = store<T>(x1 * c[i] - x2 * s[i]);
      b[i] = store<T>(x2 * c[half + i] + x1 * s[half + i]);
    }
  }
}

// Rotates, in place, the first `num_heads` heads of each row of x ([T, >= num_heads * D], rows
// contiguous: the query and key heads at the front of a fused QKV output) by the rotate-half rule
// with the float32 cos/sin tables ([max_positions, D], both halves equal).
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
             int64_t num_heads, int64_t head_dim) {
  check_rows(x, "rotary_");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.size(1) == head_dim && sin.sizes() == cos.sizes());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0));
  TORCH_CHECK(x.size(1) >= num_heads * head_dim && head_dim % 2 == 0);
  const int64_t T_ = x.size(0), stride = x.stride(0), max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_: position out of range");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  dispatch(x, "rotary_", [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    parallel_chunks(T_, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        rotary_row(xp + t * stride, cp + pos[t] * head_dim, sp + pos[t] * head_dim, num_heads, head_dim);
    }, 16);
  });
}

// The position of a row's first NaN (the row has one): what torch.argmax returns for it.
template <typename T>
static int64_t first_nan(const T* row) {
  int64_t i = 0;
  while (f32(row[i]) == f32(row[i])) ++i;
  return i;
}

// One step of a running argmax in 16 lanes: each lane keeps the largest value it has seen and where
// it first saw it (an equal value later leaves both); nan collects the lanes that saw a NaN.
AVX512 static inline void lane_argmax_step(__m512 v, __m512i pos, __m512& best, __m512i& where, __mmask16& nan) {
  nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __mmask16 above = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
  best = _mm512_mask_mov_ps(best, above, v);
  where = _mm512_mask_mov_epi32(where, above, pos);
}

// The answer of lanes that saw no NaN: the smallest position among those holding the largest value.
AVX512 static inline int64_t lane_argmax_result(__m512 best, __m512i where) {
  const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_max, where);
}

// One row's index of its largest value in one pass (lane_argmax_step, lane_argmax_result). A NaN
// sends the row to a scan for its first NaN (torch.argmax returns that). The two-pass loop below
// reads the row twice, the second time one value at a time up to the maximum: half a row on
// average, ~2/3 of its time.
template <typename T>
AVX512 static int64_t argmax_row_avx512(const T* row, int64_t V) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = lowest;
  __m512i where = _mm512_setzero_si512(), pos = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < V; i += 16, pos = _mm512_add_epi32(pos, step)) {
    const __mmask16 live = V - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1);
    __m512 v;
    if constexpr (std::is_same_v<T, float>) {
      v = _mm512_mask_loadu_ps(lowest, live, row + i);
    } else {
      const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, row + i)), 16);
      v = _mm512_mask_mov_ps(lowest, live, _mm512_castsi512_ps(wide));
    }
    lane_argmax_step(v, pos, best, where, nan);
  }
  return nan ? first_nan(row) : lane_argmax_result(best, where);
}

// Per row of x [rows, V], the index of its largest value, as torch.argmax: the first of equal
// maxima, and the first NaN where a row has one. torch's reduction keeps an index with every
// comparison (4.7 ms for 64 x 49152 logits here); this finds the maximum with a vectorised
// reduction and then its first position (in one pass on AVX-512: argmax_row_avx512).
torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x, "argmax_rows");
  const int64_t R = x.size(0), V = x.size(1), stride = x.stride(0);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "argmax_rows: rows of 1 to 2^31 - 1 values");
  auto out = torch::empty({R}, x.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  dispatch(x, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const bool wide = cpu_has_avx512();
    parallel_chunks(R, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = xp + r * stride;
        if (wide) {
          op[r] = argmax_row_avx512(row, V);
          continue;
        }
        float mx = -std::numeric_limits<float>::infinity();
        int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
        for (int64_t i = 0; i < V; ++i) {
          const float v = f32(row[i]);
          mx = v > mx ? v : mx;
          nan |= v != v;
        }
        if (nan) {
          op[r] = first_nan(row);
          continue;
        }
        int64_t i = 0;
        while (f32(row[i]) != mx) ++i;
        op[r] = i;
      }
    });
  });
  return out;
}
