// Matmuls of a few to a few dozen rows on a weight packed in panels: y[M, N] = x[M, K] @ w[N, K]^T
// (+ bias): float32 on AVX-512 or AVX2, bfloat16 with AVX512-BF16 (AMX tiles from 9 rows) or on AVX2.
//
// The GEMV (gemv.cpp) sums along K and ends in a horizontal add per output: right for one row,
// compute-bound from a few rows on. Here the outputs run across the lanes instead. A panel holds
// kPanelWidth consecutive outputs (three vectors of 16), stored K-major ([K][48]), so one panel is
// one sequential stream: at each k the kernel loads the panel's three weight vectors once and
// multiplies them by up to kPanelRows rows of x, each broadcast from a transposed copy of x or
// from x's rows as stored (panel_reads_rows), in L1. Its 24 accumulators are independent FMA
// chains, enough to keep both FMA pipes busy with no reduction at the end; the weight is read from
// memory once a step and, for more rows than one register block holds, from L2 for the later
// blocks of the same panel.
//
// AVX2 has 16 vector registers of 8 lanes, so a panel is six vectors there and a register block
// two rows (12 accumulators, the two broadcasts and the weight vector being multiplied), and more
// rows take a panel in slices of K that stay in L1 while every pair of rows passes over them. The
// packing is the same, so one copy of the weight serves whichever path the CPU takes.
//
// bfloat16 panels keep pairs of neighbours along K together ([K/2][48][2]) so that one
// vdpbf16ps multiplies a pair of x's values, broadcast as one 32-bit lane, by 16 outputs' pairs:
// x and the weight as they are stored, products summed in float32, as oneDNN's bfloat16 matmul does.
// On AVX2 the same panels widen to float32 in registers (a shift and a mask per 32-bit lane), so
// a bfloat16 model decodes from half the bytes without AVX512-BF16.

constexpr int64_t kPanelVectors = 3;
constexpr int64_t kPanelWidth = 16 * kPanelVectors;  // outputs per panel (cpu_kernels.PANEL_WIDTH)
constexpr int64_t kPanelRows = 8;                    // rows of x per register block
constexpr int64_t kPanelPrefetchBytes = 4096;

template <int MR>
using PanelAcc = __m512[MR][kPanelVectors];

// Asks for a panel's line kPanelPrefetchBytes ahead of the reads. A panel that one register block
// reads (up to kPanelRows rows of x) is read once a step: asked for non-temporally, so that a
// decode step's weights, hundreds of MB read once each, do not evict from the caches what the host
// touches between the kernels. On a 2-core Zen 4, whole tokens in one process with the builds
// taking turns (medians of pairs, five runs): bfloat16 batch 1 0.89-0.99x the time of no prefetch,
// 8 rows 0.89x, float32 batch 1 0.96-1.01x and 8 rows 0.95x the time of prefetching into all
// levels (the embedding lookup, the final norm and the step's input tensors 2-2.5x faster between
// the kernels); bfloat16 prefetched into all levels had been 1.06x slower than none. Later register
// blocks of the same panel read it from L2.
static inline void prefetch_panel(const void* line, bool once) {
  if (once)
    _mm_prefetch(static_cast<const char*>(line), _MM_HINT_NTA);
  else
    _mm_prefetch(static_cast<const char*>(line), _MM_HINT_T0);
}

// One register block: MR rows of x against one panel, over all of K. x, offset to the block's first
// row: with Rows as stored (ldx values between rows), else transposed ([K][ldx], panel_transpose).
template <int MR, bool Rows>
AVX512 static inline void panel_block_f32(const float* panel, const float* x, int64_t ldx, int64_t K,
                                          PanelAcc<MR>& acc, bool once) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVectors; ++v) acc[m][v] = _mm512_setzero_ps();
  constexpr int64_t ahead = kPanelPrefetchBytes / sizeof(float);
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = panel + k * kPanelWidth;
    for (int v = 0; v < kPanelVectors; ++v) prefetch_panel(wk + ahead + 16 * v, once);
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32);
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(Rows ? x[m * ldx + k] : x[k * ldx + m]);
      acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xb, w2, acc[m][2]);
    }
  }
}

