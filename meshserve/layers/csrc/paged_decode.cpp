// Decode attention reading K/V straight from the paged cache (after cpu_kernels.cpp in one
// translation unit). One task is one sequence: each cached token's K/V row (all KV heads) is read
// once, as one contiguous run, and serves every query head of its group.
#include <immintrin.h>

// n elements of a cache block as float32: float32 blocks are read in place, bfloat16 blocks are
// converted once into `scratch` so that every query head of a group reads floats.
static inline const float* as_float(const float* src, float*, int64_t) { return src; }
static inline const float* as_float(const bf16* src, float* scratch, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) scratch[i] = f32(src[i]);
  return scratch;
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight keys' dot products with one query at once (keys `row` floats apart): eight independent
// chains of FMAs, then one transposing reduction for all eight sums, where a dot product at a time
// waits on its own chain and reduces its vector alone. Only the first `count` (1-8) keys exist:
// the others re-read the last one, so the loads stay inside the block, and are not stored.
static inline void dot8(const float* q, const float* k, int64_t row, int64_t D, float scale, float* out,
                        int64_t count) {
  const float* kt[8];
  for (int64_t t = 0; t < 8; ++t) kt[t] = k + std::min(t, count - 1) * row;
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt[t] + i), a[t]);
  }
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
  alignas(32) float res[8];
  if (i < D) {  // a head size that is not a multiple of 8
    for (int t = 0; t < 8; ++t) {
      res[t] = 0.f;
      for (int64_t r = i; r < D; ++r) res[t] += q[r] * kt[t][r];
    }
    sum = _mm256_add_ps(sum, _mm256_load_ps(res));
  }
  sum = _mm256_mul_ps(sum, _mm256_set1_ps(scale));
  if (count == 8) return _mm256_storeu_ps(out, sum);
  _mm256_store_ps(res, sum);
  for (int64_t t = 0; t < count; ++t) out[t] = res[t];
}

// o[0:64) += sum over j < n of w[j] * v[j * row + (0:64)]: the 64 accumulators stay in eight
// registers across the tokens, so every token's eight FMAs are independent of each other.
static inline void weighted_rows64(float* o, const float* w, const float* v, int64_t row, int64_t n) {
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_loadu_ps(o + 8 * t);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 wj = _mm256_set1_ps(w[j]);
    for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + j * row + 8 * t), a[t]);
  }
  for (int t = 0; t < 8; ++t) _mm256_storeu_ps(o + 8 * t, a[t]);
}
#endif

// While the block holding token t0 is computed on, asks for the next block's rows (the first
// `width` elements of each: all KV heads, or one head's slice): blocks are scattered, so the
// hardware prefetcher, which follows addresses within a page, cannot see it coming.
template <typename T>
static inline void prefetch_next_block(const T* cache, const int64_t* table, int64_t t0, int64_t L, int64_t bs,
                                       int64_t row, int64_t width) {
  if (t0 + bs >= L) return;
  const char* next = reinterpret_cast<const char*>(cache + table[t0 / bs + 1] * bs * row);
  const int64_t bytes = width * static_cast<int64_t>(sizeof(T)), stride = row * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < std::min(bs, L - t0 - bs); ++j)
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + j * stride + off);
}

// Rows of scores [H, L] -> unnormalised probabilities, stably (the row maximum subtracted before
// exp); inv_sum[h]: 1 / row h's sum, applied to the output once at the end.
static inline void softmax_rows(float* p, int64_t H, int64_t L, float* inv_sum) {
  for (int64_t h = 0; h < H; ++h) {
    float* ph = p + h * L;
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < L; ++t) mx = ph[t] > mx ? ph[t] : mx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      ph[t] = exp_approx(ph[t] - mx);
      sum += ph[t];
    }
    inv_sum[h] = 1.f / sum;
  }
}

