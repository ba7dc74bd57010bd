// Matmuls of a few to a few dozen rows on a weight packed in panels: y[M, N] = x[M, K] @ w[N, K]^T
// (+ bias): float32 on AVX-512 or AVX2, bfloat16 with AVX512-BF16.
//
// The GEMV (gemv.cpp) sums along K and ends in a horizontal add per output: right for one row,
// compute-bound from a few rows on. Here the outputs run across the lanes instead. A panel holds
// kPanelWidth consecutive outputs (three vectors of 16), stored K-major ([K][48]), so one panel is
// one sequential stream: at each k the kernel loads the panel's three weight vectors once and
// multiplies them by up to kPanelRows rows of x, each broadcast from a transposed copy of x that
// stays in L1. Its 24 accumulators are independent FMA chains, enough to keep both FMA pipes busy
// with no reduction at the end; the weight is read from memory once a step and, for more rows than
// one register block holds, from L2 for the later blocks of the same panel.
//
// AVX2 has 16 vector registers of 8 lanes, so a panel is six vectors there and a register block
// two rows (12 accumulators, the two broadcasts and the weight vector being multiplied), and more
// rows take a panel in slices of K that stay in L1 while every pair of rows passes over them. The
// packing is the same, so one copy of the weight serves whichever path the CPU takes.
//
// bfloat16 panels keep pairs of neighbours along K together ([K/2][48][2]) so that one
// vdpbf16ps multiplies a pair of x's values, broadcast as one 32-bit lane, by 16 outputs' pairs:
// x and the weight as they are stored, products summed in float32, as oneDNN's bfloat16 matmul does.

constexpr int64_t kPanelVectors = 3;
constexpr int64_t kPanelWidth = 16 * kPanelVectors;  // outputs per panel (cpu_kernels.PANEL_WIDTH)
constexpr int64_t kPanelRows = 8;                    // rows of x per register block
constexpr int64_t kPanelPrefetchBytes = 4096;

template <int MR>
using PanelAcc = __m512[MR][kPanelVectors];

// One register block: MR rows of x against one panel, over all of K. xt: x transposed, [K][ldx]
// (float32) or [K/2][ldx] (bfloat16 pairs as 32-bit lanes), offset to the block's first row.
template <int MR>
AVX512 static inline void panel_block_f32(const float* panel, const float* xt, int64_t ldx, int64_t K,
                                          PanelAcc<MR>& acc) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVectors; ++v) acc[m][v] = _mm512_setzero_ps();
  constexpr int64_t ahead = kPanelPrefetchBytes / sizeof(float);
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = panel + k * kPanelWidth;
    for (int v = 0; v < kPanelVectors; ++v) _mm_prefetch(reinterpret_cast<const char*>(wk + ahead + 16 * v), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32);
    const float* xk = xt + k * ldx;
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(xk[m]);
      acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xb, w2, acc[m][2]);
    }
  }
}

template <int MR>
AVX512_BF16 static inline void panel_block_bf16(const bf16* panel, const uint32_t* xt, int64_t ldx, int64_t K2,
                                                PanelAcc<MR>& acc) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVectors; ++v) acc[m][v] = _mm512_setzero_ps();
  constexpr int64_t ahead = kPanelPrefetchBytes / sizeof(bf16);
  for (int64_t k = 0; k < K2; ++k) {
    const bf16* wk = panel + k * 2 * kPanelWidth;
    for (int v = 0; v < kPanelVectors; ++v) _mm_prefetch(reinterpret_cast<const char*>(wk + ahead + 32 * v), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
    const uint32_t* xk = xt + k * ldx;
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xk[m]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xb, w2);
    }
  }
}