// One k of a bfloat16 panel (a pair row, wk) against MR rows' pairs of x (32-bit lanes).
template <int MR>
AVX512_BF16 static inline void panel_pair_bf16(const bf16* wk, const uint32_t* pairs, PanelAcc<MR>& acc, bool once) {
  constexpr int64_t ahead = kPanelPrefetchBytes / sizeof(bf16);
  for (int v = 0; v < kPanelVectors; ++v) prefetch_panel(wk + ahead + 32 * v, once);
  const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                 w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
  for (int m = 0; m < MR; ++m) {
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[m]));
    acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
    acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
    acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xb, w2);
  }
}

// bfloat16: each k of the panel is a pair of x's values, one 32-bit lane: of its row as stored
// (Rows), else of the transposed pairs ([K/2][ldx] lanes, panel_transpose). The last pair of an odd
// K ends in a zero. once: the panel is read by this block alone (prefetch_panel).
template <int MR, bool Rows>
AVX512_BF16 static inline void panel_block_bf16(const bf16* panel, const bf16* x, int64_t ldx, int64_t K,
                                                PanelAcc<MR>& acc, bool once) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVectors; ++v) acc[m][v] = _mm512_setzero_ps();
  const auto pair = [x, ldx](int m, int64_t k) { return Rows ? x + m * ldx + 2 * k : x + 2 * (k * ldx + m); };
  uint32_t pairs[MR];
  const int64_t whole = K / 2;
  for (int64_t k = 0; k < whole; ++k) {
    for (int m = 0; m < MR; ++m) std::memcpy(pairs + m, pair(m, k), sizeof(uint32_t));
    panel_pair_bf16<MR>(panel + k * 2 * kPanelWidth, pairs, acc, once);
  }
  if (K % 2) {  // the row's last value alone: nothing past it is read
    for (int m = 0; m < MR; ++m) pairs[m] = pair(m, whole)->x;
    panel_pair_bf16<MR>(panel + whole * 2 * kPanelWidth, pairs, acc, once);
  }
}

// Output n0 + j of a panel's sums (out) plus the bias, rounded once to W.
template <typename W>
__attribute__((always_inline)) static inline W panel_value(const float* out, const W* bias, int64_t n0, int64_t j) {
  return store<W>(bias ? out[j] + f32(bias[n0 + j]) : out[j]);
}

