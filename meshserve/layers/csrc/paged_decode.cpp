// Decode attention reading K/V straight from the paged cache (after cpu_kernels.cpp in one
// translation unit). One task is one sequence: each cached token's K/V row (all KV heads) is read
// once, as one contiguous run, and serves every query head of its group.
//
// The cache holds the query's dtype, or fp8 (--kv-cache-dtype: float8_e4m3fn or float8_e5m2, one
// byte a value), read as stored: each byte widened to float32 in registers, as a float16 bit
// pattern that VCVTPH2PS converts (e5m2 is the top byte of a float16; e4m3's exponent and
// mantissa bits move into float16's, which leaves the value 2^8 too small: the biases are 7 and
// 15). A layer's k_scale multiplies into the score scale and its v_scale into the output.
#include <immintrin.h>
#include <type_traits>

using fp8e4m3 = c10::Float8_e4m3fn;
using fp8e5m2 = c10::Float8_e5m2;
template <typename C>
constexpr bool is_fp8 = std::is_same_v<C, fp8e4m3> || std::is_same_v<C, fp8e5m2>;

// One cached value as float32, for the loops' remainders (the vector paths use load8 / load16).
static inline float widen(float v) { return v; }
static inline float widen(fp8e4m3 v) { return static_cast<float>(v); }
static inline float widen(fp8e5m2 v) { return static_cast<float>(v); }

// The n tokens of a cache block as the loops read them (`row` elements a token, of which they read
// columns [c0, c1): the KV heads being computed on): float32 and fp8 blocks in place (fp8 widened
// as it is read), bfloat16 columns converted once into `scratch` (at the same offsets) so that
// every query head of a group reads floats.
static inline const float* block_values(const float* src, float*, int64_t, int64_t, int64_t, int64_t) { return src; }
static inline const float* block_values(const bf16* src, float* scratch, int64_t n, int64_t row, int64_t c0,
                                        int64_t c1) {
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t i = j * row + c0; i < j * row + c1; ++i) scratch[i] = f32(src[i]);
  }
  return scratch;
}
template <typename C, std::enable_if_t<is_fp8<C>, int> = 0>
static inline const C* block_values(const C* src, float*, int64_t, int64_t, int64_t, int64_t) { return src; }

