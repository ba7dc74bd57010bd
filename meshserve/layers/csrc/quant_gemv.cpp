// Quantized weights, read as stored: GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) and
// one-byte rows (int8, or float8 e4m3) with one float32 scale per output channel. A weight is a
// [N, row_bytes] uint8 tensor, each row its K values' blocks in file order.
//
// Every format is read in units of 32 values that share one scale and one offset (a GGUF block,
// or a sub-block of a K-quant super-block; Q6_K's 16-value scales are small integers), so that
// w = scale * level + offset. A decode step's few rows of x then need per unit only
// sum(level * x), times the scale, plus offset * sum(x): never the dequantized weight, which
// streams from memory at its quantized size and is widened in registers only.
//
// qgemv computes sum(level * x) in integers where the CPU has AVX2 (the integer path, below),
// because widening every level to float32 for an FMA costs more than reading its bytes: that way
// Q4_1 ran at ~7 GB/s against ~35 GB/s of read bandwidth. x is rounded once per call to int8 per
// unit (scale max|x| / 127), and each unit's 32 byte-sized levels meet it in one or two integer
// dot-product instructions. The price is that rounding of x: the result is the product of the
// dequantized weight with the rounded x (within ~0.6% of the exact product on random data; the
// contract is in tests/engine/test_quant_gemv.py), as llama.cpp's CPU matmuls compute it.
//
// The float path widens the levels to float32 and keeps x as it is: the result is the float32 matmul
// of the dequantized weight up to summation order. It is the reference (tests force it with
// set_quant_isa("float")), the path of fp8 rows (not integer levels; F16C widens them cheaply) and
// of CPUs without AVX2, and qdequantize decodes units the same way.
//
// Larger batches (prefill) dequantize the weight to float32 and take the float matmul: there the
// work is compute-bound and the dequantization is a small fraction of it (cpu_gemm.py).

#include <immintrin.h>
#include <string>
#include <type_traits>

constexpr int64_t kUnit = 32;  // values per unit
constexpr int64_t kQuantPrefetchBytes = 4096;

enum QuantType : int64_t {  // GGML's type ids, and ours for int8 and fp8 rows
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kInt8Rows = 100, kFp8Rows = 101,
};

static inline bool row_scaled(int64_t type) { return type == kInt8Rows || type == kFp8Rows; }

// 8-lane vectors: one AVX2 register (GCC lowers wider generic vectors on AVX2 through the stack).
typedef float F8v __attribute__((vector_size(32)));
typedef int32_t I8v __attribute__((vector_size(32)));
typedef uint8_t U8x16 __attribute__((vector_size(16)));

struct Levels {  // a unit's 32 levels, 8 per vector
  F8v v[4];
};

static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction where c10's bit manipulation takes a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

struct QuantFormat {
  int64_t values;  // per block
  int64_t bytes;   // per block
  bool offset;     // units have an offset (w = scale * level + offset), not only a scale
};

static QuantFormat quant_format(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18, false};
    case kQ4_1: return {32, 20, true};
    case kQ5_0: return {32, 22, false};
    case kQ5_1: return {32, 24, true};
    case kQ8_0: return {32, 34, false};
    case kQ4_K: return {256, 144, true};
    case kQ6_K: return {256, 210, false};
    case kInt8Rows: return {32, 32, false};
    case kFp8Rows: return {32, 32, false};
  }
  TORCH_CHECK(false, "quantized weight: unknown block type ", type);
}