// One row of a panel's sums (out, kPanelWidth floats) into y_row's columns n0.. (fewer in the last
// panel), plus the bias, rounded once to W.
template <typename W>
__attribute__((always_inline)) static inline void store_panel_row(const float* out, const W* bias, W* y_row,
                                                                  int64_t N, int64_t n0) {
  const int64_t width = std::min(kPanelWidth, N - n0);
  for (int64_t j = 0; j < width; ++j) y_row[n0 + j] = panel_value(out, bias, n0, j);
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kPanelVectorsAvx2 = kPanelWidth / 8;
// A panel's rows per pass (96 values of K, or of bfloat16 pairs: 18 KB either way) stay in L1 while
// every pair of rows of x meets them, so only the first pair reads them from memory.
constexpr int64_t kPanelDepthAvx2 = 96;

// How far ahead of its reads a one-pass bfloat16 stream asks for the weight, with PREFETCHNTA (a
// hint to keep the stream out of the outer caches, where the step's host code lives). On a 2-core
// Zen 3, batch-1 bfloat16 decode took 0.92-0.94x the time with it (medians of per-round ratios, the
// variants alternating in one process; 1 to 2 KB ahead alike, 2.5 KB and more less; T0 as fast,
// with the host code after it slower), two rows 0.87x. float32 panels, whose FMAs take no
// widening, ran 1.05x slower with it and do without.
constexpr int64_t kStreamAheadBf16 = 2048;

// MR <= 2 rows of x (xt offset to the first) against k0..k1 of one panel, continuing the sums in
// acc_io ([MR][48]): the same FMAs in the same order as one pass over K. With more than one pass
// over a slice, pass `pass` of `passes` also asks for every passes-th row of the slice after it,
// into L2: over all the passes the next slice arrives while this one is computed on. With one pass
// (one or two rows of x) the panels are read once, in order, a stream the hardware prefetcher
// follows: asking for it too, 18 KB ahead, made one and two rows 1.04-1.13x slower on a Zen 4;
// bfloat16 asks for it just ahead (kStreamAheadBf16).
// bfloat16 panels: k counts pair rows, and each 32-bit lane's pair widens to float32 with a shift
// (the even value of K) and a mask (the odd one), each multiplied by its own value of x (xt holds
// 2 * K2 rows of K, the last zero for an odd K): products of bfloat16 values are exact in float32,
// summed in the order of K as the float32 panels sum them, and rounded once.
template <int MR, typename W>
static inline void panel_pass_avx2(const W* panel, const float* xt, int64_t ldx, int64_t k0, int64_t k1,
                                   float* acc_io, int64_t pass, int64_t passes) {
  constexpr bool pairs = std::is_same_v<W, bf16>;
  constexpr int64_t row_values = pairs ? 2 * kPanelWidth : kPanelWidth;  // a panel row is 192 bytes either way
  __m256 acc[MR][kPanelVectorsAvx2];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVectorsAvx2; ++v) acc[m][v] = _mm256_loadu_ps(acc_io + m * kPanelWidth + 8 * v);
  const W* next = panel + k1 * row_values;  // past a panel's end: the next panel, as stored
  int64_t due = k0 + pass;
  for (int64_t k = k0; k < k1; ++k) {
    const W* wk = panel + k * row_values;
    if (pairs && passes == 1)
      for (int line = 0; line < kPanelVectors; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kStreamAheadBf16 + 64 * line, _MM_HINT_NTA);
    if (passes > 1 && k == due) {
      due += passes;
      for (int line = 0; line < kPanelVectors; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + (k - k0) * row_values) + 64 * line, _MM_HINT_T1);
    }
    if constexpr (pairs) {
      __m256 xe[MR], xo[MR];
      for (int m = 0; m < MR; ++m)
        xe[m] = _mm256_broadcast_ss(xt + 2 * k * ldx + m), xo[m] = _mm256_broadcast_ss(xt + (2 * k + 1) * ldx + m);
      const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
      for (int v = 0; v < kPanelVectorsAvx2; ++v) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16 * v));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
        for (int m = 0; m < MR; ++m) {
          acc[m][v] = _mm256_fmadd_ps(xe[m], even, acc[m][v]);
          acc[m][v] = _mm256_fmadd_ps(xo[m], odd, acc[m][v]);
        }
      }
    } else {
      __m256 xb[MR];
      for (int m = 0; m < MR; ++m) xb[m] = _mm256_broadcast_ss(xt + k * ldx + m);
      for (int v = 0; v < kPanelVectorsAvx2; ++v) {
        const __m256 w = _mm256_loadu_ps(wk + 8 * v);
        for (int m = 0; m < MR; ++m) acc[m][v] = _mm256_fmadd_ps(xb[m], w, acc[m][v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVectorsAvx2; ++v) _mm256_storeu_ps(acc_io + m * kPanelWidth + 8 * v, acc[m][v]);
}

// All M rows of x against one panel on AVX2, whose 16 registers hold two rows' sums at a time. K:
// the panel's rows (pair rows for bfloat16); xt: x transposed, float32, [K][M] ([2K][M]).
template <typename W>
static void panel_avx2(const W* panel, const float* xt, int64_t M, int64_t K, const W* bias, W* y, int64_t N,
                       int64_t n0) {
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

// The block's outputs into y's rows m0.. (store_panel_row), or with y null into vals' rows m0..
// ([rows][kPanelWidth]) as the float32 values of what y would hold (panel_argmax).
template <int MR, typename W>
AVX512 static inline void panel_store(PanelAcc<MR>& acc, const W* bias, W* y, int64_t N, int64_t m0, int64_t n0,
                                      float* vals) {
  alignas(64) float out[kPanelWidth];
  const int64_t width = std::min(kPanelWidth, N - n0);
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kPanelVectors; ++v) _mm512_store_ps(out + 16 * v, acc[m][v]);
    if (y) {
      store_panel_row(out, bias, y + (m0 + m) * N, N, n0);
      continue;
    }
    for (int64_t j = 0; j < width; ++j) vals[(m0 + m) * kPanelWidth + j] = f32(panel_value(out, bias, n0, j));
  }
}

// One register block through the kernel of W's dtype (each compiled for only the ISA it needs).
// rows: x as stored (else transposed; see panel_reads_rows).
template <int MR>
AVX512 static void panel_rows(const float* panel, const void* x, int64_t ldx, int64_t K, const float* bias,
                              float* y, int64_t N, int64_t m0, int64_t n0, float* vals, bool rows, bool once) {
  PanelAcc<MR> acc;
  const float* xf = static_cast<const float*>(x);
  if (rows)
    panel_block_f32<MR, true>(panel, xf + m0 * ldx, ldx, K, acc, once);
  else
    panel_block_f32<MR, false>(panel, xf + m0, ldx, K, acc, once);
  panel_store<MR>(acc, bias, y, N, m0, n0, vals);
}

template <int MR>
AVX512_BF16 static void panel_rows(const bf16* panel, const void* x, int64_t ldx, int64_t K, const bf16* bias,
                                   bf16* y, int64_t N, int64_t m0, int64_t n0, float* vals, bool rows, bool once) {
  PanelAcc<MR> acc;
  const bf16* xb = static_cast<const bf16*>(x);
  if (rows)
    panel_block_bf16<MR, true>(panel, xb + m0 * ldx, ldx, K, acc, once);
  else
    panel_block_bf16<MR, false>(panel, xb + 2 * m0, ldx, K, acc, once);
  panel_store<MR>(acc, bias, y, N, m0, n0, vals);
}

template <typename W>
static void panel_group(const W* panel, const void* x, int64_t ldx, int64_t K, const W* bias, W* y, int64_t N,
                        int64_t m0, int64_t rows, int64_t n0, float* vals, bool as_stored, bool once) {
  switch (rows) {
#define PANEL_CASE(r) \
  case r:             \
    return panel_rows<r>(panel, x, ldx, K, bias, y, N, m0, n0, vals, as_stored, once);
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
// last panel), rounded to bfloat16; with y null, back into out as the float32 values of those
// bfloat16 (panel_argmax).
AMX_BF16 static void store_tile_rows(float* out, const bf16* bias, bf16* y, int64_t N, int64_t m0,
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
      if (y)
        _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0 + 16 * v, mask, r);
      else
        _mm512_storeu_ps(out + m * kPanelWidth + 16 * v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
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

// A thread's running argmax of each row of x over the outputs it has computed (panel_argmax): 16
// lanes a row of (largest value, its first column), as argmax_rows keeps them, and whether the row
// met a NaN. A thread takes its panels in increasing order, so a lane's first is the thread's first.
struct PanelArgmax {
  std::vector<float> best;
  std::vector<int32_t> where;
  std::vector<uint8_t> nan;
  explicit PanelArgmax(int64_t M)
      : best(M * 16, -std::numeric_limits<float>::infinity()), where(M * 16, 0), nan(M, 0) {}
};

// rows rows of one panel's outputs (vals, [rows][48] float32, `width` of them real, columns n0..)
// into the state's rows m0..
AVX512 static void panel_argmax_update(const float* vals, int64_t rows, int64_t width, int64_t n0, int64_t m0,
                                       PanelArgmax& s) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i first = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(n0)));
  for (int64_t m = 0; m < rows; ++m) {
    float* bp = s.best.data() + (m0 + m) * 16;
    int32_t* wp = s.where.data() + (m0 + m) * 16;
    __m512 best = _mm512_loadu_ps(bp);
    __m512i where = _mm512_loadu_si512(wp);
    __mmask16 nan = 0;
    for (int64_t v = 0; v < kPanelVectors && 16 * v < width; ++v) {
      const __mmask16 live = width - 16 * v >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - 16 * v)) - 1);
      const __m512 x = _mm512_mask_loadu_ps(lowest, live, vals + m * kPanelWidth + 16 * v);
      lane_argmax_step(x, _mm512_add_epi32(first, _mm512_set1_epi32(static_cast<int>(16 * v))), best, where, nan);
    }
    _mm512_storeu_ps(bp, best);
    _mm512_storeu_si512(wp, where);
    if (nan) s.nan[m0 + m] = 1;
  }
}