// The decode attention proper; HD > 0 fixes the head size at compile time (fully unrolled inner
// loops for the common sizes), HD == 0 takes it at run time.
template <int64_t HD, typename T>
static void paged_decode_impl(const T* qp, const T* kp, const T* vp, T* op, const int64_t* tables,
                              const int64_t* lens, int64_t B, int64_t H, int64_t D_rt, int64_t KVH, int64_t bs,
                              int64_t max_blocks, float fscale) {
  const int64_t D = HD > 0 ? HD : D_rt;
  const int64_t G = H / KVH, row = KVH * D;  // query heads per KV head; floats per cached token
  // One task per sequence, all heads at once, one cache block at a time: a block holds bs tokens'
  // K (or V) rows for every KV head as one contiguous run, streamed in from memory once and then
  // used by all query heads of each group from L1 (reading one KV head's slice per task instead
  // measured about 2x slower, memory bound on the strided rows).
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    // p: [H, L] scores, then unnormalised probabilities; qb, ob: this sequence's query and output
    std::vector<float> p, inv_sum(H), qb(H * D), ob(H * D), scratch(bs * row);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t i = 0; i < H * D; ++i) qb[i] = f32(qp[b * H * D + i]);
      p.resize(H * L);
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const int64_t n = std::min(bs, L - t0);
        prefetch_next_block(kp, table, t0, L, bs, row, row);
        const float* kb = as_float(kp + table[t0 / bs] * bs * row, scratch.data(), n * row);
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qb.data() + h * D;
          const float* kh = kb + (h / G) * D;
          float* ph = p.data() + h * L + t0;
          int64_t j0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
          for (; j0 + 8 <= n; j0 += 8) dot8(qh, kh + j0 * row, row, D, fscale, ph + j0, 8);
          if (j0 < n) dot8(qh, kh + j0 * row, row, D, fscale, ph + j0, n - j0);
          j0 = n;
#endif
          for (int64_t j = j0; j < n; ++j) {
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < D; ++i) acc += qh[i] * kh[j * row + i];
            ph[j] = acc * fscale;
          }
        }
      }
      softmax_rows(p.data(), H, L, inv_sum.data());
      std::fill(ob.begin(), ob.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const int64_t n = std::min(bs, L - t0);
        prefetch_next_block(vp, table, t0, L, bs, row, row);
        const float* vb = as_float(vp + table[t0 / bs] * bs * row, scratch.data(), n * row);
        for (int64_t h = 0; h < H; ++h) {
          const float* ph = p.data() + h * L + t0;
          const float* vh = vb + (h / G) * D;
          float* oh = ob.data() + h * D;
          int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
          for (; i0 + 64 <= D; i0 += 64) weighted_rows64(oh + i0, ph, vh + i0, row, n);
#endif
          // 16 output columns at a time, their accumulators held in registers across the
          // block's tokens (a fixed-size inner loop the compiler unrolls and vectorises).
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
      T* out = op + b * H * D;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D; ++i) out[h * D + i] = store<T>(ob[h * D + i] * inv_sum[h]);
    }
  });
}

// ---- bfloat16 on CPUs with AVX512-BF16 -------------------------------------------------------------
// The cache is read as stored: VDPBF16PS multiplies pairs of bfloat16 query and key elements and
// adds them into float32 lanes, 32 elements an instruction and no conversion pass. The product of
// two bfloat16 values is exact in float32, so the scores are the float32 dot products summed in
// another order. Values are widened to float32 in registers; probabilities stay float32. Compiled
// for these instructions alone and chosen at run time, as the element-wise rows (cpu_kernels.cpp).
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

// Lane j of the result is the sum of a[j]'s sixteen lanes (a transposing tree of adds: 45 shuffles
// and adds for sixteen sums where one vector at a time would take 16 x 8).
AVX512_BF16 static inline __m512 lane_sums16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a[2i], a[2i+1], a[2i], a[2i+1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: a[4i] .. a[4i+3]
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: a[8i..8i+3] twice, a[8i+4..8i+7] twice
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// Scores of one query head (NC2 x 32 elements) against up to 16 keys `row` elements apart; keys
// past `count` re-read the last one and are not stored.
template <int NC2>
AVX512_BF16 static inline void scores16(const bf16* q, const bf16* k, int64_t row, int64_t count, float scale,
                                        float* out) {
  __m512bh qv[NC2];
  for (int c = 0; c < NC2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  __m512 a[16];
  for (int64_t t = 0; t < 16; ++t) {
    const bf16* kt = k + std::min(t, count - 1) * row;
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < NC2; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(kt + 32 * c));
    a[t] = acc;
  }
  const __m512 s = _mm512_mul_ps(lane_sums16(a), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << count) - 1u), s);
}

// o[h] (HB heads, NC x 16 floats each) = sum over the sequence's tokens t of p[h * L + t] * V[t]:
// each V row is widened once and serves the HB heads, whose accumulators stay in registers.
template <int NC, int HB>
AVX512_BF16 static void weighted_values(const float* p, int64_t L, const bf16* vp, const int64_t* table, int64_t bs,
                                        int64_t row, float* o) {
  constexpr int64_t D = 16 * NC;
  __m512 acc[HB][NC];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min(bs, L - t0);
    prefetch_next_block(vp, table, t0, L, bs, row, D);  // this KV head's slice
    const bf16* vb = vp + table[t0 / bs] * bs * row;
    for (int64_t j = 0; j < n; ++j) {
      __m512 v[NC];
      for (int c = 0; c < NC; ++c)
        v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + j * row + 16 * c))), 16));
      for (int h = 0; h < HB; ++h) {
        const __m512 w = _mm512_set1_ps(p[h * L + t0 + j]);
        for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
      }
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + h * D + 16 * c, acc[h][c]);
}