#if defined(__AVX2__) && defined(__FMA__)
// Eight consecutive cached values as float32.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#if defined(__F16C__)
static inline __m128i bytes8_as_u16(const void* p) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 load8(const fp8e5m2* p) { return _mm256_cvtph_ps(_mm_slli_epi16(bytes8_as_u16(p), 8)); }
static inline __m256 load8(const fp8e4m3* p) {
  const __m128i b = bytes8_as_u16(p);
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
#else  // no F16C in the build: fp8 values widened one at a time
template <typename C, std::enable_if_t<is_fp8<C>, int> = 0>
static inline __m256 load8(const C* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = widen(p[i]);
  return _mm256_load_ps(f);
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Eight keys' dot products with one query at once (keys `row` values apart): eight independent
// chains of FMAs, then one transposing reduction for all eight sums, where a dot product at a time
// waits on its own chain and reduces its vector alone. Only the first `count` (1-8) keys exist:
// the others re-read the last one, so the loads stay inside the block, and are not stored.
template <typename K>
static inline void dot8(const float* q, const K* k, int64_t row, int64_t D, float scale, float* out,
                        int64_t count) {
  const K* kt[8];
  for (int64_t t = 0; t < 8; ++t) kt[t] = k + std::min(t, count - 1) * row;
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, load8(kt[t] + i), a[t]);
  }
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
  alignas(32) float res[8];
  if (i < D) {  // a head size that is not a multiple of 8
    for (int t = 0; t < 8; ++t) {
      res[t] = 0.f;
      for (int64_t r = i; r < D; ++r) res[t] += q[r] * widen(kt[t][r]);
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
template <typename V>
static inline void weighted_rows64(float* o, const float* w, const V* v, int64_t row, int64_t n) {
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_loadu_ps(o + 8 * t);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 wj = _mm256_set1_ps(w[j]);
    for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(wj, load8(v + j * row + 8 * t), a[t]);
  }
  for (int t = 0; t < 8; ++t) _mm256_storeu_ps(o + 8 * t, a[t]);
}
#endif

// Asks for the cache line at p to be brought into L2 (PREFETCHT1). Not into L1: a prefetch there
// holds one of the core's few L1 miss buffers until its line arrives, and the loads of the block
// being computed on need them (measured no faster than no prefetch at all). Inline assembly,
// because GCC deleted the loop below, which does nothing else, when it called __builtin_prefetch.
static inline void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// While the block holding token t0 is computed on, asks for the next block's rows (the first
// `width` elements of each: all KV heads, or one head's slice): blocks are scattered, so the
// hardware prefetcher, which follows addresses within a page, cannot see it coming. On a 2-core
// Zen 4 (AVX2 path) this made decode attention 1.25x faster (benchmarks/decode_attention.py, 64
// sequences of 320 tokens: 12.4 -> 15.4 GB/s); two or more blocks ahead measured no better.
// Part `part` of `parts` asks for that share of the rows only: called once per query head, the
// requests spread over the block's work instead of arriving as one burst of a block's lines, more
// than the L2 can have in flight (1.4x faster again on the AVX2 path, same benchmark). The AVX-512
// paths spread them too, per query head over the keys and per token over the values: on a 2-core
// Xeon with AMX a block's burst stalled the core until it drained, and spread they made decode
// attention 1.15-1.37x faster in bfloat16 and 1.17-1.36x in float32 (to 21.5 GB/s, the bandwidth).
// At the last block, `after` (`after_rows` rows) is what the kernel reads next: the first V block
// after the last K block, the next sequence's first K block after the last V block (1.03x on the
// benchmark's 320 tokens, 1.13x on 16 sequences of 100, where such ends are more of the blocks).
template <typename T>
static inline void prefetch_next_block(const T* cache, const int64_t* table, int64_t t0, int64_t L, int64_t bs,
                                       int64_t row, int64_t width, int64_t part = 0, int64_t parts = 1,
                                       const T* after = nullptr, int64_t after_rows = 0) {
  const char* next;
  int64_t rows;
  if (t0 + bs >= L) {
    if (after == nullptr) return;
    next = reinterpret_cast<const char*>(after);
    rows = after_rows;
  } else {
    next = reinterpret_cast<const char*>(cache + table[t0 / bs + 1] * bs * row);
    rows = std::min(bs, L - t0 - bs);
  }
  const int64_t bytes = width * static_cast<int64_t>(sizeof(T)), stride = row * static_cast<int64_t>(sizeof(T));
  for (int64_t j = part * rows / parts; j < (part + 1) * rows / parts; ++j)
    for (int64_t off = 0; off < bytes; off += 64) prefetch_l2(next + j * stride + off);
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

// The decode attention proper, of sequences [begin, end) and the query heads of KV heads [g0, g1),
// on the calling thread; HD > 0 fixes the head size at compile time (fully unrolled inner loops
// for the common sizes), HD == 0 takes it at run time. C: the cache's element type (T, or fp8);
// fscale multiplies the scores (k_scale included), vscale the output. A head's output depends on
// its query and its KV head only, so a split of the heads computes the same bits.
template <int64_t HD, typename T, typename C>
static void decode_rows_impl(const T* qp, const C* kp, const C* vp, T* op, const int64_t* tables,
                             const int64_t* lens, int64_t begin, int64_t end, int64_t g0, int64_t g1, int64_t H,
                             int64_t D_rt, int64_t KVH, int64_t bs, int64_t max_blocks, float fscale, float vscale) {
  const int64_t D = HD > 0 ? HD : D_rt;
  const int64_t G = H / KVH, row = KVH * D;  // query heads per KV head; floats per cached token
  const int64_t h0 = g0 * G, h1 = g1 * G;
  // p: [H, L] scores, then unnormalised probabilities; qb, ob: this sequence's query and output
  std::vector<float> p, inv_sum(H), qb(H * D), ob(H * D), scratch(std::is_same_v<C, bf16> ? bs * row : 0);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t L = lens[b];
    const int64_t* table = tables + b * max_blocks;
    for (int64_t i = h0 * D; i < h1 * D; ++i) qb[i] = f32(qp[b * H * D + i]);
    p.resize(H * L);
    const C* first_v = vp + table[0] * bs * row;
    const C* next_k = b + 1 < end ? kp + tables[(b + 1) * max_blocks] * bs * row : nullptr;
    const int64_t next_k_rows = b + 1 < end ? std::min(bs, lens[b + 1]) : 0;
    for (int64_t t0 = 0; t0 < L; t0 += bs) {
      const int64_t n = std::min(bs, L - t0);
      const auto* kb = block_values(kp + table[t0 / bs] * bs * row, scratch.data(), n, row, g0 * D, g1 * D);
      for (int64_t h = h0; h < h1; ++h) {
        prefetch_next_block(kp, table, t0, L, bs, row, row, h, H, first_v, std::min(bs, L));
        const float* qh = qb.data() + h * D;
        const auto* kh = kb + (h / G) * D;
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
          for (int64_t i = 0; i < D; ++i) acc += qh[i] * widen(kh[j * row + i]);
          ph[j] = acc * fscale;
        }
      }
    }
    softmax_rows(p.data() + h0 * L, h1 - h0, L, inv_sum.data() + h0);
    std::fill(ob.begin() + h0 * D, ob.begin() + h1 * D, 0.f);
    for (int64_t t0 = 0; t0 < L; t0 += bs) {
      const int64_t n = std::min(bs, L - t0);
      const auto* vb = block_values(vp + table[t0 / bs] * bs * row, scratch.data(), n, row, g0 * D, g1 * D);
      for (int64_t h = h0; h < h1; ++h) {
        prefetch_next_block(vp, table, t0, L, bs, row, row, h, H, next_k, next_k_rows);
        const float* ph = p.data() + h * L + t0;
        const auto* vh = vb + (h / G) * D;
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
            const auto* v = vh + j * row + i0;
#pragma omp simd
            for (int64_t i = 0; i < 16; ++i) acc[i] += w * widen(v[i]);
          }
          for (int64_t i = 0; i < 16; ++i) oh[i0 + i] = acc[i];
        }
        for (; i0 < D; ++i0)
          for (int64_t j = 0; j < n; ++j) oh[i0] += ph[j] * widen(vh[j * row + i0]);
      }
    }
    T* out = op + b * H * D;
    for (int64_t h = h0; h < h1; ++h) {
      const float w = inv_sum[h] * vscale;
      for (int64_t i = 0; i < D; ++i) out[h * D + i] = store<T>(ob[h * D + i] * w);
    }
  }
}