// Row m's answer from every thread's lanes: lane by lane the larger value, of equal ones the
// smaller column (another thread's panels may come first), then lane_argmax_result.
AVX512 static int64_t panel_argmax_row(const std::vector<PanelArgmax>& states, int64_t m) {
  __m512 best = _mm512_loadu_ps(states[0].best.data() + m * 16);
  __m512i where = _mm512_loadu_si512(states[0].where.data() + m * 16);
  for (size_t t = 1; t < states.size(); ++t) {
    const __m512 b = _mm512_loadu_ps(states[t].best.data() + m * 16);
    const __m512i w = _mm512_loadu_si512(states[t].where.data() + m * 16);
    const __mmask16 take = _mm512_cmp_ps_mask(b, best, _CMP_GT_OQ) |
                           (_mm512_cmp_ps_mask(b, best, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(w, where));
    best = _mm512_mask_mov_ps(best, take, b);
    where = _mm512_mask_mov_epi32(where, take, w);
  }
  return lane_argmax_result(best, where);
}

// panel_gemm's bfloat16 rows through the tiles: x [M, K], ldr values between rows; into yp, or with
// yp null into each thread's argmax (states, by thread number).
static void panel_gemm_amx(const bf16* xp, int64_t ldr, int64_t M, int64_t K, const bf16* pp, int64_t P,
                           const bf16* bp, bf16* yp, int64_t N, std::vector<PanelArgmax>* states) {
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
        if (!yp)
          panel_argmax_update(out, rows, std::min(kPanelWidth, N - p * kPanelWidth), p * kPanelWidth, m0,
                              (*states)[at::get_thread_num()]);
      }
    }
    amx_release();
  });
}
#else
constexpr int64_t kAmxMinRows = 0;
static void panel_gemm_amx(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, const bf16*, bf16*,
                           int64_t, std::vector<PanelArgmax>*) {}