template <typename V>
static inline V load_vec(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 8 bytes as 8 float32 values (unsigned, or signed for int8). GCC scalarises a byte-to-float
// __builtin_convertvector, so on AVX2 this widens with vpmovzxbd/vpmovsxbd.
template <bool Signed>
__attribute__((always_inline)) static inline F8v widen8(const void* p) {
  F8v out;
#if defined(__AVX2__)
  __m128i v;
  std::memcpy(&v, p, 8);
  const __m256 f = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
  std::memcpy(&out, &f, 32);
#else
  const uint8_t* q = static_cast<const uint8_t*>(p);
  for (int i = 0; i < 8; ++i) out[i] = Signed ? static_cast<float>(static_cast<int8_t>(q[i])) : q[i];
#endif
  return out;
}

// 8 float8 e4m3 bytes as float32 values over 256: a byte's sign, exponent and mantissa moved into
// the same fields of a float16 (((b & 0x80) << 8) | ((b & 0x7F) << 7), here the sign-extended byte
// shifted by 7 with bit 14 cleared) read as half x 2^-8, exactly, subnormals included: the half's
// exponent bias is 8 above e4m3's. The caller scales by 256 (exact).
__attribute__((always_inline)) static inline F8v widen_fp8(const uint8_t* p) {
  F8v out;
#if defined(__F16C__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  const __m256 f = _mm256_cvtph_ps(h);
  std::memcpy(&out, &f, 32);
#else
  for (int i = 0; i < 8; ++i)
    out[i] = c10::detail::fp16_ieee_to_fp32_value(static_cast<uint16_t>(((p[i] & 0x80) << 8) | ((p[i] & 0x7F) << 7)));
#endif
  return out;
}

// 16 bytes' levels (unsigned) into v[at], v[at + 1].
__attribute__((always_inline)) static inline void levels16(U8x16 q, Levels& l, int at) {
#if defined(__AVX2__)
  __m128i v;
  std::memcpy(&v, &q, 16);
  const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
  std::memcpy(&l.v[at], &a, 32);
  std::memcpy(&l.v[at + 1], &b, 32);
#else
  uint8_t b[16];
  std::memcpy(b, &q, 16);
  l.v[at] = widen8<false>(b), l.v[at + 1] = widen8<false>(b + 8);
#endif
}

// The 5th bits of values [first, first + 8) of a Q5 block's 32-bit mask, as 0 or 16.
static inline F8v fifth_bits(uint32_t qh, int first) {
  const I8v shift = {0, 1, 2, 3, 4, 5, 6, 7};
  const I8v bits = ((I8v{} + static_cast<int32_t>(qh >> first)) >> shift) & 1;
  return __builtin_convertvector(bits << 4, F8v);
}

// Q4_K's 6-bit scale and offset of sub-block j (llama.cpp's get_scale_min_k4).
static inline void k4_scale_min(const uint8_t* q, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63, *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Unit u of the row starting at `row`: its 32 levels, scale and offset.
template <int64_t T>
__attribute__((always_inline)) static inline void decode_unit(const uint8_t* row, int64_t u, Levels& l, float& scale,
                                                              float& offset) {
  if constexpr (T == kQ4_0 || T == kQ4_1) {
    const uint8_t* b = row + u * (T == kQ4_0 ? 18 : 20);
    const U8x16 qs = load_vec<U8x16>(b + (T == kQ4_0 ? 2 : 4));
    scale = half_to_float(b);
    offset = T == kQ4_0 ? 0.f : half_to_float(b + 2);
    levels16(qs & 0xF, l, 0), levels16(qs >> 4, l, 2);
    if constexpr (T == kQ4_0)  // levels centred on 8
      for (auto& v : l.v) v -= 8.f;
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    const uint8_t* b = row + u * (T == kQ5_0 ? 22 : 24);
    const uint8_t* h = b + (T == kQ5_0 ? 2 : 4);
    uint32_t qh;
    std::memcpy(&qh, h, 4);
    const U8x16 qs = load_vec<U8x16>(h + 4);
    scale = half_to_float(b);
    offset = T == kQ5_0 ? 0.f : half_to_float(b + 2);
    levels16(qs & 0xF, l, 0), levels16(qs >> 4, l, 2);
    const float zero = T == kQ5_0 ? 16.f : 0.f;  // Q5_0's levels are centred on 16
    for (int i = 0; i < 4; ++i) l.v[i] += fifth_bits(qh, 8 * i) - zero;
  } else if constexpr (T == kQ8_0 || T == kInt8Rows) {
    const uint8_t* b = row + u * (T == kQ8_0 ? 34 : 32);
    const uint8_t* qs = b + (T == kQ8_0 ? 2 : 0);
    scale = T == kQ8_0 ? half_to_float(b) : 1.f;  // int8 rows: the row's scale is applied once, at the end
    offset = 0.f;
    for (int i = 0; i < 4; ++i) l.v[i] = widen8<true>(qs + 8 * i);
  } else if constexpr (T == kFp8Rows) {
    const uint8_t* b = row + u * 32;
    scale = 256.f;  // widen_fp8's values are the e4m3 values over 256; the row's scale comes at the end
    offset = 0.f;
    for (int i = 0; i < 4; ++i) l.v[i] = widen_fp8(b + 8 * i);
  } else if constexpr (T == kQ4_K) {
    const uint8_t* b = row + (u / 8) * 144;
    const int j = static_cast<int>(u % 8);
    uint8_t sc, m;
    k4_scale_min(b + 4, j, &sc, &m);
    scale = half_to_float(b) * sc;
    offset = -half_to_float(b + 2) * m;
    const uint8_t* qs = b + 16 + (j / 2) * 32;
    const U8x16 q0 = load_vec<U8x16>(qs), q1 = load_vec<U8x16>(qs + 16);
    if (j % 2 == 0)
      levels16(q0 & 0xF, l, 0), levels16(q1 & 0xF, l, 2);
    else
      levels16(q0 >> 4, l, 0), levels16(q1 >> 4, l, 2);
  } else {
    static_assert(T == kQ6_K);
    const uint8_t* b = row + (u / 8) * 210;
    const int half = static_cast<int>(u % 8) / 4, r = static_cast<int>(u % 4);
    const uint8_t* ql = b + 64 * half + (r % 2) * 32;
    const uint8_t* qh = b + 128 + 32 * half;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * r;
    const int shift_lo = r >= 2 ? 4 : 0, shift_hi = 2 * r;
    for (int at = 0; at < 4; at += 2) {
      const U8x16 lo = load_vec<U8x16>(ql + 8 * at), hi = load_vec<U8x16>(qh + 8 * at);
      levels16(((lo >> shift_lo) & 0xF) | (((hi >> shift_hi) & 3) << 4), l, at);
      // 16 values per Q6_K scale: small integers, folded into the levels exactly
      const float s16 = static_cast<float>(sc[at / 2]);
      l.v[at] = (l.v[at] - 32.f) * s16, l.v[at + 1] = (l.v[at + 1] - 32.f) * s16;
    }
    scale = half_to_float(b + 208);
    offset = 0.f;
  }
}

template <int64_t T>
static constexpr int64_t block_bytes() {  // quant_format(T).bytes, at compile time
  return T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : T == kQ5_1 ? 24 : T == kQ8_0 ? 34
         : T == kQ4_K ? 144 : T == kQ6_K ? 210 : 32;
}

template <int64_t T>
static constexpr bool has_offset() {
  return T == kQ4_1 || T == kQ5_1 || T == kQ4_K;
}

// Output rows [n0, n1) of y ([M, N] float32) for M rows of x (float32 [M, K]); xsum: per row of x
// and unit, the sum of its 32 values (types with offsets only).
template <int64_t T, int M>
__attribute__((always_inline)) static inline void qgemv_rows(const uint8_t* w, int64_t row_bytes, const float* x,
                                                             const float* xsum, const float* row_scale, float* y,
                                                             int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t units = K / kUnit;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t p = 0; p < row_bytes; p += 64) __builtin_prefetch(row + kQuantPrefetchBytes + p);
    F8v acc[M];
    float off[M];
    for (int m = 0; m < M; ++m) acc[m] = F8v{}, off[m] = 0.f;
    for (int64_t u = 0; u < units; ++u) {
      Levels l;
      float scale, offset;
      decode_unit<T>(row, u, l, scale, offset);
      for (int m = 0; m < M; ++m) {
        const float* xu = x + m * K + u * kUnit;
        const F8v d = (l.v[0] * load_vec<F8v>(xu) + l.v[1] * load_vec<F8v>(xu + 8)) +
                      (l.v[2] * load_vec<F8v>(xu + 16) + l.v[3] * load_vec<F8v>(xu + 24));
        acc[m] += d * scale;
        if constexpr (has_offset<T>()) off[m] += offset * xsum[m * units + u];
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = off[m];
      for (int i = 0; i < 8; ++i) s += acc[m][i];
      if (row_scale) s *= row_scale[n];
      y[m * N + n] = s;
    }
  }
}

// Up to kQuantRowGroup rows of x share one decode of each unit; more rows go through the weight in
// groups, tile by tile, the tile coming from L1/L2 for the later groups.
constexpr int64_t kQuantRowGroup = 4;
constexpr int64_t kQuantTileRows = 32;

template <int64_t T>
__attribute__((always_inline)) static inline void qgemv_range(const uint8_t* w, int64_t row_bytes, const float* x,
                                                              const float* xsum, const float* row_scale, float* y,
                                                              int64_t M, int64_t N, int64_t K, int64_t n0,
                                                              int64_t n1) {
  const int64_t units = K / kUnit;
  for (int64_t t = n0; t < n1; t += kQuantTileRows) {
    const int64_t t1 = std::min(t + kQuantTileRows, n1);
    for (int64_t m = 0; m < M; m += kQuantRowGroup) {
      const float* xm = x + m * K;
      const float* sm = xsum + m * units;
      float* ym = y + m * N;
      switch (std::min(kQuantRowGroup, M - m)) {
        case 1: qgemv_rows<T, 1>(w, row_bytes, xm, sm, row_scale, ym, N, K, t, t1); break;
        case 2: qgemv_rows<T, 2>(w, row_bytes, xm, sm, row_scale, ym, N, K, t, t1); break;
        case 3: qgemv_rows<T, 3>(w, row_bytes, xm, sm, row_scale, ym, N, K, t, t1); break;
        default: qgemv_rows<T, 4>(w, row_bytes, xm, sm, row_scale, ym, N, K, t, t1); break;
      }
    }
  }
}

// Rows [n0, n1) of the dequantized weight, as float32 [N, K] (times the row scale for int8 rows).
template <int64_t T>
__attribute__((always_inline)) static inline void dequantize_range(const uint8_t* w, int64_t row_bytes,
                                                                   const float* row_scale, float* out, int64_t K,
                                                                   int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float rs = row_scale ? row_scale[n] : 1.f;
    for (int64_t u = 0; u < K / kUnit; ++u) {
      Levels l;
      float scale, offset;
      decode_unit<T>(w + n * row_bytes, u, l, scale, offset);
      for (int i = 0; i < 4; ++i) {
        const F8v v = (l.v[i] * scale + offset) * rs;
        std::memcpy(out + n * K + u * kUnit + 8 * i, &v, sizeof(v));
      }
    }
  }
}

