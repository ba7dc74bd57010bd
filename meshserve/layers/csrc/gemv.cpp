// Decode matmuls: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for a few rows of x (M <= kGemvMaxRows),
// the weight float32 or bfloat16 as it is stored (rows of K contiguous values, never repacked).
// With one to a few rows a linear layer is a stream over its weight: each weight row is read once,
// from memory, and serves every row of x, which stays in L1. MKL's sgemm packs weight panels on
// every call and oneDNN sets up a primitive, work that a few rows cannot amortise; this reads the
// weight once with several independent accumulators per row, so the loads, not the FMA latency,
// set the pace. bfloat16 weights are widened to float32 in registers (a shift and a mask), so they
// stream at half the bytes on any AVX2 CPU, with or without AVX512-BF16.
//
// Compiled twice (the build's baseline, AVX2 where the CPU has it, and AVX-512), as the element-wise
// kernels in cpu_kernels.cpp are, and chosen at run time.

constexpr int64_t kGemvMaxRows = 16;
// Bytes ahead on the weight's stream that each step asks for with a software prefetch, by path.
// AVX2: none. On a 2-core Zen 4 (AVX-512 hidden) 8 KB ahead made the kernel alone 1.2x slower, in
// float32 and bfloat16, on one thread and two (benchmarks/decode_batch1.py, and the kernel over the
// embedded model's shapes with and without, in one process): a prefetch every 32 bytes of a stream
// the hardware prefetcher already follows takes load slots and miss buffers from the loads.
// AVX-512 (a prefetch every 64 bytes): 8 KB, as the kernel was written on a Zen 5 with AVX-512
// (not measured without there since).
template <int VW>
constexpr int64_t prefetch_bytes() {
  return VW == 16 ? 8192 : 0;
}

template <int VW>
struct Lanes {
  typedef float F __attribute__((vector_size(VW * 4)));
  typedef uint32_t U __attribute__((vector_size(VW * 4)));
};

template <int VW>
__attribute__((always_inline)) static inline typename Lanes<VW>::F load_lanes(const float* p) {
  typename Lanes<VW>::F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int VW>
__attribute__((always_inline)) static inline typename Lanes<VW>::F as_float(typename Lanes<VW>::U u) {
  typename Lanes<VW>::F v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// The sum of a vector's lanes as a tree of half-width adds, in registers (a loop over the lanes
// sends the accumulators through the stack, a cost that rows of a few hundred values feel).
template <int VW>
__attribute__((always_inline)) static inline float lane_sum(typename Lanes<VW>::F v) {
  if constexpr (VW == 16) {
    typename Lanes<8>::F lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    typename Lanes<8>::F hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return lane_sum<8>(lo + hi);
  } else if constexpr (VW == 8) {
    typename Lanes<4>::F lo = __builtin_shufflevector(v, v, 0, 1, 2, 3);
    typename Lanes<4>::F hi = __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return lane_sum<4>(lo + hi);
  } else {
    static_assert(VW == 4);
    return (v[0] + v[2]) + (v[1] + v[3]);
  }
}

// Weight values one step of the inner loop takes: a vector of float32, or two of bfloat16 (one
// 32-bit lane holds two neighbours, widened without a shuffle: see pair_order).
template <int VW, typename W>
constexpr int64_t step_values() {
  return std::is_same_v<W, bf16> ? 2 * VW : VW;
}

// A bfloat16 weight vector widens to float32 with a shift (the even elements) and a mask (the odd
// ones): no cross-lane shuffle, which on AVX2 costs more than the load. x is stored to match: each
// chunk of 2 * VW values as its even elements, then its odd ones (the tail past the chunks as is).
static void pair_order(float* x, int64_t rows, int64_t K, int64_t vw) {
  float chunk[32];
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k + 2 * vw <= K; k += 2 * vw) {
      float* c = x + m * K + k;
      for (int64_t j = 0; j < vw; ++j) chunk[j] = c[2 * j], chunk[vw + j] = c[2 * j + 1];
      std::memcpy(c, chunk, sizeof(float) * 2 * vw);
    }
}

// Output rows [n0, n1) of y ([M, N], the weight's dtype; + bias where there is one) for M compile-time
// rows of x (float32, [M, K]; for a bfloat16 weight in pair_order). One weight row at a time, so the
// weight is read as one sequential stream: several rows read side by side look to the hardware
// prefetcher like as many short streams, which on a Zen 4 core streamed at 60-65% of the rate of a
// single one. U independent accumulators per row of x (along K) keep the FMAs off the critical path
// when M alone does not.
template <int VW, int M, int U, typename W>
__attribute__((always_inline)) static inline void gemv_block(const W* w, const float* x, const W* bias, W* y,
                                                             int64_t N, int64_t K, int64_t n0, int64_t n1) {
  using F = typename Lanes<VW>::F;
  using U32 = typename Lanes<VW>::U;
  constexpr int64_t S = step_values<VW, W>();
  const int64_t kv = K / S * S, ku = K / (S * U) * (S * U);
  constexpr int64_t ahead = prefetch_bytes<VW>() / static_cast<int64_t>(sizeof(W));
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    F acc[U][M];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = F{};
    auto step = [&](int64_t k, int u) __attribute__((always_inline)) {
      if constexpr (std::is_same_v<W, bf16>) {
        U32 bits;
        std::memcpy(&bits, row + k, sizeof(bits));
        const F even = as_float<VW>(bits << 16), odd = as_float<VW>(bits & 0xFFFF0000u);
        for (int m = 0; m < M; ++m)
          acc[u][m] += even * load_lanes<VW>(x + m * K + k), acc[u][m] += odd * load_lanes<VW>(x + m * K + k + VW);
      } else {
        const F wv = load_lanes<VW>(row + k);
        for (int m = 0; m < M; ++m) acc[u][m] += wv * load_lanes<VW>(x + m * K + k);
      }
    };
    int64_t k = 0;
    for (; k < ku; k += S * U) {
      for (int u = 0; u < U; ++u) {
        if constexpr (ahead > 0) __builtin_prefetch(row + k + u * S + ahead);
        step(k + u * S, u);
      }
    }
    for (; k < kv; k += S) step(k, 0);
    for (int m = 0; m < M; ++m) {
      F total = acc[0][m];
      for (int u = 1; u < U; ++u) total += acc[u][m];
      float s = lane_sum<VW>(total);
      for (int64_t kk = kv; kk < K; ++kk) s += f32(row[kk]) * x[m * K + kk];
      if (bias) s += f32(bias[n]);
      y[m * N + n] = store<W>(s);
    }
  }
}