#endif

// The kernel panel_gemm takes for bfloat16 rows from kAmxMinRows on ("amx", "avx512_bf16" or "avx2"; ""
// where neither runs).
std::string panel_bf16_isa() {
  if (cpu_has_amx_bf16()) return "amx";
  if (cpu_has_avx512_bf16()) return "avx512_bf16";
  return !cpu_has_avx512() && kPanelAvx2 ? "avx2" : "";
}

// Whether panel_gemm runs on this CPU now for weights of this dtype: float32 on AVX-512 or AVX2;
// bfloat16 with AVX512-BF16, or widened on AVX2 (not on AVX-512 without BF16, which takes the GEMV).
bool panel_usable(bool bfloat16) { return bfloat16 ? !panel_bf16_isa().empty() : (cpu_has_avx512() || kPanelAvx2); }

// Whether panel_argmax does (AVX-512: not the float32 AVX2 path).
bool panel_argmax_usable(bool bfloat16) { return bfloat16 ? cpu_has_avx512_bf16() : cpu_has_avx512(); }

// Which kernel panel_gemm takes now for float32 weights ("avx512" or "avx2"; "" where none).
std::string panel_isa() { return cpu_has_avx512() ? "avx512" : (kPanelAvx2 ? "avx2" : ""); }

// Whether the panels read M rows of x as stored rather than a transposed copy: on AVX-512, rows
// in more than one register block. Each block's rows then stay in L1 (8 rows of 576 float32 are
// 18 KB) and its broadcasts come from them, where the copy, written by both threads before every
// matmul and read back from L2, took longer on a 2-core Zen 4 (the embedded model's float32 decode
// steps in one process, the builds taking turns step by step: 16 rows 0.82x the time as stored,
// 64 rows 0.975x); one block (the kernel alone, streaming the weight: 4 and 5 rows 1.04-1.08x the
// time as stored, 1, 2, 3, 6 and 8 within 0.95-1.02x) keeps the copy, but for one row, which is its
// own transpose ([K][1]): read as stored, a batch-1 decode step writes no copy before each matmul.
bool panel_reads_rows(int64_t M) { return cpu_has_avx512() && (M == 1 || M > kPanelRows); }

// x's M rows (ldr values apart) transposed, each k's rows side by side, so a register block
// broadcasts them from one cache line: [K][M] float32; bfloat16 on AVX-512 [K/2][M] pairs as 32-bit
// lanes, on AVX2 widened to [2 * K2][M] float32 (panel_avx2 reads float32 whatever the dtype).
// panel_transpose_size 32-bit values.
template <typename W>
static int64_t panel_transpose_size(int64_t M, int64_t K) {
  const int64_t K2 = (K + 1) / 2;
  if constexpr (std::is_same_v<W, bf16>) return (cpu_has_avx512() ? K2 : 2 * K2) * M;
  return K * M;
}