// Calls body(std::integral_constant<int64_t, T>{}) for the block type.
template <typename Body>
static void dispatch_quant(int64_t type, Body&& body) {
  switch (type) {
#define QUANT_CASE(t) \
  case t:             \
    return body(std::integral_constant<int64_t, t>{});
    QUANT_CASE(kQ4_0) QUANT_CASE(kQ4_1) QUANT_CASE(kQ5_0) QUANT_CASE(kQ5_1) QUANT_CASE(kQ8_0) QUANT_CASE(kQ4_K)
    QUANT_CASE(kQ6_K) QUANT_CASE(kInt8Rows) QUANT_CASE(kFp8Rows)
#undef QUANT_CASE
  }
  TORCH_CHECK(false, "quantized weight: unknown block type ", type);
}

template <int64_t T>
static void qgemv_range_base(const uint8_t* w, int64_t rb, const float* x, const float* xs, const float* rs, float* y,
                             int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  qgemv_range<T>(w, rb, x, xs, rs, y, M, N, K, n0, n1);
}
template <int64_t T>
AVX512 static void qgemv_range_avx512(const uint8_t* w, int64_t rb, const float* x, const float* xs, const float* rs,
                                      float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  qgemv_range<T>(w, rb, x, xs, rs, y, M, N, K, n0, n1);
}
template <int64_t T>
static void dequantize_range_base(const uint8_t* w, int64_t rb, const float* rs, float* out, int64_t K, int64_t n0,
                                  int64_t n1) {
  dequantize_range<T>(w, rb, rs, out, K, n0, n1);
}
template <int64_t T>
AVX512 static void dequantize_range_avx512(const uint8_t* w, int64_t rb, const float* rs, float* out, int64_t K,
                                           int64_t n0, int64_t n1) {
  dequantize_range<T>(w, rb, rs, out, K, n0, n1);
}

// ---- The integer path -------------------------------------------------------------------------
// Per unit and row of x, the levels' dot product with the rounded x comes out as eight int32 lanes
// (vpdpbusd on AVX512-VNNI and AVX-VNNI, vpmaddubsw + vpmaddwd on AVX2), converted to float and
// scaled once by (weight scale x activation scale): a few instructions per 32 values where the float
// path takes a dozen. Several weight rows and rows of x per pass keep enough independent
// accumulators that loads, not latencies, set the pace.
//
// Built where the baseline has AVX2/FMA/F16C, whose intrinsics the shared templates use without
// target attributes (those only the AVX-512 paths use carry theirs); each wider ISA gets entry
// points with its target and `flatten`, which inlines the templates and that ISA's helpers into
// them (an always_inline helper with a wider target could not be inlined into a template that has
// none).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_INT_PATH 1
#define QUANT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define QUANT_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define QUANT_AVXVNNI __attribute__((target("avxvnni,avx2,fma,f16c")))

constexpr int64_t kIntPrefetchBytes = 8192;
constexpr int64_t kIntTileBytes = 16384;
constexpr int64_t kIntPanelBytes = 262144;  // a quarter of a Zen 4 / Sapphire Rapids core's L2

static inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
static inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Prefetches, into L2, the Bytes of weight kIntPrefetchBytes past p: called once per step of a
// kernel's loop with p advancing by Bytes, it keeps lines coming a few at a time. On the Zen 4 this
// was tuned on, one thread streamed the Q8_0 LM head ~1.5x faster this way than with no software
// prefetch, or with a burst of a whole row block's lines into L1 (the float path's scheme).
template <int64_t Bytes>
static inline void prefetch_ahead(const uint8_t* p) {
  for (int64_t i = 0; i < Bytes; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + kIntPrefetchBytes + i), _MM_HINT_T1);
}

// The first bytes of a thread's rows, before prefetch_ahead reaches past them: each call's stream
// starts cold, and most layers of a decode step are short streams (0.1-0.5 MB).
static inline void prefetch_start(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1) {
  const int64_t bytes = std::min((n1 - n0) * row_bytes, kIntPrefetchBytes);
  for (int64_t i = 0; i < bytes; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + n0 * row_bytes + i), _MM_HINT_T0);
}

// x after rounding, unit-major so that one unit of every row of x is one run of memory. For unit u
// and row m (m < S; rows past M are zeros): q[(u * S + m) * 32 + i] = round(x[m][32u + i] / d) with
// d = max |x| over the unit / 127, and ds[(u * S + m) * 2] = {d, d * the sum of the rounded values},
// the pair a unit's {scale, offset} multiplies in one step. For types whose levels are centred on c
// and have no offset of their own, that sum comes times -c, and the unit's pair is {scale, scale}.
// For Q6_K, whose scales differ between the unit's two halves of 16, ds holds the first half's sum
// and hs = {0, the second half's}.
struct QActs {
  const int8_t* q;
  const float* ds;
  const float* hs;
  int64_t S;
};

// Rounds rows of x (float32 or bfloat16 [M, K], row stride ldx) into QActs layout.
template <typename X>
static void quantize_acts(const X* x, int64_t ldx, int64_t M, int64_t K, int64_t S, int centre, bool halves,
                          int8_t* q, float* ds, float* hs) {
  const int64_t units = K / kUnit;
  const __m256i pack_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t u = 0; u < units; ++u) {
      const X* xu = x + m * ldx + u * kUnit;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) {
        if constexpr (std::is_same_v<X, float>) {
          v[i] = _mm256_loadu_ps(xu + 8 * i);
        } else {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xu + 8 * i));
          v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
      }
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                               _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
      __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
      a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
      float d = _mm_cvtss_f32(a4) / 127.f;
      float inv = d > 0.f ? 1.f / d : 0.f;
      if (!(inv <= std::numeric_limits<float>::max())) d = 0.f, inv = 0.f;  // a unit of subnormals: zero
      const __m256 iv = _mm256_set1_ps(inv);
      __m256i r[4];
      for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));  // to nearest even
      const __m256i packed = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])), pack_order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (u * S + m) * kUnit), packed);
      // the sums of values 0-15 and 16-31 in lanes 0 and 1
      const __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
      const __m256i h2 = _mm256_hadd_epi32(h, h);
      const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
      const int32_t lo = _mm_cvtsi128_si32(s2), hi = _mm_extract_epi32(s2, 1);
      float* p = ds + (u * S + m) * 2;
      p[0] = d;
      if (halves) {
        p[1] = d * static_cast<float>(lo);
        hs[(u * S + m) * 2] = 0.f, hs[(u * S + m) * 2 + 1] = d * static_cast<float>(hi);
      } else {
        p[1] = d * static_cast<float>((centre ? -centre : 1) * (lo + hi));
      }
    }
  for (int64_t u = 0; u < units; ++u)
    for (int64_t m = M; m < S; ++m) {
      std::memset(q + (u * S + m) * kUnit, 0, kUnit);
      ds[(u * S + m) * 2] = ds[(u * S + m) * 2 + 1] = 0.f;
      if (halves) hs[(u * S + m) * 2] = hs[(u * S + m) * 2 + 1] = 0.f;
    }
}