// decode_rows_impl for the head size D.
template <typename T, typename C>
static void decode_rows(const T* qp, const C* kp, const C* vp, T* op, const int64_t* tables, const int64_t* lens,
                        int64_t begin, int64_t end, int64_t g0, int64_t g1, int64_t H, int64_t D, int64_t KVH,
                        int64_t bs, int64_t max_blocks, float fscale, float vscale) {
  switch (D) {
    case 64: return decode_rows_impl<64>(qp, kp, vp, op, tables, lens, begin, end, g0, g1, H, D, KVH, bs, max_blocks, fscale, vscale);
    case 128: return decode_rows_impl<128>(qp, kp, vp, op, tables, lens, begin, end, g0, g1, H, D, KVH, bs, max_blocks, fscale, vscale);
    default: return decode_rows_impl<0>(qp, kp, vp, op, tables, lens, begin, end, g0, g1, H, D, KVH, bs, max_blocks, fscale, vscale);
  }
}

// Whether paged_decode computes a query (and cache) of this dtype and head size with decode_rows
// rather than the AVX512-BF16 kernels below (decode_heads, for decoder_stack.cpp's one-region loop,
// takes part of a sequence's heads either way but on AMX). Float32 caches take
// decode_rows on AVX-512 CPUs too: on a Zen 4 it ran 1.01-1.16x the AVX-512 kernel's speed from 1 to
// 64 sequences (benchmarks/decode_attention.py), which now reads fp8 caches alone.
static bool decode_takes_rows(at::ScalarType dtype, int64_t D) {
  if (D != 64 && D != 128) return true;
  return dtype == at::kFloat || !cpu_has_avx512_bf16();
}

// ---- bfloat16 on CPUs with AVX512-BF16 -------------------------------------------------------------
// The cache is read as stored: VDPBF16PS multiplies pairs of bfloat16 query and key elements and
// adds them into float32 lanes, 32 elements an instruction and no conversion pass. The product of
// two bfloat16 values is exact in float32, so the scores are the float32 dot products summed in
// another order. Values are widened to float32 in registers; probabilities stay float32. Compiled
// for these instructions alone and chosen at run time, as the element-wise rows (cpu_kernels.cpp).
// What the parts that the float32 path shares take (a subset of the above: inlined into either).
#define AVX512_F32 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