// Rows m0..m1 of that into xt, the padding past an odd K zeroed: the rows of one matrix can be
// written by several threads at once. k by k, so the lines of the rows read stay in L1.
template <typename W>
static void panel_transpose_rows(const W* xp, int64_t ldr, int64_t M, int64_t K, int64_t m0, int64_t m1,
                                 uint32_t* xt) {
  if constexpr (std::is_same_v<W, bf16>) {
    if (cpu_has_avx512()) {  // a pair of neighbours along K as one lane (little-endian: k even low)
      for (int64_t k2 = 0; k2 < K / 2; ++k2)
        for (int64_t m = m0; m < m1; ++m) std::memcpy(xt + k2 * M + m, xp + m * ldr + 2 * k2, sizeof(uint32_t));
      if (K % 2)
        for (int64_t m = m0; m < m1; ++m) xt[(K / 2) * M + m] = xp[m * ldr + K - 1].x;
      return;
    }
  }
  auto* out = reinterpret_cast<float*>(xt);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = m0; m < m1; ++m) out[k * M + m] = f32(xp[m * ldr + k]);
  if (std::is_same_v<W, bf16> && K % 2)  // the widened pairs' last k
    for (int64_t m = m0; m < m1; ++m) out[K * M + m] = 0.f;
}

template <typename W>
static void panel_transpose(const W* xp, int64_t ldr, int64_t M, int64_t K, std::vector<uint32_t>& scratch) {
  scratch.resize(panel_transpose_size<W>(M, K));
  panel_transpose_rows(xp, ldr, M, K, 0, M, scratch.data());
}

// Panels p0..p1 of a weight (pp: pack_panels(weight), K inputs, N outputs, bias bp or null) against
// M rows of x: as stored, ldx values apart, where panel_reads_rows(M), else as panel_transpose leaves
// them (ldx unused): into yp ([M, N]), or with yp null into state (panel_argmax).
template <typename W>
static void panel_range(const W* pp, const void* x, int64_t ldx, int64_t M, int64_t K, const W* bp, W* yp,
                        int64_t N, int64_t p0, int64_t p1, PanelArgmax* state) {
  constexpr bool bfloat16 = std::is_same_v<W, bf16>;
  const int64_t K2 = (K + 1) / 2;
  const int64_t panel_values = bfloat16 ? K2 * 2 * kPanelWidth : K * kPanelWidth;
  // Row blocks of near-equal size (12 rows: two of 6, not 8 and 4).
  const int64_t blocks = (M + kPanelRows - 1) / kPanelRows;
  const bool avx2 = !cpu_has_avx512();
  const bool once = blocks == 1, as_stored = panel_reads_rows(M);
  if (!as_stored) ldx = M;
  thread_local std::vector<float> vals;  // the panel's outputs for the argmax: [M][48]
  if (!yp) vals.resize(M * kPanelWidth);
  for (int64_t p = p0; p < p1; ++p) {
#if defined(__AVX2__) && defined(__FMA__)
    if (avx2) {
      panel_avx2(pp + p * panel_values, static_cast<const float*>(x), M, bfloat16 ? K2 : K, bp, yp, N,
                 p * kPanelWidth);
      continue;
    }
#endif
    for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
      const int64_t rows = M / blocks + (b < M % blocks ? 1 : 0);
      panel_group<W>(pp + p * panel_values, x, ldx, K, bp, yp, N, m0, rows, p * kPanelWidth, vals.data(),
                     as_stored, once);
      m0 += rows;
    }
    if (!yp) panel_argmax_update(vals.data(), M, std::min(kPanelWidth, N - p * kPanelWidth), p * kPanelWidth, 0, *state);
  }
}

// panels (and bias, or null) are what panel_range needs for N outputs of K inputs in dtype.
static void check_panels(at::ScalarType dtype, int64_t K, const torch::Tensor& panels, int64_t N,
                         const torch::Tensor* bias, const char* name) {
  const int64_t P = (N + kPanelWidth - 1) / kPanelWidth, K2 = (K + 1) / 2;
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == dtype && N > 0 && panels.size(0) >= P,
              name, ": panels must be pack_panels(weight) of x's dtype for at least ", N, " outputs");
  TORCH_CHECK(dtype == at::kBFloat16
                  ? (panels.dim() == 4 && panels.size(1) == K2 && panels.size(2) == kPanelWidth && panels.size(3) == 2)
                  : (panels.dim() == 3 && panels.size(1) == K && panels.size(2) == kPanelWidth),
              name, ": x has ", K, " columns, not the inputs its panels were packed for");
  if (bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() >= N && bias->scalar_type() == dtype,
                name, ": bias of at least N values of x's dtype");
}