// One row of a panel's sums (out, kPanelWidth floats) into y_row's columns n0.. (fewer in the last
// panel), plus the bias, rounded once to W.
template <typename W>
__attribute__((always_inline)) static inline void store_panel_row(const float* out, const W* bias, W* y_row,
                                                                  int64_t N, int64_t n0) {
  const int64_t width = std::min(kPanelWidth, N - n0);
  for (int64_t j = 0; j < width; ++j) y_row[n0 + j] = store<W>(bias ? out[j] + f32(bias[n0 + j]) : out[j]);
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kPanelVectorsAvx2 = kPanelWidth / 8;
// Values of K per pass over a panel's rows: 96 x 48 floats (18 KB) stay in L1 while every pair of
// rows of x meets them, so only the first pair reads them from memory.
constexpr int64_t kPanelDepthAvx2 = 96;

// MR <= 2 rows of x (xt offset to the first) against k0..k1 of one panel, continuing the sums in
// acc_io ([MR][48]): the same FMAs in the same order as one pass over K. With more than one pass
// over a slice, pass `pass` of `passes` also asks for every passes-th row of the slice after it,
// into L2: over all the passes the next slice arrives while this one is computed on. With one pass
// (one or two rows of x) the panels are read once, in order, a stream the hardware prefetcher
// follows: asking for it too, 18 KB ahead, made one and two rows 1.04-1.13x slower on a Zen 4.
template <int MR>
static inline void panel_pass_avx2(const float* panel, const float* xt, int64_t ldx, int64_t k0, int64_t k1,
                                   float* acc_io, int64_t pass, int64_t passes) {
  __m256 acc[MR][kPanelVectorsAvx2];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVectorsAvx2; ++v) acc[m][v] = _mm256_loadu_ps(acc_io + m * kPanelWidth + 8 * v);
  const float* next = panel + k1 * kPanelWidth;  // past a panel's end: the next panel, as stored
  int64_t due = k0 + pass;
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = panel + k * kPanelWidth;
    if (passes > 1 && k == due) {
      due += passes;
      for (int line = 0; line < kPanelVectors; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + (k - k0) * kPanelWidth + 16 * line), _MM_HINT_T1);
    }
    __m256 xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = _mm256_broadcast_ss(xt + k * ldx + m);
    for (int v = 0; v < kPanelVectorsAvx2; ++v) {
      const __m256 w = _mm256_loadu_ps(wk + 8 * v);
      for (int m = 0; m < MR; ++m) acc[m][v] = _mm256_fmadd_ps(xb[m], w, acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVectorsAvx2; ++v) _mm256_storeu_ps(acc_io + m * kPanelWidth + 8 * v, acc[m][v]);
}

// All M rows of x against one panel on AVX2, whose 16 registers hold two rows' sums at a time.
static void panel_avx2(const float* panel, const float* xt, int64_t M, int64_t K, const float* bias, float* y,
                       int64_t N, int64_t n0) {
  thread_local std::vector<float> sums;
  sums.assign(M * kPanelWidth, 0.0f);
  const int64_t passes = (M + 1) / 2;
  for (int64_t k0 = 0; k0 < K; k0 += kPanelDepthAvx2) {
    const int64_t k1 = std::min(K, k0 + kPanelDepthAvx2);
    for (int64_t m = 0; m < M; m += 2) {
      float* acc = sums.data() + m * kPanelWidth;
      if (m + 1 < M)
        panel_pass_avx2<2>(panel, xt + m, M, k0, k1, acc, m / 2, passes);
      else
        panel_pass_avx2<1>(panel, xt + m, M, k0, k1, acc, m / 2, passes);
    }
  }
  for (int64_t m = 0; m < M; ++m) store_panel_row(sums.data() + m * kPanelWidth, bias, y + m * N, N, n0);
}
constexpr bool kPanelAvx2 = true;
#else
constexpr bool kPanelAvx2 = false;
#endif

// The block's outputs into y's rows m0.. (store_panel_row).
template <int MR, typename W>
AVX512 static inline void panel_store(PanelAcc<MR>& acc, const W* bias, W* y, int64_t N, int64_t m0, int64_t n0) {
  alignas(64) float out[kPanelWidth];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kPanelVectors; ++v) _mm512_store_ps(out + 16 * v, acc[m][v]);
    store_panel_row(out, bias, y + (m0 + m) * N, N, n0);
  }
}

// One register block through the kernel of W's dtype (each compiled for only the ISA it needs).
template <int MR>
AVX512 static void panel_rows(const float* panel, const void* xt, int64_t ldx, int64_t K, const float* bias,
                              float* y, int64_t N, int64_t m0, int64_t n0) {
  PanelAcc<MR> acc;
  panel_block_f32<MR>(panel, static_cast<const float*>(xt) + m0, ldx, K, acc);
  panel_store<MR>(acc, bias, y, N, m0, n0);
}