// Lane j of the result is the sum of a[j]'s sixteen lanes (a transposing tree of adds: 45 shuffles
// and adds for sixteen sums where one vector at a time would take 16 x 8).
AVX512_F32 static inline __m512 lane_sums16(const __m512* a) {
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

// Sixteen consecutive cached values as float32 (float32, bfloat16 or fp8).
AVX512_F32 static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512_F32 static inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
AVX512_F32 static inline __m256i bytes16_as_u16(const void* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
AVX512_F32 static inline __m512 load16(const fp8e5m2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(bytes16_as_u16(p), 8));
}
AVX512_F32 static inline __m512 load16(const fp8e4m3* p) {
  const __m256i b = bytes16_as_u16(p);
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

// Where a sequence's probabilities are: query head h's for token t at head(h)[t * ts]. The vector
// paths keep rows [H][L] (per = H, hs = L, ts = 1); the AMX scores come as [L][16] tiles of `per`
// heads at a time, keys down and heads across (hs = 1, ts = 16, part = one tile column's values).
struct Probs {
  const float* p;
  int64_t per, part, hs, ts;
  const float* head(int64_t h) const { return p + (h / per) * part + (h % per) * hs; }
};

// o[h] (HB heads h0.., NC x 16 floats each) = sum over the sequence's tokens t of p(h, t) * V[t]:
// each V row is widened once and serves the HB heads, whose accumulators stay in registers.
template <int NC, int HB, typename V>
AVX512_F32 static void weighted_values(const Probs& pr, int64_t h0, int64_t L, const V* vp, const int64_t* table,
                                       int64_t bs, int64_t row, float* o, const V* after, int64_t after_rows) {
  constexpr int64_t D = 16 * NC;
  const float* p[HB];
  for (int h = 0; h < HB; ++h) p[h] = pr.head(h0 + h);
  const int64_t ts = pr.ts;
  __m512 acc[HB][NC];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min(bs, L - t0);
    const V* vb = vp + table[t0 / bs] * bs * row;
    for (int64_t j = 0; j < n; ++j) {
      prefetch_next_block(vp, table, t0, L, bs, row, D, j, n, after, after_rows);  // this KV head's slice
      __m512 v[NC];
      for (int c = 0; c < NC; ++c) v[c] = load16(vb + j * row + 16 * c);
      for (int h = 0; h < HB; ++h) {
        const __m512 w = _mm512_set1_ps(p[h][(t0 + j) * ts]);
        for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
      }
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + h * D + 16 * c, acc[h][c]);
}

// Up to 16 / NC heads of one group at a time: their accumulators fill at most half the registers.
// `after` (`after_rows` rows of D elements): what the caller reads once these heads are done.
template <int NC, typename V>
AVX512_F32 static void weighted_values_heads(int64_t heads, const Probs& pr, int64_t h0, int64_t L, const V* vp,
                                             const int64_t* table, int64_t bs, int64_t row, float* o,
                                             const V* after, int64_t after_rows) {
  constexpr int64_t HB = 16 / NC, D = 16 * NC;
  for (int64_t h = 0; h < heads; h += HB) {
    const int64_t ph = h0 + h;
    float* oh = o + h * D;
    // Another batch of heads reads this slice again from its first block.
    const bool last = h + HB >= heads;
    const V* next = last ? after : vp + table[0] * bs * row;
    const int64_t next_rows = last ? after_rows : std::min(bs, L);
    switch (std::min(HB, heads - h)) {
      case 1: weighted_values<NC, 1>(pr, ph, L, vp, table, bs, row, oh, next, next_rows); break;
      case 2: if constexpr (HB >= 2) weighted_values<NC, 2>(pr, ph, L, vp, table, bs, row, oh, next, next_rows); break;
      case 3: if constexpr (HB >= 3) weighted_values<NC, 3>(pr, ph, L, vp, table, bs, row, oh, next, next_rows); break;
      default: if constexpr (HB >= 4) weighted_values<NC, 4>(pr, ph, L, vp, table, bs, row, oh, next, next_rows); break;
    }
  }
}

// o (H = KVH x G heads, NC x 16 floats each) as weighted_values_heads computes it, for KV heads
// [g0, g1) at once when a KV head's G query heads fit in one batch of registers: the blocks in
// order, each block's rows read for those KV heads before the next (one pass over V, each block
// one contiguous run), the G heads' sums of one KV head in registers while its slice of the block
// is read, in `o` between blocks. The sums run over the tokens in the same order: the same results.
template <int NC, int G, typename V>
AVX512_F32 static void weighted_values_blocks(const Probs& pr, int64_t L, const V* vp, const int64_t* table, int64_t bs,
                                              int64_t KVH, int64_t g0, int64_t g1, float* o) {
  constexpr int64_t D = 16 * NC;
  const int64_t row = KVH * D, ts = pr.ts;
  std::fill(o + g0 * G * D, o + g1 * G * D, 0.f);
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min(bs, L - t0);
    const V* vb = vp + table[t0 / bs] * bs * row;
    for (int64_t g = g0; g < g1; ++g) {
      float* og = o + g * G * D;
      const float* pg[G];
      for (int h = 0; h < G; ++h) pg[h] = pr.head(g * G + h) + t0 * ts;
      __m512 acc[G][NC];
      for (int h = 0; h < G; ++h)
        for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_loadu_ps(og + h * D + 16 * c);
      for (int64_t j = 0; j < n; ++j) {
        prefetch_next_block(vp, table, t0, L, bs, row, row, (g - g0) * n + j, (g1 - g0) * n);  // the next block, spread
        __m512 v[NC];
        for (int c = 0; c < NC; ++c) v[c] = load16(vb + j * row + g * D + 16 * c);
        for (int h = 0; h < G; ++h) {
          const __m512 w = _mm512_set1_ps(pg[h][j * ts]);
          for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
        }
      }
      for (int h = 0; h < G; ++h)
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(og + h * D + 16 * c, acc[h][c]);
    }
  }
}

// The o of KV heads [g0, g1)'s query heads: one pass over V where a KV head's query heads fit in
// registers together (G <= 4 for 64-value heads, 2 for 128), else one pass per KV head. On a
// bfloat16 cache the one pass was 1.09-1.26x faster (decode_attention.py, 64 sequences of 320
// tokens, three rounds taking turns on a 2-core Xeon with AMX); float32, already at the read
// bandwidth with a pass per KV head, keeps it (0.80-1.09x with one pass).
template <int NC, typename V>
AVX512_F32 static void weighted_values_all(int64_t G, int64_t KVH, int64_t g0, int64_t g1, const Probs& pr, int64_t L,
                                           const V* vp, const int64_t* table, int64_t bs, float* o) {
  constexpr int64_t D = 16 * NC, HB = 16 / NC;
  if (G <= HB) {
    switch (G) {
      case 1: return weighted_values_blocks<NC, 1>(pr, L, vp, table, bs, KVH, g0, g1, o);
      case 2: if constexpr (HB >= 2) return weighted_values_blocks<NC, 2>(pr, L, vp, table, bs, KVH, g0, g1, o); break;
      case 3: if constexpr (HB >= 3) return weighted_values_blocks<NC, 3>(pr, L, vp, table, bs, KVH, g0, g1, o); break;
      default: if constexpr (HB >= 4) return weighted_values_blocks<NC, 4>(pr, L, vp, table, bs, KVH, g0, g1, o); break;
    }
  }
  const int64_t row = KVH * D;
  const V* first_v = vp + table[0] * bs * row;
  for (int64_t g = g0; g < g1; ++g)
    weighted_values_heads<NC>(G, pr, g * G, L, vp + g * D, table, bs, row, o + g * G * D,
                              g + 1 < g1 ? first_v + (g + 1) * D : nullptr, std::min(bs, L));
}

// One sequence's query heads of KV heads [g0, g1) (a task of paged_decode's parallel loop: all of
// them): their unnormalised output in ob and 1 / each head's sum in inv_sum ([H][D] and [H], the
// other heads' untouched); p is the task's scratch. A head's results depend on its query and its KV
// head alone, so any split of the heads computes the same bits.
template <int NC2>
AVX512_BF16 static void decode_sequence_bf16(const bf16* q, const bf16* kp, const bf16* vp, const int64_t* table,
                                             int64_t L, int64_t H, int64_t KVH, int64_t g0, int64_t g1, int64_t bs,
                                             float scale, std::vector<float>& p, std::vector<float>& ob,
                                             std::vector<float>& inv_sum) {
  constexpr int64_t D = 32 * NC2;
  const int64_t G = H / KVH, row = KVH * D, h0 = g0 * G, h1 = g1 * G;
  p.resize(H * L);
  const bf16* first_v = vp + table[0] * bs * row;
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min(bs, L - t0);
    const bf16* kb = kp + table[t0 / bs] * bs * row;
    for (int64_t h = h0; h < h1; ++h) {
      prefetch_next_block(kp, table, t0, L, bs, row, row, h - h0, h1 - h0, first_v, std::min(bs, L));
      for (int64_t j = 0; j < n; j += 16)
        scores16<NC2>(q + h * D, kb + (h / G) * D + j * row, row, std::min<int64_t>(16, n - j), scale,
                      p.data() + h * L + t0 + j);
    }
  }
  softmax_rows(p.data() + h0 * L, h1 - h0, L, inv_sum.data() + h0);
  weighted_values_all<2 * NC2>(G, KVH, g0, g1, Probs{p.data(), H, 0, L, 1}, L, vp, table, bs, ob.data());
}