// x's rows against the first N outputs of the panels (cpu_kernels.pack_panels(weight): [P, K, 48]
// float32 or [P, ceil(K/2), 48, 2] bfloat16, outputs past the weight's rows zero) plus the bias:
// into y ([M, N], rounded once to x's dtype), or with y null into each thread's argmax (states).
static void panel_run(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                      const c10::optional<torch::Tensor>& bias, torch::Tensor* y, std::vector<PanelArgmax>* states,
                      const char* name) {
  check_rows(x, name);
  const bool bfloat16 = x.scalar_type() == at::kBFloat16;
  const int64_t M = x.size(0), K = x.size(1), P = (N + kPanelWidth - 1) / kPanelWidth;
  check_panels(x.scalar_type(), K, panels, N, bias ? &*bias : nullptr, name);
  if (M == 0) return;
  if (bfloat16 && M >= kAmxMinRows && cpu_has_amx_bf16()) {
    panel_gemm_amx(x.data_ptr<bf16>(), x.stride(0), M, K, panels.data_ptr<bf16>(), P,
                   bias ? bias->data_ptr<bf16>() : nullptr, y ? y->data_ptr<bf16>() : nullptr, N, states);
    return;
  }
  thread_local std::vector<uint32_t> scratch;
  dispatch(x, name, [&](auto tag) {
    using W = decltype(tag);
    const void* xr = x.data_ptr<W>();
    if (!panel_reads_rows(M)) {
      panel_transpose(x.data_ptr<W>(), x.stride(0), M, K, scratch);
      xr = scratch.data();  // the caller's: the workers' thread_local scratch is their own
    }
    const W* pp = panels.data_ptr<W>();
    const W* bp = bias ? bias->data_ptr<W>() : nullptr;
    W* yp = y ? y->data_ptr<W>() : nullptr;
    parallel_guided(P, [&](int64_t p0, int64_t p1) {
      panel_range(pp, xr, x.stride(0), M, K, bp, yp, N, p0, p1, states ? &(*states)[at::get_thread_num()] : nullptr);
    });
  });
}

// F.linear(x, weight, bias) for N = the weight's rows (panels: pack_panels(weight)).
torch::Tensor panel_gemm(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(panel_usable(x.scalar_type() == at::kBFloat16),
              "panel_gemm: needs AVX2 or AVX-512 (bfloat16: AVX512-BF16) on this CPU");
  auto y = torch::empty({x.size(0), N}, x.options());
  panel_run(x, panels, N, bias, &y, nullptr, "panel_gemm");
  return y;
}

// Per row of x, the index of the largest of its first N outputs, as argmax_rows(panel_gemm(x, panels,
// N, bias)) finds it (the outputs rounded as panel_gemm rounds them; the first of equal maxima),
// without writing the [M, N] outputs: a greedy decode step's LM head, whose 64 x 49,152 bfloat16
// logits panel_gemm writes to memory (6 MB, a row's 48 columns at a time) and argmax_rows reads
// back, here compared while a panel's outputs are in L1. Rows that meet a NaN take argmax_rows of
// panel_gemm's outputs (their first NaN). N may be fewer than the panels' outputs (a padded
// vocabulary).
torch::Tensor panel_argmax(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(panel_argmax_usable(x.scalar_type() == at::kBFloat16),
              "panel_argmax: needs AVX-512 (bfloat16: AVX512-BF16) on this CPU");
  TORCH_CHECK(N < (int64_t{1} << 31), "panel_argmax: at most 2^31 - 1 outputs");
  const int64_t M = x.size(0);
  std::vector<PanelArgmax> states(at::get_num_threads(), PanelArgmax(M));
  panel_run(x, panels, N, bias, nullptr, &states, "panel_argmax");
  auto out = torch::empty({M}, x.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  torch::Tensor again;  // the outputs, for rows with a NaN
  for (int64_t m = 0; m < M; ++m) {
    bool nan = false;
    for (const auto& s : states) nan = nan || s.nan[m];
    if (!nan) {
      op[m] = panel_argmax_row(states, m);
      continue;
    }
    if (!again.defined()) again = panel_gemm(x, panels, N, bias);  // all rows: the same kernel, the same sums
    op[m] = argmax_rows(again.slice(0, m, m + 1)).item<int64_t>();
  }
  return out;
}