// Accumulators along K per row of x: four chains in flight for one row, fewer as M grows.
template <int M>
constexpr int unroll() {
  return M == 1 ? 4 : (M == 2 ? 2 : 1);
}

// Up to 8 rows of x share one pass over the weight in registers; more rows go through it in groups
// of 8, tile by tile, so that the weight comes from memory once and from L1/L2 for the later groups.
constexpr int64_t kRowGroup = 8;
constexpr int64_t kTileBytes = 16384;

template <int VW, typename W>
__attribute__((always_inline)) static inline void gemv_group(const W* w, const float* x, const W* bias, W* y,
                                                             int64_t M, int64_t N, int64_t K, int64_t n0,
                                                             int64_t n1) {
  switch (M) {
#define GEMV_CASE(m) \
  case m:            \
    return gemv_block<VW, m, unroll<m>()>(w, x, bias, y, N, K, n0, n1);
    GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4) GEMV_CASE(5) GEMV_CASE(6) GEMV_CASE(7) GEMV_CASE(8)
#undef GEMV_CASE
  }
}

template <int VW, typename W>
__attribute__((always_inline)) static inline void gemv_range(const W* w, const float* x, const W* bias, W* y,
                                                             int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M <= kRowGroup) return gemv_group<VW>(w, x, bias, y, M, N, K, n0, n1);
  const int64_t tile = std::max<int64_t>(4, kTileBytes / (K * static_cast<int64_t>(sizeof(W))) / 4 * 4);
  for (int64_t t = n0; t < n1; t += tile)
    for (int64_t m = 0; m < M; m += kRowGroup)
      gemv_group<VW>(w, x + m * K, bias, y + m * N, std::min(kRowGroup, M - m), N, K, t, std::min(t + tile, n1));
}

template <typename W>
static void gemv_range_base(const W* w, const float* x, const W* bias, W* y, int64_t M, int64_t N, int64_t K,
                            int64_t n0, int64_t n1) {
  gemv_range<8>(w, x, bias, y, M, N, K, n0, n1);
}

template <typename W>
AVX512 static void gemv_range_avx512(const W* w, const float* x, const W* bias, W* y, int64_t M, int64_t N,
                                     int64_t K, int64_t n0, int64_t n1) {
  gemv_range<16>(w, x, bias, y, M, N, K, n0, n1);
}

// Which compiled path gemv takes on this CPU now ("avx512" or "avx2"; "avx2" names the baseline).
std::string gemv_isa() { return cpu_has_avx512() ? "avx512" : "avx2"; }

torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  check_rows(x, "gemv");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "gemv: the weight must be a contiguous [N, K] tensor of x's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), ldx = x.stride(0);
  TORCH_CHECK(weight.size(1) == K, "gemv: x has ", K, " columns but the weight ", weight.size(1));
  TORCH_CHECK(M <= kGemvMaxRows, "gemv: at most ", kGemvMaxRows, " rows, got ", M);
  if (bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(),
                "gemv: bias of N values of x's dtype");
  const bool wide = cpu_has_avx512();
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;  // an expert no token was routed to
  // x in float32, in the order the kernel reads it: a few KB, reused by the calling thread
  thread_local std::vector<float> scratch;
  scratch.resize(M * K);
  dispatch(weight, "gemv", [&](auto tag) {
    using W = decltype(tag);
    const W* xp = x.data_ptr<W>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) scratch[m * K + k] = f32(xp[m * ldx + k]);
    if constexpr (std::is_same_v<W, bf16>) pair_order(scratch.data(), M, K, wide ? 16 : 8);
    const W* wp = weight.data_ptr<W>();
    const W* bp = bias ? bias->data_ptr<W>() : nullptr;
    W* yp = y.data_ptr<W>();
    const float* xs = scratch.data();
    // Whole cache lines of output per task, and enough rows that a task streams for a while.
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      if (wide)
        gemv_range_avx512(wp, xs, bp, yp, M, N, K, n0, n1);
      else
        gemv_range_base(wp, xs, bp, yp, M, N, K, n0, n1);
    });
  });
  return y;
}