#if defined(__x86_64__)
// ---- bfloat16 scores on AMX tiles ------------------------------------------------------------------
// One tile product multiplies 16 rows of 32 bfloat16 values by 32 x 16 values (stored as 16 rows of
// 16 pairs) into 16 x 16 float32 sums. 16 keys of one KV head, 32 of their values, are an A tile read
// from the cache as stored (16 rows, one cache row apart); the query is packed once per sequence into
// B tiles of 16 value pairs x 16 heads, a KV head's tile holding its query heads' values and zeros
// for every other head. So the products of all KV heads and all 32-value slices sum into one tile:
// the scores of 16 keys x 16 heads ([16 keys][16 heads], stored as it is), with no lane sums; the
// vector path spends a transposing reduction on every 16 scores. The products are exact in float32
// (as vdpbf16ps's), summed in the tile's order. Heads go in sets of whole groups, up to 16.
constexpr int64_t kAmxScoreColumns = 16;

template <int NC2>
AMX_BF16 static void decode_sequence_amx(const bf16* q, const bf16* kp, const bf16* vp,
                                         const int64_t* table, int64_t L, int64_t H, int64_t KVH, int64_t bs,
                                         float scale, std::vector<float>& p, std::vector<bf16>& qt,
                                         std::vector<float>& ob, std::vector<float>& inv_sum) {
  constexpr int64_t D = 32 * NC2, tile = kAmxTileRows * kAmxTileDepth;  // bfloat16 values of a tile
  const int64_t G = H / KVH, row = KVH * D, per = kAmxScoreColumns / G * G, sets = (H + per - 1) / per;
  const int64_t Lp = (L + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows;
  // qt: KV head g's B tile for values 32d..32d+31 at (g * NC2 + d) * tile: pair row i, head column
  // h % per, the two values 2i and 2i + 1 side by side.
  qt.assign(KVH * NC2 * tile, bf16{});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < D; ++i)
      qt[(h / G * NC2 + i / 32) * tile + (i % 32 / 2) * 32 + (h % per) * 2 + (i & 1)] = q[h * D + i];
  p.resize(sets * Lp * kAmxScoreColumns);
  const bf16* first_v = vp + table[0] * bs * row;
  const int64_t loads = bs / kAmxTileRows * KVH * NC2;  // K tiles per block: the next block's prefetch spread over them
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const bf16* kb = kp + table[t0 / bs] * bs * row;
    int64_t load = 0;
    for (int64_t j0 = 0; j0 < bs && t0 + j0 < L; j0 += kAmxTileRows)
      for (int64_t set = 0; set < sets; ++set) {
        // Keys past L (the last block's tail) are scored and never read: each key's row of the
        // tile is its own.
        _tile_zero(0);
        for (int64_t g = set * per / G; g < std::min(KVH, (set + 1) * per / G); ++g)
          for (int64_t d = 0; d < NC2; ++d, ++load) {
            prefetch_next_block(kp, table, t0, L, bs, row, row, load, loads, first_v, std::min(bs, L));
            _tile_loadd(1, kb + j0 * row + g * D + 32 * d, row * sizeof(bf16));
            _tile_loadd(2, qt.data() + (g * NC2 + d) * tile, 64);
            _tile_dpbf16ps(0, 1, 2);
          }
        _tile_stored(0, p.data() + (set * Lp + t0 + j0) * kAmxScoreColumns, kAmxScoreColumns * sizeof(float));
      }
  }
  // Softmax down each column: a key's row of scores is one vector of 16 heads;
  // exp((s - max) * scale) = 2^(s * c - max * c), c = scale * log2(e).
  static_assert(kAmxScoreColumns == 16, "a key's scores are one vector");
  const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f);
  for (int64_t set = 0; set < sets; ++set) {
    float* ps = p.data() + set * Lp * kAmxScoreColumns;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < L; ++t) mx = _mm512_max_ps(mx, _mm512_loadu_ps(ps + t * kAmxScoreColumns));
    const __m512 top = _mm512_mul_ps(mx, c);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      const __m512 e = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(ps + t * kAmxScoreColumns), c, top));
      _mm512_storeu_ps(ps + t * kAmxScoreColumns, e);
      sum = _mm512_add_ps(sum, e);
    }
    alignas(64) float sums[kAmxScoreColumns];
    _mm512_store_ps(sums, sum);
    for (int64_t i = 0; i < std::min(per, H - set * per); ++i) inv_sum[set * per + i] = 1.f / sums[i];
  }
  const Probs probs{p.data(), per, Lp * kAmxScoreColumns, 1, kAmxScoreColumns};
  weighted_values_all<2 * NC2>(G, KVH, 0, KVH, probs, L, vp, table, bs, ob.data());
}