// The ISA-specific steps. dot: per int32 lane j, the sum over bytes 4j..4j+3 of unsigned levels
// times signed activations (a unit's values 0-15 in lanes 0-3, 16-31 in lanes 4-7). vpmaddubsw
// saturates its int16 pair sums, so 8-bit signed weights cannot be shifted to unsigned there: they
// take |w| against sign(w) * x instead (kSignedDot), which stays below 2 * 128 * 127.
struct IntAvx2 {
  static constexpr int kMaxRows = 8;  // rows of x per pass over the weight: 16 vector registers
  static constexpr bool kWide = false;  // int_rows_pairs: one row of x, two units per 512-bit vector
  static constexpr bool kSignedDot = true;
  static inline __m256i dot(__m256i u8, __m256i s8) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1));
  }
  // 16 where bit i of a Q5 block's mask is set (byte i), else 0
  static inline __m256i fifth_bits(uint32_t qh) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int32_t>(qh)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3,
                         3));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
  }
};

struct IntAvxVnni : IntAvx2 {
  static constexpr bool kSignedDot = false;  // no saturation: signed weights + 128, the 128 folded out
  QUANT_AVXVNNI static inline __m256i dot(__m256i u8, __m256i s8) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u8, s8);
  }
};

struct IntAvx512 : IntAvx2 {
  static constexpr int kMaxRows = 16;  // 32 vector registers
  static constexpr bool kWide = true;
  QUANT_AVX512 static inline __m256i fifth_bits(uint32_t qh) {
    return _mm256_maskz_mov_epi8(_cvtu32_mask32(qh), _mm256_set1_epi8(16));
  }
  QUANT_AVX512 static inline __m512i fifth_bits(uint64_t qh) {
    return _mm512_maskz_mov_epi8(_cvtu64_mask64(qh), _mm512_set1_epi8(16));
  }
  using IntAvx2::dot;
  QUANT_AVX512 static inline __m512i dot(__m512i u8, __m512i s8) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1));
  }
  // s8 negated where w is negative (vpsignb has no 512-bit form; where w is 0, |w| is 0)
  QUANT_AVX512 static inline __m512i apply_sign(__m512i s8, __m512i w) {
    return _mm512_mask_sub_epi8(s8, _mm512_movepi8_mask(w), _mm512_setzero_si512(), s8);
  }
};

struct IntVnni512 : IntAvx512 {
  static constexpr bool kSignedDot = false;
  QUANT_VNNI512 static inline __m256i dot(__m256i u8, __m256i s8) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u8, s8);
  }
  QUANT_VNNI512 static inline __m512i dot(__m512i u8, __m512i s8) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u8, s8);
  }
};

// What a type's unit sum needs besides scale * dot: the level each is centred on (folded out as
// -centre * scale * sum(x)), and whether a per-unit offset term exists at all.
template <int64_t T, class O>
static constexpr int int_centre() {
  if constexpr (T == kQ4_0) return 8;
  if constexpr (T == kQ5_0) return 16;
  if constexpr (T == kQ6_K) return 32;
  if constexpr (T == kQ8_0 || T == kInt8Rows) return O::kSignedDot ? 0 : 128;
  return 0;
}
// The centre quantize_acts folds into the activation sums (Q6_K folds its own, per half).
template <int64_t T, class O>
static constexpr int int_folded_centre() {
  return T == kQ6_K || has_offset<T>() ? 0 : int_centre<T, O>();
}
template <int64_t T, class O>
static constexpr bool int_signed() {  // levels are signed bytes, dotted by the sign trick
  return (T == kQ8_0 || T == kInt8Rows) && O::kSignedDot;
}
template <int64_t T, class O>
static constexpr bool int_offsets() {
  return has_offset<T>() || int_centre<T, O>() != 0;
}
template <int64_t T>
static constexpr int64_t int_units_per_block() {
  return T == kQ4_K || T == kQ6_K ? 8 : 1;
}

static inline __m256i nibbles(const uint8_t* p) {  // 16 bytes -> 32 levels: low nibbles, then high
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// Two float16 values as float32 lanes 0 and 1 (a: bits 0-15, b: bits 16-31).
static inline __m128 two_halves(uint32_t ab) { return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(ab))); }
static inline __m128 load_pair(const float* p) {
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
}