// Up to 16 / NC heads of one group at a time: their accumulators fill at most half the registers.
template <int NC>
AVX512_BF16 static void weighted_values_heads(int64_t heads, const float* p, int64_t L, const bf16* vp,
                                              const int64_t* table, int64_t bs, int64_t row, float* o) {
  constexpr int64_t HB = 16 / NC, D = 16 * NC;
  for (int64_t h = 0; h < heads; h += HB) {
    const float* ph = p + h * L;
    float* oh = o + h * D;
    switch (std::min(HB, heads - h)) {
      case 1: weighted_values<NC, 1>(ph, L, vp, table, bs, row, oh); break;
      case 2: weighted_values<NC, 2>(ph, L, vp, table, bs, row, oh); break;
      case 3: if constexpr (HB >= 3) weighted_values<NC, 3>(ph, L, vp, table, bs, row, oh); break;
      default: if constexpr (HB >= 4) weighted_values<NC, 4>(ph, L, vp, table, bs, row, oh); break;
    }
  }
}

// One sequence (a task of paged_decode's parallel loop); p and ob are the task's scratch.
template <int NC2>
AVX512_BF16 static void decode_sequence_bf16(const bf16* q, const bf16* kp, const bf16* vp, bf16* out,
                                             const int64_t* table, int64_t L, int64_t H, int64_t KVH, int64_t bs,
                                             float scale, std::vector<float>& p, std::vector<float>& ob) {
  constexpr int64_t D = 32 * NC2;
  const int64_t G = H / KVH, row = KVH * D;
  p.resize(H * L);
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min(bs, L - t0);
    prefetch_next_block(kp, table, t0, L, bs, row, row);
    const bf16* kb = kp + table[t0 / bs] * bs * row;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < n; j += 16)
        scores16<NC2>(q + h * D, kb + (h / G) * D + j * row, row, std::min<int64_t>(16, n - j), scale,
                      p.data() + h * L + t0 + j);
  }
  std::vector<float> inv_sum(H);
  softmax_rows(p.data(), H, L, inv_sum.data());
  for (int64_t g = 0; g < KVH; ++g)
    weighted_values_heads<2 * NC2>(G, p.data() + g * G * L, L, vp + g * D, table, bs, row, ob.data() + g * G * D);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < D; ++i) out[h * D + i] = store<bf16>(ob[h * D + i] * inv_sum[h]);
}

template <int NC2>
static void paged_decode_bf16(const bf16* qp, const bf16* kp, const bf16* vp, bf16* op, const int64_t* tables,
                              const int64_t* lens, int64_t B, int64_t H, int64_t KVH, int64_t bs, int64_t max_blocks,
                              float scale) {
  constexpr int64_t D = 32 * NC2;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, ob(H * D);
    for (int64_t b = begin; b < end; ++b)
      decode_sequence_bf16<NC2>(qp + b * H * D, kp, vp, op + b * H * D, tables + b * max_blocks, lens[b], H, KVH, bs,
                                scale, p, ob);
  });
}

static bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has && cpu_has_avx512();
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode: the query and the caches must have one dtype");
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
  const float fscale = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16 && (D == 64 || D == 128) && cpu_has_avx512_bf16()) {
    const bf16* qp = q.data_ptr<bf16>();
    const bf16* kp = k_cache.data_ptr<bf16>();
    const bf16* vp = v_cache.data_ptr<bf16>();
    bf16* op = out.data_ptr<bf16>();
    if (D == 64) paged_decode_bf16<2>(qp, kp, vp, op, tables, lens, B, H, KVH, bs, max_blocks, fscale);
    else paged_decode_bf16<4>(qp, kp, vp, op, tables, lens, B, H, KVH, bs, max_blocks, fscale);
    return out;
  }
  dispatch(q, "paged_decode", [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.data_ptr<T>();
    const T* kp = k_cache.data_ptr<T>();
    const T* vp = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    switch (D) {
      case 64: paged_decode_impl<64>(qp, kp, vp, op, tables, lens, B, H, D, KVH, bs, max_blocks, fscale); break;
      case 128: paged_decode_impl<128>(qp, kp, vp, op, tables, lens, B, H, D, KVH, bs, max_blocks, fscale); break;
      default: paged_decode_impl<0>(qp, kp, vp, op, tables, lens, B, H, D, KVH, bs, max_blocks, fscale);
    }
  });
  return out;
}