// Whether the AMX scores take this cache: whole 16-key tiles in a block, a group in 16 columns.
static bool paged_decode_amx_usable(int64_t H, int64_t KVH, int64_t bs) {
  return cpu_has_amx_bf16() && bs % kAmxTileRows == 0 && H / KVH <= kAmxScoreColumns;
}

#else
static bool paged_decode_amx_usable(int64_t, int64_t, int64_t) { return false; }
template <int NC2>
static void decode_sequence_amx(const bf16*, const bf16*, const bf16*, const int64_t*, int64_t, int64_t, int64_t,
                                int64_t, float, std::vector<float>&, std::vector<bf16>&, std::vector<float>&,
                                std::vector<float>&) {}
#endif

// Heads [h0, h1) of a sequence's output (out, [H][D]): the unnormalised sums (ob) times 1 / the
// head's sum, rounded once.
static void store_heads(const float* ob, const float* inv_sum, bf16* out, int64_t h0, int64_t h1, int64_t D) {
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t i = 0; i < D; ++i) out[h * D + i] = store<bf16>(ob[h * D + i] * inv_sum[h]);
}

// Sequences [begin, end), the query heads of KV heads [g0, g1), through decode_sequence_bf16 on the
// calling thread.
template <int NC2>
static void decode_sequences_bf16(const bf16* qp, const bf16* kp, const bf16* vp, bf16* op, const int64_t* tables,
                                  const int64_t* lens, int64_t begin, int64_t end, int64_t g0, int64_t g1, int64_t H,
                                  int64_t KVH, int64_t bs, int64_t max_blocks, float scale) {
  constexpr int64_t D = 32 * NC2;
  thread_local std::vector<float> p, ob, inv_sum;
  ob.resize(H * D);
  inv_sum.resize(H);
  for (int64_t b = begin; b < end; ++b) {
    decode_sequence_bf16<NC2>(qp + b * H * D, kp, vp, tables + b * max_blocks, lens[b], H, KVH, g0, g1, bs, scale, p,
                              ob, inv_sum);
    store_heads(ob.data(), inv_sum.data(), op + b * H * D, g0 * (H / KVH), g1 * (H / KVH), D);
  }
}