// A Q4_K super-block's {scale, offset} per sub-block j (d * sc_j, -dmin * m_j), as the pairs
// unpacklo/unpackhi of the two vectors leave them: sub-block j at 2 * ((j & 1) + 2 * (j & 2) + (j & 4) / 2).
static inline void k4_pairs(const uint8_t* b, float* pairs) {
  const __m128 dd = two_halves(load_u32(b));  // d, dmin
  // the 6-bit scales and mins of the 8 sub-blocks (k4_scale_min), four to a 32-bit word
  const uint32_t w0 = load_u32(b + 4), w1 = load_u32(b + 8), w2 = load_u32(b + 12);
  const uint64_t sc = (w0 & 0x3F3F3F3Fu) | static_cast<uint64_t>((w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u)) << 32;
  const uint64_t mn = (w1 & 0x3F3F3F3Fu) | static_cast<uint64_t>(((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u))
                                               << 32;
  auto widen = [](uint64_t bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
  };
  const __m256 s = _mm256_mul_ps(widen(sc), _mm256_broadcastss_ps(dd));
  const __m256 o = _mm256_mul_ps(widen(mn), _mm256_set1_ps(-_mm_cvtss_f32(_mm_movehdup_ps(dd))));
  _mm256_store_ps(pairs, _mm256_unpacklo_ps(s, o)), _mm256_store_ps(pairs + 8, _mm256_unpackhi_ps(s, o));
}

// A unit's scale as the kernel applies it: {scale, offset} in lanes 0, 1 (the offset with the
// centre folded in, multiplying the unit's sum of x), or for Q6_K a scale per half (lanes 0-3 and
// 4-7) and an offset per half.
struct PairScale {
  __m128 dm;
};
struct HalfScales {
  __m256 s;
  __m256 o_lo, o_hi;
};

// The units of block `blk` of a row: unit(j, levels, sign source, scale), the levels as bytes
// (unsigned; |w| where int_signed, with w then the sign source).
template <int64_t T, class O, class F>
static inline void int_units(const uint8_t* row, int64_t blk, F&& unit) {
  if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1) {
    constexpr bool off = has_offset<T>(), q5 = T == kQ5_0 || T == kQ5_1;
    constexpr int64_t bytes = T == kQ4_0 ? 18 : (T == kQ4_1 ? 20 : (T == kQ5_0 ? 22 : 24));
    const uint8_t* b = row + blk * bytes;
    __m256i l = nibbles(b + (off ? 4 : 2) + (q5 ? 4 : 0));
    if constexpr (q5) l = _mm256_or_si256(l, O::fifth_bits(load_u32(b + (off ? 4 : 2))));
    const uint32_t h = load_u32(b);
    unit(0, l, l, PairScale{two_halves(off ? h : (h & 0xFFFF) * 0x10001u)});  // {d, m}, or {d, d}
  } else if constexpr (T == kQ8_0 || T == kInt8Rows) {
    const uint8_t* b = row + blk * (T == kQ8_0 ? 34 : 32);
    const __m256i w = load256(b + (T == kQ8_0 ? 2 : 0));
    // {d, d}; int8 rows {1, 1}, the row's scale coming at the end
    const __m128 dm = T == kQ8_0 ? two_halves((load_u32(b) & 0xFFFF) * 0x10001u) : _mm_set1_ps(1.f);
    if constexpr (O::kSignedDot)
      unit(0, _mm256_sign_epi8(w, w), w, PairScale{dm});
    else
      unit(0, _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))), w, PairScale{dm});
  } else if constexpr (T == kQ4_K) {
    const uint8_t* b = row + blk * 144;
    // {scale, offset} of sub-block j at pairs + 2 * ((j & 1) + 2 * (j & 2) + (j & 4) / 2)
    alignas(32) float pairs[16];
    k4_pairs(b, pairs);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m256i q = load256(b + 16 + 32 * p);
      const __m256i lo = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F));
      const int j0 = 2 * p, j1 = 2 * p + 1;
      unit(j0, lo, lo, PairScale{load_pair(pairs + 2 * ((j0 & 1) + 2 * (j0 & 2) + (j0 & 4) / 2))});
      unit(j1, hi, hi, PairScale{load_pair(pairs + 2 * ((j1 & 1) + 2 * (j1 & 2) + (j1 & 4) / 2))});
    }
  } else {
    static_assert(T == kQ6_K);
    constexpr float centre = static_cast<float>(int_centre<T, O>());
    const uint8_t* b = row + blk * 210;
    const __m256 d = _mm256_set1_ps(half_to_float(b + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    alignas(32) float scale[16];
    _mm256_store_ps(scale, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d));
    _mm256_store_ps(scale + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // 4 units of 32 per half of 128 values
      const int half = j / 4, r = j % 4;
      const __m256i ql = load256(b + 64 * half + 32 * (r % 2));
      const __m256i qh = load256(b + 128 + 32 * half);
      const __m256i lo = _mm256_and_si256(r >= 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
      // bits 2r, 2r+1 of qh as bits 4, 5
      const __m256i hs = r == 0 ? _mm256_slli_epi16(qh, 4)
                                : (r == 1 ? _mm256_slli_epi16(qh, 2) : (r == 2 ? qh : _mm256_srli_epi16(qh, 2)));
      const __m256i l = _mm256_or_si256(lo, _mm256_and_si256(hs, _mm256_set1_epi8(0x30)));
      const __m256 s0 = _mm256_broadcast_ss(scale + 2 * j), s1 = _mm256_broadcast_ss(scale + 2 * j + 1);
      unit(j, l, l, HalfScales{_mm256_blend_ps(s0, s1, 0xF0), _mm256_mul_ps(s0, _mm256_set1_ps(-centre)),
                               _mm256_mul_ps(s1, _mm256_set1_ps(-centre))});
    }
  }
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

struct IntJob {
  const uint8_t* w;
  int64_t row_bytes, blocks, N;
  QActs a;
  const float* row_scale;  // or null
  const float* bias;       // float32, or null
  float* y;                // [M, N]
};

// Rows [n, n + RB) of the weight against rows [m0, m0 + M) of x (of which `valid` are real; the
// rest, zeros, keep M a compile-time count): RB * M vector accumulators, every unit's weight bytes
// decoded once and dotted with each row of x. Offsets accumulate in the odd lanes of `off`
// (row m of x: lane 2 (m % 4) + 1 of off[r][m / 4]); the even lanes collect products no one reads.
template <int64_t T, class O, int M, int RB>
static inline void int_rows(const IntJob& job, int64_t m0, int64_t valid, int64_t n) {
  constexpr int64_t per_block = int_units_per_block<T>();
  constexpr bool offsets = int_offsets<T, O>();
  constexpr int C = (M + 3) / 4;
  const int64_t S = job.a.S, rb = job.row_bytes;
  const uint8_t* rows = job.w + n * rb;
  using Off = std::conditional_t<M == 1, __m128, __m256>;  // one row of x: {*, offset} in an xmm
  __m256 acc[RB][M];
  Off off[RB][C];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < C; ++c) off[r][c] = Off{};
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  }
  for (int64_t blk = 0; blk < job.blocks; ++blk) {
    prefetch_ahead<RB * block_bytes<T>()>(rows + blk * RB * block_bytes<T>());
    for (int r = 0; r < RB; ++r)
      int_units<T, O>(rows + r * rb, blk, [&](int j, __m256i l, __m256i sign, auto scale) {
        const int64_t u = blk * per_block + j;
        const int8_t* qu = job.a.q + (u * S + m0) * kUnit;
        const float* ds = job.a.ds + (u * S + m0) * 2;
        auto dot = [&](int m) {
          __m256i xq = load256(qu + m * kUnit);
          if constexpr (int_signed<T, O>()) xq = _mm256_sign_epi8(xq, sign);
          return _mm256_cvtepi32_ps(O::dot(l, xq));
        };
        if constexpr (std::is_same_v<decltype(scale), HalfScales>) {
          const float* hs = job.a.hs + (u * S + m0) * 2;
          for (int m = 0; m < M; ++m)
            acc[r][m] = _mm256_fmadd_ps(dot(m), _mm256_mul_ps(scale.s, _mm256_broadcast_ss(ds + 2 * m)), acc[r][m]);
          if constexpr (M == 1) {
            off[r][0] = _mm_fmadd_ps(_mm256_castps256_ps128(scale.o_lo), load_pair(ds), off[r][0]);
            off[r][0] = _mm_fmadd_ps(_mm256_castps256_ps128(scale.o_hi), load_pair(hs), off[r][0]);
          } else {
            for (int c = 0; c < C; ++c) {
              off[r][c] = _mm256_fmadd_ps(scale.o_lo, _mm256_loadu_ps(ds + 8 * c), off[r][c]);
              off[r][c] = _mm256_fmadd_ps(scale.o_hi, _mm256_loadu_ps(hs + 8 * c), off[r][c]);
            }
          }
        } else if constexpr (M == 1) {
          const __m128 p = _mm_mul_ps(scale.dm, load_pair(ds));  // {scale * d, offset * sum}
          if constexpr (offsets) off[r][0] = _mm_add_ps(off[r][0], p);
          acc[r][0] = _mm256_fmadd_ps(dot(0), _mm256_broadcastss_ps(p), acc[r][0]);
        } else {
          const __m256 dm = _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(scale.dm)));
          alignas(32) float sd[8 * C];
          for (int c = 0; c < C; ++c) {
            const __m256 p = _mm256_mul_ps(dm, _mm256_loadu_ps(ds + 8 * c));
            if constexpr (offsets) off[r][c] = _mm256_add_ps(off[r][c], p);
            _mm256_store_ps(sd + 8 * c, p);
          }
          for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(dot(m), _mm256_broadcast_ss(sd + 2 * m), acc[r][m]);
        }
      });
  }
  for (int r = 0; r < RB; ++r) {
    alignas(32) float o[8 * C];
    for (int c = 0; c < C; ++c) std::memcpy(o + 8 * c, &off[r][c], sizeof(Off));
    const float rs = job.row_scale ? job.row_scale[n + r] : 1.f, b = job.bias ? job.bias[n + r] : 0.f;
    float out[M];  // every row, so that acc is only ever indexed by constants and stays in registers
    for (int m = 0; m < M; ++m) out[m] = (hsum(acc[r][m]) + (offsets ? o[2 * m + 1] : 0.f)) * rs + b;
    for (int m = 0; m < valid && m < M; ++m) job.y[(m0 + m) * job.N + n + r] = out[m];
  }
}


