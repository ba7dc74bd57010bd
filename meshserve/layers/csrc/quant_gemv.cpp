// Quantized weights, read as stored: GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) and
// int8 rows with one scale per output channel. A weight is a [N, row_bytes] uint8 tensor, each row
// its K values' blocks in file order.
//
// Every format is read in units of 32 values that share one scale and one offset (a GGUF block,
// or a sub-block of a K-quant super-block): decode_unit turns a unit into its integer levels as
// float32 (Q6_K's 16-value scales folded in, being small integers too) plus the unit's scale and
// offset, so that w = scale * level + offset. A decode-step matmul then needs per unit only
// sum(level * x) (vector FMAs on the levels, never the dequantized weight), times the scale, plus
// offset * sum(x), whose sums of x per unit are computed once per call: the weight streams from
// memory at its quantized size and is widened in registers only. Activations stay float32, so the
// result is the float32 matmul of the dequantized weight up to summation order.
//
// Larger batches (prefill) dequantize the weight to float32 and take the float matmul: there the
// work is compute-bound and the dequantization is a small fraction of it (cpu_gemm.py).

constexpr int64_t kUnit = 32;  // values per unit
constexpr int64_t kQuantPrefetchBytes = 4096;

enum QuantType : int64_t {  // GGML's type ids, and ours for int8 rows
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kInt8Rows = 100,
};

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
    QUANT_CASE(kQ6_K) QUANT_CASE(kInt8Rows)
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

static const float* checked_row_scale(const c10::optional<torch::Tensor>& row_scale, int64_t type, int64_t N) {
  TORCH_CHECK((type == kInt8Rows) == row_scale.has_value(), "quantized weight: int8 rows, and only they, take a row scale");
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

// F.linear(x, dequantized weight, bias) for 0 to kGemvMaxRows rows of x (float32 or bfloat16).
torch::Tensor qgemv(torch::Tensor x, torch::Tensor weight, int64_t type, c10::optional<torch::Tensor> row_scale,
                    c10::optional<torch::Tensor> bias) {
  check_rows(x, "qgemv");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), ldx = x.stride(0);
  const int64_t row_bytes = checked_row_bytes(weight, type, K);
  TORCH_CHECK(M <= kGemvMaxRows, "qgemv: at most ", kGemvMaxRows, " rows, got ", M);
  const float* rs = checked_row_scale(row_scale, type, N);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0) {
    const int64_t units = K / kUnit;
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
    const uint8_t* wp = weight.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
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
  }
  if (bias) y += *bias;
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
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