// amx: the scores on AMX tiles (paged_decode_amx_usable), else vdpbf16ps and lane sums.
template <int NC2>
static void paged_decode_bf16(const bf16* qp, const bf16* kp, const bf16* vp, bf16* op, const int64_t* tables,
                              const int64_t* lens, int64_t B, int64_t H, int64_t KVH, int64_t bs, int64_t max_blocks,
                              float scale, bool amx) {
  constexpr int64_t D = 32 * NC2;
  parallel_chunks(B, [&](int64_t begin, int64_t end) {
    if (!amx) return decode_sequences_bf16<NC2>(qp, kp, vp, op, tables, lens, begin, end, 0, KVH, H, KVH, bs,
                                                max_blocks, scale);
    amx_configure();
    std::vector<float> p, ob(H * D), inv_sum(H);
    std::vector<bf16> qt;
    for (int64_t b = begin; b < end; ++b) {
      decode_sequence_amx<NC2>(qp + b * H * D, kp, vp, tables + b * max_blocks, lens[b], H, KVH, bs, scale, p, qt,
                               ob, inv_sum);
      store_heads(ob.data(), inv_sum.data(), op + b * H * D, 0, H, D);
    }
    amx_release();
  });
}

// Whether the one-region decode step (decoder_stack.cpp) can split a sequence's KV heads between its
// threads (decode_heads): every cache decode_rows reads, and a bfloat16 one read by vdpbf16ps;
// the AMX scores take whole sequences. At batch 1 one thread took a step's whole attention while
// the other waited.
static bool decode_splits_heads(at::ScalarType dtype, int64_t H, int64_t KVH, int64_t D, int64_t bs) {
  return decode_takes_rows(dtype, D) || !paged_decode_amx_usable(H, KVH, bs);
}

// The query heads of KV heads [g0, g1) of sequences [begin, end), on the calling thread, into op
// (where decode_splits_heads): decode_rows, or the AVX512-BF16 kernel where paged_decode takes it.
template <typename T>
static void decode_heads(const T* qp, const T* kp, const T* vp, T* op, const int64_t* tables, const int64_t* lens,
                         int64_t begin, int64_t end, int64_t g0, int64_t g1, int64_t H, int64_t D, int64_t KVH,
                         int64_t bs, int64_t max_blocks, float scale) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (!decode_takes_rows(at::kBFloat16, D)) {
      const auto sequences = D == 64 ? decode_sequences_bf16<2> : decode_sequences_bf16<4>;
      return sequences(qp, kp, vp, op, tables, lens, begin, end, g0, g1, H, KVH, bs, max_blocks, scale);
    }
  }
  decode_rows(qp, kp, vp, op, tables, lens, begin, end, g0, g1, H, D, KVH, bs, max_blocks, scale, 1.f);
}

// ---- fp8 caches on CPUs with AVX-512 -----------------------------------------------------------------
// The query in float32 (widened once per sequence), each key read (an fp8 one widened in registers:
// load16) and multiplied in float32 FMAs, sixteen keys at a time; the values as in the bfloat16
// path. Float32 caches took it too until the AVX2 loop above, with its prefetches, overtook it.

// Scores of one query head (NC x 16 floats) against up to 16 keys `row` elements apart; keys past
// `count` re-read the last one and are not stored.
template <int NC, typename C>
AVX512_F32 static inline void scores16_f32(const float* q, const C* k, int64_t row, int64_t count, float scale,
                                           float* out) {
  __m512 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 a[16];
  for (int64_t t = 0; t < 16; ++t) {
    const C* kt = k + std::min(t, count - 1) * row;
    __m512 acc = _mm512_mul_ps(qv[0], load16(kt));
    for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[c], load16(kt + 16 * c), acc);
    a[t] = acc;
  }
  const __m512 s = _mm512_mul_ps(lane_sums16(a), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << count) - 1u), s);
}

// One sequence: q [H, D] float32 in, ob [H, D] unnormalised output and inv_sum [H] out.
template <int NC, typename C>
AVX512_F32 static void decode_sequence_f32(const float* q, const C* kp, const C* vp, const int64_t* table, int64_t L,
                                           int64_t H, int64_t KVH, int64_t bs, float scale, std::vector<float>& p,
                                           float* ob, float* inv_sum) {
  constexpr int64_t D = 16 * NC;
  const int64_t G = H / KVH, row = KVH * D;
  p.resize(H * L);
  const C* first_v = vp + table[0] * bs * row;
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min(bs, L - t0);
    const C* kb = kp + table[t0 / bs] * bs * row;
    for (int64_t h = 0; h < H; ++h) {
      prefetch_next_block(kp, table, t0, L, bs, row, row, h, H, first_v, std::min(bs, L));
      for (int64_t j = 0; j < n; j += 16)
        scores16_f32<NC>(q + h * D, kb + (h / G) * D + j * row, row, std::min<int64_t>(16, n - j), scale,
                         p.data() + h * L + t0 + j);
    }
  }
  softmax_rows(p.data(), H, L, inv_sum);
  for (int64_t g = 0; g < KVH; ++g)
    weighted_values_heads<NC>(G, Probs{p.data(), H, 0, L, 1}, g * G, L, vp + g * D, table, bs, row, ob + g * G * D,
                              g + 1 < KVH ? first_v + (g + 1) * D : nullptr, std::min(bs, L));
}