// ---- One row of x on the AVX-512 paths: two units per 512-bit vector ------------------------------
// A decode step of one sequence is all about this case, and at one row of x the per-unit work of
// int_rows (a dot, a conversion, an FMA, the scale pair) is what limits the stream: taking two
// consecutive units at a time halves the instructions per byte. Q6_K keeps int_rows.

// Two consecutive 32-block units from b: their levels (low half: the first unit), the signed
// weights where int_signed, and {scale, offset} of each in lanes 0-1 and 2-3.
template <int64_t T, class O>
QUANT_AVX512 static inline void block_pair(const uint8_t* b, __m512i& l, __m512i& w, __m128& dm) {
  if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1) {
    constexpr bool off = has_offset<T>(), q5 = T == kQ5_0 || T == kQ5_1;
    constexpr int64_t bytes = T == kQ4_0 ? 18 : (T == kQ4_1 ? 20 : (T == kQ5_0 ? 22 : 24));
    constexpr int64_t qs = (off ? 4 : 2) + (q5 ? 4 : 0);
    const __m512i both = _mm512_mask_blend_epi64(  // the first unit's 16 bytes twice, then the second's
        0xF0, _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qs))),
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + bytes + qs))));
    l = _mm512_and_si512(_mm512_srlv_epi64(both, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0F));
    if constexpr (q5) {
      constexpr int64_t at = off ? 4 : 2;
      const uint64_t qh = load_u32(b + at) | static_cast<uint64_t>(load_u32(b + bytes + at)) << 32;
      l = _mm512_or_si512(l, O::fifth_bits(qh));
    }
    uint64_t h0 = load_u32(b), h1 = load_u32(b + bytes);
    if constexpr (!off) h0 = (h0 & 0xFFFF) * 0x10001u, h1 = (h1 & 0xFFFF) * 0x10001u;  // {d, d}
    dm = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h0 | h1 << 32)));
  } else if constexpr (T == kQ8_0) {
    w = _mm512_mask_blend_epi64(0xF0, _mm512_broadcast_i64x4(load256(b + 2)), _mm512_broadcast_i64x4(load256(b + 36)));
    const uint64_t h = ((load_u32(b) & 0xFFFF) | static_cast<uint64_t>(load_u32(b + 34) & 0xFFFF) << 32) * 0x10001u;
    dm = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h)));
  } else {
    static_assert(T == kInt8Rows);
    w = _mm512_loadu_si512(b);
    dm = _mm_set1_ps(1.f);
  }
  if constexpr (T == kQ8_0 || T == kInt8Rows)
    l = O::kSignedDot ? _mm512_abs_epi8(w) : _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Calls pair(u, levels, w, dm) for the unit pairs of step `step` of a row: two blocks of a
// 32-block type, or the four pairs of a Q4_K super-block.
template <int64_t T, class O, class F>
QUANT_AVX512 static inline void pair_step(const uint8_t* row, int64_t step, F&& pair) {
  if constexpr (T == kQ4_K) {
    const uint8_t* b = row + step * 144;
    // {scale, offset} of sub-blocks 2p, 2p + 1 at pairs + 4 * (2 * (p & 1) + (p & 2) / 2)
    alignas(32) float pairs[16];
    k4_pairs(b, pairs);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      // sub-blocks 2p and 2p + 1: the low and the high nibbles of the same 32 bytes
      const __m512i q = _mm512_broadcast_i64x4(load256(b + 16 + 32 * p));
      const __m512i l = _mm512_and_si512(_mm512_srlv_epi64(q, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4)),
                                         _mm512_set1_epi8(0x0F));
      pair(step * 8 + 2 * p, l, l, _mm_load_ps(pairs + 4 * (2 * (p & 1) + (p & 2) / 2)));
    }
  } else {
    __m512i l, w;
    __m128 dm;
    block_pair<T, O>(row + step * 2 * block_bytes<T>(), l, w, dm);
    pair(step * 2, l, w, dm);
  }
}

template <int64_t T>
static constexpr bool pairs_kernel() {
  return T != kQ6_K && T != kFp8Rows;
}

// Rows [n, n + RB) of the weight against one row of x (QActs with S = 1).
template <int64_t T, class O, int RB>
QUANT_AVX512 static inline void int_rows_pairs(const IntJob& job, int64_t n) {
  constexpr bool offsets = int_offsets<T, O>();
  const int64_t rb = job.row_bytes, units = job.blocks * int_units_per_block<T>();
  const int64_t steps = T == kQ4_K ? job.blocks : units / 2;
  const uint8_t* rows = job.w + n * rb;
  __m512 acc[RB];
  __m128 off[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps(), off[r] = _mm_setzero_ps();
  const __m512i lane_pairs = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  constexpr int64_t step_bytes = T == kQ4_K ? 144 : 2 * block_bytes<T>();
  for (int64_t step = 0; step < steps; ++step) {
    prefetch_ahead<RB * step_bytes>(rows + step * RB * step_bytes);
    for (int r = 0; r < RB; ++r)
      pair_step<T, O>(rows + r * rb, step, [&](int64_t u, __m512i l, __m512i w, __m128 dm) QUANT_AVX512 {
        __m512i xq = _mm512_loadu_si512(job.a.q + u * kUnit);
        if constexpr (int_signed<T, O>()) xq = O::apply_sign(xq, w);
        const __m128 p = _mm_mul_ps(dm, _mm_loadu_ps(job.a.ds + 2 * u));  // {scale * d, offset * sum} x 2
        if constexpr (offsets) off[r] = _mm_add_ps(off[r], p);
        const __m512 sc = _mm512_permutexvar_ps(lane_pairs, _mm512_castps128_ps512(p));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(O::dot(l, xq)), sc, acc[r]);
      });
  }
  if (T != kQ4_K && units % 2)  // the last unit of an odd count
    for (int r = 0; r < RB; ++r)
      int_units<T, O>(rows + r * rb, units - 1, [&](int, __m256i l, __m256i sign, auto scale) QUANT_AVX512 {
        __m256i xq = load256(job.a.q + (units - 1) * kUnit);
        if constexpr (int_signed<T, O>()) xq = _mm256_sign_epi8(xq, sign);
        const __m128 p = _mm_mul_ps(scale.dm, load_pair(job.a.ds + 2 * (units - 1)));
        if constexpr (offsets) off[r] = _mm_add_ps(off[r], p);
        const __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(O::dot(l, xq)), _mm256_broadcastss_ps(p));
        acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(d));
      });
  for (int r = 0; r < RB; ++r) {
    alignas(16) float o[4];
    _mm_store_ps(o, off[r]);
    const float rs = job.row_scale ? job.row_scale[n + r] : 1.f, b = job.bias ? job.bias[n + r] : 0.f;
    job.y[n + r] = (_mm512_reduce_add_ps(acc[r]) + (offsets ? o[1] + o[3] : 0.f)) * rs + b;
  }
}