template <int MR>
AVX512_BF16 static void panel_rows(const bf16* panel, const void* xt, int64_t ldx, int64_t K, const bf16* bias,
                                   bf16* y, int64_t N, int64_t m0, int64_t n0) {
  PanelAcc<MR> acc;
  panel_block_bf16<MR>(panel, static_cast<const uint32_t*>(xt) + m0, ldx, (K + 1) / 2, acc);
  panel_store<MR>(acc, bias, y, N, m0, n0);
}

template <typename W>
static void panel_group(const W* panel, const void* xt, int64_t ldx, int64_t K, const W* bias, W* y, int64_t N,
                        int64_t m0, int64_t rows, int64_t n0) {
  switch (rows) {
#define PANEL_CASE(r) \
  case r:             \
    return panel_rows<r>(panel, xt, ldx, K, bias, y, N, m0, n0);
    PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6) PANEL_CASE(7) PANEL_CASE(8)
#undef PANEL_CASE
  }
}

#if defined(__x86_64__)
// From 9 rows on, bfloat16 panels go through AMX tiles where the CPU has them: the same panels,
// read as tiles. A tile row holds 16 outputs' pairs along K (64 bytes), and a panel's pair rows are
// 48 outputs wide, so a tile is 16 pair rows (32 values of K) of one third of a panel, loaded with a
// stride of one panel row. x is read in tiles of 16 rows, padded with zero rows to a multiple of 16.
// One tile product (16 x 16 outputs over 32 of K) does what 32 vdpbf16ps do, so where the register
// blocks turn compute-bound (oneDNN overtook them from 12 rows on an Emerald Rapids Xeon) the tiles
// still wait on the weight: each panel comes from memory once, for its first 16 rows, and from L2
// for the rest. Products summed in float32 in the tile's own order, rounded once to bfloat16 as
// vcvtneps2bf16 rounds (to nearest even; results below bfloat16's normal range flush to zero).
constexpr int64_t kAmxMinRows = kPanelRows + 1;

// 16 rows of x (xa: [.., K] bfloat16, lda values apart) against one panel, over K (whole tiles); sums
// into out ([16][48] float32). Meanwhile it asks for `lines` cache lines of `ahead` per step of K
// into L2: the row blocks of one panel, spread over them, bring the next panel in while the tiles
// work on this one from L2 (the tile loads wait on memory otherwise). Tiles: tmm0-2 the sums, tmm3
// x, tmm4-6 the weight.
AMX_BF16 static void panel_tiles_amx(const bf16* panel, const bf16* xa, int64_t lda, int64_t K, float* out,
                                     const char* ahead, int64_t lines) {
  constexpr int64_t panel_row_bytes = 2 * kPanelWidth * sizeof(bf16);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t k = 0; k < K; k += kAmxTileDepth) {
    for (int64_t line = 0; line < lines; ++line, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
    const bf16* wk = panel + k * kPanelWidth;  // pair row k / 2
    _tile_loadd(3, xa + k, lda * sizeof(bf16));
    _tile_loadd(4, wk, panel_row_bytes);
    _tile_loadd(5, wk + 32, panel_row_bytes);
    _tile_loadd(6, wk + 64, panel_row_bytes);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  constexpr int64_t out_row_bytes = kPanelWidth * sizeof(float);
  _tile_stored(0, out, out_row_bytes);
  _tile_stored(1, out + 16, out_row_bytes);
  _tile_stored(2, out + 32, out_row_bytes);
}

// rows rows of sums (out, [16][48]) plus the bias into y's rows m0.., columns n0.. (fewer in the
// last panel), rounded to bfloat16.
AMX_BF16 static void store_tile_rows(const float* out, const bf16* bias, bf16* y, int64_t N, int64_t m0,
                                     int64_t rows, int64_t n0) {
  const int64_t width = std::min(kPanelWidth, N - n0);
  for (int64_t v = 0; v < kPanelVectors && 16 * v < width; ++v) {
    const int64_t lanes = std::min<int64_t>(16, width - 16 * v);
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n0 + 16 * v);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int64_t m = 0; m < rows; ++m) {
      const __m512 s = _mm512_add_ps(_mm512_loadu_ps(out + m * kPanelWidth + 16 * v), b);
      const __m256i r = (__m256i)_mm512_cvtneps_pbh(s);
      _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0 + 16 * v, mask, r);
    }
  }
}