template <int NC, typename T, typename C>
static void paged_decode_f32(const T* qp, const C* kp, const C* vp, T* op, const int64_t* tables, const int64_t* lens,
                             int64_t B, int64_t H, int64_t KVH, int64_t bs, int64_t max_blocks, float scale,
                             float vscale) {
  constexpr int64_t D = 16 * NC;
  parallel_chunks(B, [&](int64_t begin, int64_t end) {
    std::vector<float> p, qb(H * D), ob(H * D), inv_sum(H);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i = 0; i < H * D; ++i) qb[i] = f32(qp[b * H * D + i]);
      decode_sequence_f32<NC>(qb.data(), kp, vp, tables + b * max_blocks, lens[b], H, KVH, bs, scale, p, ob.data(),
                              inv_sum.data());
      T* out = op + b * H * D;
      for (int64_t h = 0; h < H; ++h) {
        const float w = inv_sum[h] * vscale;
        for (int64_t i = 0; i < D; ++i) out[h * D + i] = store<T>(ob[h * D + i] * w);
      }
    }
  });
}

// Calls body(C{}) with C the fp8 element type of an fp8 cache.
template <typename Body>
static void dispatch_fp8(const torch::Tensor& cache, Body&& body) {
  if (cache.scalar_type() == at::kFloat8_e4m3fn) return body(fp8e4m3{});
  TORCH_CHECK(cache.scalar_type() == at::kFloat8_e5m2, "paged_decode: not an fp8 cache");
  body(fp8e5m2{});
}

// k_scale / v_scale: what an fp8 cache's values are multiplied by when read (a cache in the
// query's dtype ignores them).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale, double k_scale,
                           double v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn || k_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK((k_cache.scalar_type() == q.scalar_type() || fp8) && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: the caches must have the query's dtype, or be fp8, both the same");
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
  const float fscale = static_cast<float>(fp8 ? scale * k_scale : scale);
  // One task a sequence, all its heads: a block holds bs tokens' K (or V) rows for every KV head as
  // one contiguous run, streamed in from memory once and then used by all query heads of each group
  // from L1 (one KV head's slice per task instead measured about 2x slower, memory bound on the
  // strided rows).
  auto every_sequence = [&](const auto* qp, const auto* kp, const auto* vp, auto* op, float vscale) {
    parallel_chunks(B, [&](int64_t begin, int64_t end) {
      decode_rows(qp, kp, vp, op, tables, lens, begin, end, 0, KVH, H, D, KVH, bs, max_blocks, fscale, vscale);
    });
  };
  if (fp8) {
    const float vscale = static_cast<float>(v_scale);
    dispatch(q, "paged_decode", [&](auto tag) {
      using T = decltype(tag);
      const T* qp = q.data_ptr<T>();
      T* op = out.data_ptr<T>();
      dispatch_fp8(k_cache, [&](auto ctag) {
        using C = decltype(ctag);
        const C* kp = static_cast<const C*>(k_cache.data_ptr());
        const C* vp = static_cast<const C*>(v_cache.data_ptr());
        if ((D == 64 || D == 128) && cpu_has_avx512()) {
          if (D == 64) paged_decode_f32<4>(qp, kp, vp, op, tables, lens, B, H, KVH, bs, max_blocks, fscale, vscale);
          else paged_decode_f32<8>(qp, kp, vp, op, tables, lens, B, H, KVH, bs, max_blocks, fscale, vscale);
          return;
        }
        every_sequence(qp, kp, vp, op, vscale);
      });
    });
    return out;
  }
  if (q.scalar_type() == at::kBFloat16 && !decode_takes_rows(at::kBFloat16, D)) {
    const bf16* qp = q.data_ptr<bf16>();
    const bf16* kp = k_cache.data_ptr<bf16>();
    const bf16* vp = v_cache.data_ptr<bf16>();
    bf16* op = out.data_ptr<bf16>();
    const bool amx = paged_decode_amx_usable(H, KVH, bs);
    if (D == 64) paged_decode_bf16<2>(qp, kp, vp, op, tables, lens, B, H, KVH, bs, max_blocks, fscale, amx);
    else paged_decode_bf16<4>(qp, kp, vp, op, tables, lens, B, H, KVH, bs, max_blocks, fscale, amx);
    return out;
  }
  dispatch(q, "paged_decode", [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.data_ptr<T>();
    const T* kp = k_cache.data_ptr<T>();
    const T* vp = v_cache.data_ptr<T>();
    every_sequence(qp, kp, vp, out.data_ptr<T>(), 1.f);
  });
  return out;
}