template <int64_t T, class O>
QUANT_AVX512 static inline void int_pairs_range(const IntJob& job, int64_t n0, int64_t n1) {
  constexpr int RB = 4;
  prefetch_start(job.w, job.row_bytes, n0, n1);
  int64_t n = n0;
  for (; n + RB <= n1; n += RB) int_rows_pairs<T, O, RB>(job, n);
  for (; n < n1; ++n) int_rows_pairs<T, O, 1>(job, n);
}

// Weight rows per pass (RB) for M rows of x: enough accumulator chains (RB * M) to cover the FMA
// latency, each row of x loaded once for RB weight rows, within the vector registers.
template <class O, int M>
constexpr int int_rows_per_pass() {
  if constexpr (O::kMaxRows == 16) return M <= 4 ? 4 : (M <= 8 ? 2 : 1);
  return M == 1 ? 4 : (M <= 3 ? 2 : 1);
}

template <int64_t T, class O, int M>
static inline void int_group_rows(const IntJob& job, int64_t m0, int64_t valid, int64_t n0, int64_t n1) {
  constexpr int RB = int_rows_per_pass<O, M>();
  int64_t n = n0;
  for (; n + RB <= n1; n += RB) int_rows<T, O, M, RB>(job, m0, valid, n);
  if constexpr (RB > 1)
    for (; n < n1; ++n) int_rows<T, O, M, 1>(job, m0, valid, n);
}

// Rows [m0, m0 + rows) of x, as the next compile-time count up (the extra rows are zeros).
template <int64_t T, class O>
static inline void int_group(const IntJob& job, int64_t m0, int64_t rows, int64_t n0, int64_t n1) {
  if (rows == 1) return int_group_rows<T, O, 1>(job, m0, rows, n0, n1);
  if (rows == 2) return int_group_rows<T, O, 2>(job, m0, rows, n0, n1);
  if (rows == 3) return int_group_rows<T, O, 3>(job, m0, rows, n0, n1);
  if (rows == 4) return int_group_rows<T, O, 4>(job, m0, rows, n0, n1);
  if (rows <= 6) return int_group_rows<T, O, 6>(job, m0, rows, n0, n1);
  if (O::kMaxRows == 8 || rows <= 8) return int_group_rows<T, O, 8>(job, m0, rows, n0, n1);
  if constexpr (O::kMaxRows == 16) {
    if (rows <= 12) return int_group_rows<T, O, 12>(job, m0, rows, n0, n1);
    return int_group_rows<T, O, 16>(job, m0, rows, n0, n1);
  }
}

// Output rows [n0, n1) for all M rows of x: one pass for up to O::kMaxRows, else tile by tile, the
// later groups of rows reading the tile from L1/L2.
template <int64_t T, class O>
static inline void int_range(const IntJob& job, int64_t M, int64_t n0, int64_t n1) {
  if constexpr (O::kWide && pairs_kernel<T>())
    if (M == 1) return int_pairs_range<T, O>(job, n0, n1);
  prefetch_start(job.w, job.row_bytes, n0, n1);
  if (M <= O::kMaxRows) return int_group<T, O>(job, 0, M, n0, n1);
  // Prefill: a panel of rows of x whose rounded values stay in L2 meets each tile of the weight
  // from L1, so neither is streamed from memory more than once per panel.
  const int64_t tile = std::max<int64_t>(4, kIntTileBytes / job.row_bytes);
  const int64_t row_acts = job.blocks * int_units_per_block<T>() * (kUnit + 8);  // a row's levels and {d, sum}
  const int64_t panel = std::max<int64_t>(1, kIntPanelBytes / row_acts / O::kMaxRows) * O::kMaxRows;
  for (int64_t p0 = 0; p0 < M; p0 += panel)
    for (int64_t t = n0; t < n1; t += tile)
      for (int64_t m0 = p0; m0 < std::min(M, p0 + panel); m0 += O::kMaxRows)
        int_group<T, O>(job, m0, std::min<int64_t>(O::kMaxRows, M - m0), t, std::min(t + tile, n1));
}

template <int64_t T>
__attribute__((flatten)) static void int_range_avx2(const IntJob& job, int64_t M, int64_t n0, int64_t n1) {
  int_range<T, IntAvx2>(job, M, n0, n1);
}
template <int64_t T>
QUANT_AVXVNNI __attribute__((flatten)) static void int_range_avxvnni(const IntJob& job, int64_t M, int64_t n0,
                                                                     int64_t n1) {
  int_range<T, IntAvxVnni>(job, M, n0, n1);
}
template <int64_t T>
QUANT_AVX512 __attribute__((flatten)) static void int_range_avx512(const IntJob& job, int64_t M, int64_t n0,
                                                                   int64_t n1) {
  int_range<T, IntAvx512>(job, M, n0, n1);
}
template <int64_t T>
QUANT_VNNI512 __attribute__((flatten)) static void int_range_vnni512(const IntJob& job, int64_t M, int64_t n0,
                                                                     int64_t n1) {
  int_range<T, IntVnni512>(job, M, n0, n1);
}
#endif  // QUANT_INT_PATH

// Which path qgemv takes: the float reference, or the integer path for an ISA.
enum QuantIsa : int { kIsaFloat, kIsaAvx2, kIsaAvxVnni, kIsaAvx512, kIsaVnni512 };
static const char* const kQuantIsaNames[] = {"float", "avx2", "avxvnni", "avx512", "vnni512"};
static int quant_isa_forced = -1;  // -1: the best this CPU has

static bool quant_isa_supported(int isa) {
#if defined(QUANT_INT_PATH)
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case kIsaFloat: return true;
    case kIsaAvx2: return true;  // compiled in only where the baseline has AVX2, FMA and F16C
    case kIsaAvxVnni: return __builtin_cpu_supports("avxvnni");
    case kIsaAvx512: return avx512;
    case kIsaVnni512: return avx512 && __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return isa == kIsaFloat;
#endif
}

static int quant_isa_now() {
  if (quant_isa_forced >= 0) return quant_isa_forced;
  static const int best512 = quant_isa_supported(kIsaVnni512) ? kIsaVnni512 : kIsaAvx512;
  static const int best256 = quant_isa_supported(kIsaAvxVnni) ? kIsaAvxVnni
                             : quant_isa_supported(kIsaAvx2) ? kIsaAvx2 : kIsaFloat;
  return cpu_has_avx512() && quant_isa_supported(best512) ? best512 : best256;  // allow_avx512 caps it
}

// The path qgemv takes now: "vnni512", "avx512", "avxvnni", "avx2" (the integer paths) or "float".
std::string quant_isa() { return kQuantIsaNames[quant_isa_now()]; }

// Forces a path ("auto": the best the CPU has, within allow_avx512); returns the previous setting.
// A forced integer path is taken whatever allow_avx512 says; the float path's width follows it.
std::string set_quant_isa(std::string name) {
  const std::string previous = quant_isa_forced < 0 ? "auto" : kQuantIsaNames[quant_isa_forced];
  if (name == "auto") {
    quant_isa_forced = -1;
    return previous;
  }
  for (int i = 0; i < 5; ++i)
    if (name == kQuantIsaNames[i]) {
      TORCH_CHECK(quant_isa_supported(i), "set_quant_isa: this CPU (or build) has no ", name, " path");
      quant_isa_forced = i;
      return previous;
    }
  TORCH_CHECK(false, "set_quant_isa: unknown path ", name, " (auto, vnni512, avx512, avxvnni, avx2 or float)");
}