// K past the last whole tile (K not a multiple of 32): those pairs added to `rows` rows of sums
// (out) as the register blocks add them.
AMX_BF16 static void panel_tail_amx(const bf16* panel, const bf16* xa, int64_t lda, int64_t k0, int64_t Kp,
                                    int64_t rows, float* out) {
  for (int64_t m = 0; m < rows; ++m) {
    __m512 acc[kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) acc[v] = _mm512_loadu_ps(out + m * kPanelWidth + 16 * v);
    for (int64_t k = k0; k < Kp; k += 2) {
      uint32_t pair;
      std::memcpy(&pair, xa + m * lda + k, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      const bf16* wk = panel + k * kPanelWidth;
      for (int v = 0; v < kPanelVectors; ++v) acc[v] = _mm512_dpbf16_ps(acc[v], xb, (__m512bh)_mm512_loadu_si512(wk + 32 * v));
    }
    for (int v = 0; v < kPanelVectors; ++v) _mm512_storeu_ps(out + m * kPanelWidth + 16 * v, acc[v]);
  }
}

// panel_gemm's bfloat16 rows through the tiles: x [M, K], ldr values between rows.
static void panel_gemm_amx(const bf16* xp, int64_t ldr, int64_t M, int64_t K, const bf16* pp, int64_t P,
                           const bf16* bp, bf16* yp, int64_t N) {
  thread_local std::vector<bf16> padded;
  const int64_t Mp = (M + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows, Kp = K + K % 2;
  const int64_t Kt = Kp / kAmxTileDepth * kAmxTileDepth;  // K in whole tiles
  const bf16* xa = xp;
  int64_t lda = ldr;
  if (Mp != M || Kp != K) {  // zero rows to fill the last tile; a zero to end an odd row's last pair
    padded.assign(Mp * Kp, bf16{});
    for (int64_t m = 0; m < M; ++m) std::memcpy(padded.data() + m * Kp, xp + m * ldr, K * sizeof(bf16));
    xa = padded.data();
    lda = Kp;
  }
  const int64_t panel_values = Kp * kPanelWidth, blocks = Mp / kAmxTileRows;
  const int64_t panel_lines = panel_values * sizeof(bf16) / 64, steps = std::max<int64_t>(1, Kt / kAmxTileDepth);
  const int64_t lines = (panel_lines + blocks * steps - 1) / (blocks * steps);
  parallel_guided(P, [&](int64_t p0, int64_t p1) {
    amx_configure();
    alignas(64) float out[kAmxTileRows * kPanelWidth];
    for (int64_t p = p0; p < p1; ++p) {
      const bf16* panel = pp + p * panel_values;
      const char* next = reinterpret_cast<const char*>(panel + panel_values);
      for (int64_t m0 = 0; m0 < M; m0 += kAmxTileRows) {
        const int64_t rows = std::min(kAmxTileRows, M - m0);
        const char* ahead = next + (m0 / kAmxTileRows) * steps * lines * 64;
        // the last panel asks for nothing past the weight
        panel_tiles_amx(panel, xa + m0 * lda, lda, Kt, out, ahead, p + 1 < P ? lines : 0);
        if (Kt < Kp) panel_tail_amx(panel, xa + m0 * lda, lda, Kt, Kp, rows, out);
        store_tile_rows(out, bp, yp, N, m0, rows, p * kPanelWidth);
      }
    }
    amx_release();
  });
}
#else
constexpr int64_t kAmxMinRows = 0;
static void panel_gemm_amx(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, const bf16*, bf16*,
                           int64_t) {}
#endif

// The kernel panel_gemm takes for bfloat16 rows from kAmxMinRows on ("amx" or "avx512_bf16"; ""
// where neither runs).
std::string panel_bf16_isa() { return cpu_has_amx_bf16() ? "amx" : (cpu_has_avx512_bf16() ? "avx512_bf16" : ""); }

// Whether panel_gemm runs on this CPU now for weights of this dtype.
bool panel_usable(bool bfloat16) { return bfloat16 ? cpu_has_avx512_bf16() : (cpu_has_avx512() || kPanelAvx2); }

// Which kernel panel_gemm takes now for float32 weights ("avx512" or "avx2"; "" where none).
std::string panel_isa() { return cpu_has_avx512() ? "avx512" : (kPanelAvx2 ? "avx2" : ""); }

// panels: cpu_kernels.pack_panels(weight): [P, K, 48] float32 or [P, ceil(K/2), 48, 2] bfloat16,
// outputs past N zero. N: the weight's rows.
torch::Tensor panel_gemm(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias) {
  check_rows(x, "panel_gemm");
  const bool bfloat16 = x.scalar_type() == at::kBFloat16;
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), K2 = (K + 1) / 2;
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == x.scalar_type() && P == (N + kPanelWidth - 1) / kPanelWidth,
              "panel_gemm: panels must be pack_panels(weight) of x's dtype for ", N, " outputs");
  TORCH_CHECK(bfloat16 ? (panels.dim() == 4 && panels.size(1) == K2 && panels.size(2) == kPanelWidth && panels.size(3) == 2)
                       : (panels.dim() == 3 && panels.size(1) == K && panels.size(2) == kPanelWidth),
              "panel_gemm: x has ", K, " columns, not the inputs its panels were packed for");
  if (bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(),
                "panel_gemm: bias of N values of x's dtype");
  TORCH_CHECK(panel_usable(bfloat16), "panel_gemm: needs AVX2 or AVX-512 (bfloat16: AVX512-BF16) on this CPU");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  if (bfloat16 && M >= kAmxMinRows && cpu_has_amx_bf16()) {
    panel_gemm_amx(x.data_ptr<bf16>(), x.stride(0), M, K, panels.data_ptr<bf16>(), P,
                   bias ? bias->data_ptr<bf16>() : nullptr, y.data_ptr<bf16>(), N);
    return y;
  }
  // x transposed ([K][M] float32, or [K/2][M] bfloat16 pairs): each k's rows side by side, so a
  // register block broadcasts them from one cache line.
  thread_local std::vector<uint32_t> scratch;
  const int64_t ldx = M, ldr = x.stride(0);
  scratch.assign((bfloat16 ? K2 : K) * M, 0u);
  dispatch(x, "panel_gemm", [&](auto tag) {
    using W = decltype(tag);
    const W* xp = x.data_ptr<W>();
    if constexpr (std::is_same_v<W, bf16>) {
      auto* half = reinterpret_cast<uint16_t*>(scratch.data());  // little-endian: k even in the low half
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) half[((k / 2) * ldx + m) * 2 + (k & 1)] = xp[m * ldr + k].x;
    } else {
      auto* xt = reinterpret_cast<float*>(scratch.data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xt[k * ldx + m] = xp[m * ldr + k];
    }
    const W* pp = panels.data_ptr<W>();
    const W* bp = bias ? bias->data_ptr<W>() : nullptr;
    W* yp = y.data_ptr<W>();
    const void* xt = scratch.data();
    const int64_t panel_values = bfloat16 ? K2 * 2 * kPanelWidth : K * kPanelWidth;
    // Row blocks of near-equal size (12 rows: two of 6, not 8 and 4).
    const int64_t blocks = (M + kPanelRows - 1) / kPanelRows;
    const bool avx2 = !cpu_has_avx512();
    parallel_guided(P, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<W, float>) {
          if (avx2) {
            panel_avx2(pp + p * panel_values, static_cast<const float*>(xt), M, K, bp, yp, N, p * kPanelWidth);
            continue;
          }
        }
#endif
        for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
          const int64_t rows = M / blocks + (b < M % blocks ? 1 : 0);
          panel_group<W>(pp + p * panel_values, xt, ldx, K, bp, yp, N, m0, rows, p * kPanelWidth);
          m0 += rows;
        }
      }
    });
  });
  return y;
}