static const float* checked_row_scale(const c10::optional<torch::Tensor>& row_scale, int64_t type, int64_t N) {
  TORCH_CHECK(row_scaled(type) == row_scale.has_value(),
              "quantized weight: int8 and fp8 rows, and only they, take a row scale");
  if (!row_scale) return nullptr;
  TORCH_CHECK(row_scale->scalar_type() == at::kFloat && row_scale->is_contiguous() && row_scale->numel() == N,
              "quantized weight: the row scale must be N float32 values");
  return row_scale->data_ptr<float>();
}

static int64_t checked_row_bytes(const torch::Tensor& w, int64_t type, int64_t K) {
  const QuantFormat f = quant_format(type);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "quantized weight: a contiguous [N, row_bytes] uint8 tensor");
  TORCH_CHECK(K % f.values == 0, "quantized weight: K=", K, " is not a multiple of the block size ", f.values);
  TORCH_CHECK(w.size(1) == K / f.values * f.bytes, "quantized weight: rows of ", w.size(1), " bytes, expected ",
              K / f.values * f.bytes, " for K=", K);
  return w.size(1);
}

// The path a weight of this block type takes now: fp8 rows have no integer levels.
static int quant_isa_for(int64_t type) { return type == kFp8Rows ? kIsaFloat : quant_isa_now(); }

// F.linear(x, dequantized weight, bias) for rows of x (float32 or bfloat16): any number on the
// integer paths, up to kGemvMaxRows on the float path.
torch::Tensor qgemv(torch::Tensor x, torch::Tensor weight, int64_t type, c10::optional<torch::Tensor> row_scale,
                    c10::optional<torch::Tensor> bias) {
  check_rows(x, "qgemv");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), ldx = x.stride(0);
  const int64_t row_bytes = checked_row_bytes(weight, type, K);
  const int isa = quant_isa_for(type);
  TORCH_CHECK(M <= kGemvMaxRows || isa != kIsaFloat, "qgemv: at most ", kGemvMaxRows,
              " rows on the float path, got ", M);
  const float* rs = checked_row_scale(row_scale, type, N);
  torch::Tensor bias32;
  if (bias) {
    TORCH_CHECK(bias->numel() == N, "qgemv: bias of ", N, " values, got ", bias->numel());
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias ? bias32.data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t units = K / kUnit;
  if (M == 0) {
  } else if (isa == kIsaFloat) {
    thread_local std::vector<float> scratch;
    scratch.resize(M * K + M * units);
    float* xs = scratch.data();
    float* sums = xs + M * K;
    dispatch(x, "qgemv", [&](auto tag) {
      using X = decltype(tag);
      const X* xp = x.data_ptr<X>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xs[m * K + k] = f32(xp[m * ldx + k]);
    });
    for (int64_t m = 0; m < M * units; ++m) {
      float s = 0.f;
      for (int64_t i = 0; i < kUnit; ++i) s += xs[m * kUnit + i];
      sums[m] = s;
    }
    const bool wide = cpu_has_avx512();
    dispatch_quant(type, [&](auto t) {
      constexpr int64_t T = decltype(t)::value;
      at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
        if (wide)
          qgemv_range_avx512<T>(wp, row_bytes, xs, sums, rs, yp, M, N, K, n0, n1);
        else
          qgemv_range_base<T>(wp, row_bytes, xs, sums, rs, yp, M, N, K, n0, n1);
      });
    });
    if (bp) y += bias32;
  } else {
#if defined(QUANT_INT_PATH)
    // rows per unit in QActs: the kernels read {d, sum} pairs four rows at a time past one row of x
    const int64_t S = M == 1 ? 1 : (M <= 4 ? 4 : (M <= 8 ? 8 : (M + 15) / 16 * 16));
    const bool halves = type == kQ6_K, unsigned_dot = isa == kIsaVnni512 || isa == kIsaAvxVnni;
    thread_local std::vector<float> scratch;  // q (int8) | ds | hs
    scratch.resize(units * S * (kUnit / 4 + 2 + (halves ? 2 : 0)));
    int8_t* q = reinterpret_cast<int8_t*>(scratch.data());
    float* ds = scratch.data() + units * S * kUnit / 4;
    float* hs = ds + units * S * 2;
    const IntJob job{wp, row_bytes, K / quant_format(type).values, N, QActs{q, ds, hs, S}, rs, bp, yp};
    dispatch_quant(type, [&](auto t) {
      constexpr int64_t T = decltype(t)::value;
      const int centre = unsigned_dot ? int_folded_centre<T, IntVnni512>() : int_folded_centre<T, IntAvx2>();
      dispatch(x, "qgemv", [&](auto tag) {
        using X = decltype(tag);
        quantize_acts<X>(x.data_ptr<X>(), ldx, M, K, S, centre, halves, q, ds, hs);
      });
      if constexpr (T != kFp8Rows)
        at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
          switch (isa) {
            case kIsaVnni512: int_range_vnni512<T>(job, M, n0, n1); break;
            case kIsaAvx512: int_range_avx512<T>(job, M, n0, n1); break;
            case kIsaAvxVnni: int_range_avxvnni<T>(job, M, n0, n1); break;
            default: int_range_avx2<T>(job, M, n0, n1); break;
          }
        });
    });
#endif
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// x @ W^T (+ bias) for any number of rows: the integer kernels for every count (prefill too, at
// a rate near the float matmul's without a float copy of the weight), the float path's GEMV for a
// few rows, and for more the float matmul of the dequantized weight.
torch::Tensor qdequantize(torch::Tensor weight, int64_t type, int64_t K, c10::optional<torch::Tensor> row_scale);
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor weight, int64_t type, c10::optional<torch::Tensor> row_scale,
                      c10::optional<torch::Tensor> bias) {
  if (x.size(0) <= kGemvMaxRows || quant_isa_for(type) != kIsaFloat) return qgemv(x.contiguous(), weight, type,
                                                                                 row_scale, bias);
  return at::linear(x, qdequantize(weight, type, x.size(1), row_scale).to(x.scalar_type()), bias);
}

// The dequantized weight [N, K] in float32 (for the float matmul of many rows, and embedding rows).
torch::Tensor qdequantize(torch::Tensor weight, int64_t type, int64_t K, c10::optional<torch::Tensor> row_scale) {
  const int64_t row_bytes = checked_row_bytes(weight, type, K), N = weight.size(0);
  const float* rs = checked_row_scale(row_scale, type, N);
  auto out = torch::empty({N, K}, weight.options().dtype(at::kFloat));
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const bool wide = cpu_has_avx512();
  dispatch_quant(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      if (wide)
        dequantize_range_avx512<T>(wp, row_bytes, rs, op, K, n0, n1);
      else
        dequantize_range_base<T>(wp, row_bytes, rs, op, K, n0, n1);
    });
  });
  return out;
}
