// Causal attention of fresh prompts (nothing cached), float32 on AVX2 CPUs and bfloat16 on AMX
// (prefill_amx below): n prompts of equal length L packed back to back, q [n*L, H, D], k and v [n*L, KVH, D] (rows
// strided, each its own stride: column slices of the QKV output, or k normed into a tensor of its own as Qwen3's
// are), grouped-query heads read their KV head's rows. PyTorch's flash
// attention on CPU multiplies 64-row blocks of each head through BLAS calls and rescales an online
// softmax; here each tile of six positions of one head takes its scores against exactly the keys it
// sees, in registers (six rows x sixteen keys), then an exact softmax over them and the weighted sum
// of the values (three rows x 32 columns). On a 2-core Zen 4 without AVX-512 this is 1.9x faster
// than F.scaled_dot_product_attention on the embedded model's 256-token prompts
// (benchmarks/prefill_attention.py).
//
// Compiled together with cpu_kernels.cpp (exp_approx, cpu_has_avx512, parallel_chunks) and amx.cpp
// (cpu_has_amx_bf16, amx_configure).

namespace prefill {

constexpr int64_t kRows = 6;   // positions of one head per tile
constexpr int64_t kKeys = 16;  // keys per score block: two vectors
constexpr int64_t kPvRows = 3;  // rows per block of the weighted sum

#if defined(__AVX2__) && defined(__FMA__)
// s[r][j] = q_r . k_j for j < jn (a multiple of kKeys; kt is zero past the prompt), from kt: the
// head's keys transposed, [D][Lp]. Twelve named accumulators: as an array GCC kept them in memory.
static inline void scores(const float* q, int64_t q_stride, int64_t rows, const float* kt, int64_t Lp, int64_t D,
                          int64_t jn, float* s) {
  const float* qr[kRows];
  for (int64_t r = 0; r < kRows; ++r) qr[r] = q + std::min(r, rows - 1) * q_stride;  // spare rows repeat the last
  const float *q0 = qr[0], *q1 = qr[1], *q2 = qr[2], *q3 = qr[3], *q4 = qr[4], *q5 = qr[5];
  for (int64_t j = 0; j < jn; j += kKeys) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float* kd = kt + j;
    for (int64_t d = 0; d < D; ++d, kd += Lp) {
      const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8);
      __m256 x = _mm256_broadcast_ss(q0 + d);
      a00 = _mm256_fmadd_ps(x, k0, a00), a01 = _mm256_fmadd_ps(x, k1, a01);
      x = _mm256_broadcast_ss(q1 + d);
      a10 = _mm256_fmadd_ps(x, k0, a10), a11 = _mm256_fmadd_ps(x, k1, a11);
      x = _mm256_broadcast_ss(q2 + d);
      a20 = _mm256_fmadd_ps(x, k0, a20), a21 = _mm256_fmadd_ps(x, k1, a21);
      x = _mm256_broadcast_ss(q3 + d);
      a30 = _mm256_fmadd_ps(x, k0, a30), a31 = _mm256_fmadd_ps(x, k1, a31);
      x = _mm256_broadcast_ss(q4 + d);
      a40 = _mm256_fmadd_ps(x, k0, a40), a41 = _mm256_fmadd_ps(x, k1, a41);
      x = _mm256_broadcast_ss(q5 + d);
      a50 = _mm256_fmadd_ps(x, k0, a50), a51 = _mm256_fmadd_ps(x, k1, a51);
    }
    const __m256 acc[kRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    for (int64_t r = 0; r < rows; ++r) {
      _mm256_storeu_ps(s + r * Lp + j, acc[r][0]);
      _mm256_storeu_ps(s + r * Lp + j + 8, acc[r][1]);
    }
  }
}

// o_r[0, 32) = inv_sum[r] * sum over j < jn of p_r[j] * v_j[0, 32) for `rows` (<= 3) rows.
static inline void weighted_sum32(const float* p, int64_t Lp, int64_t rows, const float* v, int64_t v_stride,
                                  int64_t jn, float* o, int64_t o_stride, const float* inv_sum) {
  const float* p0 = p;
  const float* p1 = p + std::min<int64_t>(1, rows - 1) * Lp;
  const float* p2 = p + std::min<int64_t>(2, rows - 1) * Lp;
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  for (int64_t j = 0; j < jn; ++j, v += v_stride) {
    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                 v3 = _mm256_loadu_ps(v + 24);
    __m256 w = _mm256_broadcast_ss(p0 + j);
    a00 = _mm256_fmadd_ps(w, v0, a00), a01 = _mm256_fmadd_ps(w, v1, a01);
    a02 = _mm256_fmadd_ps(w, v2, a02), a03 = _mm256_fmadd_ps(w, v3, a03);
    w = _mm256_broadcast_ss(p1 + j);
    a10 = _mm256_fmadd_ps(w, v0, a10), a11 = _mm256_fmadd_ps(w, v1, a11);
    a12 = _mm256_fmadd_ps(w, v2, a12), a13 = _mm256_fmadd_ps(w, v3, a13);
    w = _mm256_broadcast_ss(p2 + j);
    a20 = _mm256_fmadd_ps(w, v0, a20), a21 = _mm256_fmadd_ps(w, v1, a21);
    a22 = _mm256_fmadd_ps(w, v2, a22), a23 = _mm256_fmadd_ps(w, v3, a23);
  }
  const __m256 acc[kPvRows][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 scale = _mm256_set1_ps(inv_sum[r]);
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o + r * o_stride + 8 * c, _mm256_mul_ps(acc[r][c], scale));
  }
}

// The same for eight columns (head sizes that are not a multiple of 32).
static inline void weighted_sum8(const float* p, int64_t Lp, int64_t rows, const float* v, int64_t v_stride,
                                 int64_t jn, float* o, int64_t o_stride, const float* inv_sum) {
  const float* p1 = p + std::min<int64_t>(1, rows - 1) * Lp;
  const float* p2 = p + std::min<int64_t>(2, rows - 1) * Lp;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0;
  for (int64_t j = 0; j < jn; ++j, v += v_stride) {
    const __m256 x = _mm256_loadu_ps(v);
    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), x, a0);
    a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + j), x, a1);
    a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(p2 + j), x, a2);
  }
  const __m256 acc[kPvRows] = {a0, a1, a2};
  for (int64_t r = 0; r < rows; ++r) _mm256_storeu_ps(o + r * o_stride, _mm256_mul_ps(acc[r], _mm256_set1_ps(inv_sum[r])));
}

// exp_approx (cpu_kernels.cpp) on eight lanes: the same clamp, split of ln 2 and polynomial.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Row r of the tile (scores s, keys 0..valid-1 seen) -> unnormalised probabilities exp((s - max) *
// scale), zero from valid up to jn (the keys the tile's weighted sums run over); returns 1 / their sum.
static inline float softmax_row(float* s, int64_t valid, int64_t jn, float scale) {
  __m256 mx8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= valid; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx8);
  float mx = lanes[0];
  for (int t = 1; t < 8; ++t) mx = std::max(mx, lanes[t]);
  for (; j < valid; ++j) mx = std::max(mx, s[j]);
  const __m256 m = _mm256_set1_ps(mx), sc = _mm256_set1_ps(scale);
  __m256 sum8 = _mm256_setzero_ps();
  for (j = 0; j + 8 <= valid; j += 8) {
    const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), m), sc));
    _mm256_storeu_ps(s + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  _mm256_store_ps(lanes, sum8);
  float sum = 0.f;
  for (int t = 0; t < 8; ++t) sum += lanes[t];
  for (; j < valid; ++j) {
    s[j] = exp_approx((s[j] - mx) * scale);
    sum += s[j];
  }
  for (; j < jn; ++j) s[j] = 0.f;
  return 1.f / sum;
}
#endif

}  // namespace prefill

#if defined(__x86_64__)
// ---- bfloat16 prompts on AMX tiles -------------------------------------------------------------------
// PyTorch's flash attention on CPU multiplies a bfloat16 prompt's blocks through BLAS calls (3.5 ms a
// layer for eight 256-token prompts of SmolLM2-135M here, ~170 GFLOP/s). Here a task is 16 positions
// of one query head: their scores against every key they see, 16 keys a tile product (the queries
// loaded as A tiles straight from the QKV output, the keys packed once per prompt and KV head as B
// tiles), an exact softmax in float32 over the whole row (a prompt is at most kMaxPromptLength
// tokens, so a row of scores stays in L2), the probabilities rounded to bfloat16 as PyTorch's kernel
// rounds them, and their weighted sum of the values, 32 keys a tile product, the values packed as
// B tiles too. The row's 1 / sum scales the output once.
namespace prefill_amx {

constexpr int64_t kTile = kAmxTileRows * kAmxTileDepth;  // bfloat16 values of a tile
constexpr int64_t kOutTiles = 4;  // sum tiles of the weighted values at once (64 columns)

// One prompt's KV head: keys as the scores' B tiles, [key block of 16][slice of 32 values][pair
// row][key][2], and values as the weighted sum's, [slice of 32 keys][block of 16 values][key pair
// row][value][2]; zero past the prompt's L keys.
AMX_BF16 static void pack_head(const bf16* k, int64_t ks, const bf16* v, int64_t vs, int64_t L, int64_t D,
                               bf16* kt, bf16* vt) {
  const int64_t NC = D / kAmxTileDepth, ND = D / kAmxTileRows;
  if (L % kAmxTileRows) std::memset(kt + (L - 1) / kAmxTileRows * NC * kTile, 0, NC * kTile * sizeof(bf16));
  if (L % kAmxTileDepth) std::memset(vt + (L - 1) / kAmxTileDepth * ND * kTile, 0, ND * kTile * sizeof(bf16));
  // A key is D / 2 pairs of values (32-bit words), which its block's tiles hold as a column.
  for (int64_t j = 0; j < L; ++j) {
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(k + j * ks);
    uint32_t* kb = reinterpret_cast<uint32_t*>(kt + j / kAmxTileRows * NC * kTile) + j % kAmxTileRows;
    for (int64_t w = 0; w < D / 2; ++w) kb[w / 16 * (kTile / 2) + w % 16 * 16] = kr[w];
  }
  // A pair row of values: keys j and j + 1 interleaved value by value.
  static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_loadu_si512(interleave);
  for (int64_t j = 0; j < L; j += 2)
    for (int64_t db = 0; db < ND; ++db) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j * vs + db * 16));
      const __m256i b = j + 1 < L ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (j + 1) * vs + db * 16))
                                  : _mm256_setzero_si256();
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(vt + (j / kAmxTileDepth * ND + db) * kTile + j % kAmxTileDepth / 2 * 32,
                          _mm512_permutexvar_epi16(order, ab));
    }
}

// Scores of 16 positions (q: A tiles, row stride lda bytes) against key blocks 0..blocks-1 into
// s [16][ls] float32. Tiles: 0 the sums, 1-NC the queries, 5-6 the keys.
template <int NC>
AMX_BF16 static void scores(const bf16* q, int64_t lda, const bf16* kt, int64_t blocks, float* s, int64_t ls) {
  _tile_loadd(1, q, lda);
  if constexpr (NC >= 2) _tile_loadd(2, q + kAmxTileDepth, lda);
  if constexpr (NC >= 3) _tile_loadd(3, q + 2 * kAmxTileDepth, lda);
  if constexpr (NC >= 4) _tile_loadd(4, q + 3 * kAmxTileDepth, lda);
  for (int64_t jb = 0; jb < blocks; ++jb) {
    const bf16* kb = kt + jb * NC * kTile;
    _tile_zero(0);
    _tile_loadd(5, kb, 64);
    _tile_dpbf16ps(0, 1, 5);
    if constexpr (NC >= 2) { _tile_loadd(6, kb + kTile, 64); _tile_dpbf16ps(0, 2, 6); }
    if constexpr (NC >= 3) { _tile_loadd(5, kb + 2 * kTile, 64); _tile_dpbf16ps(0, 3, 5); }
    if constexpr (NC >= 4) { _tile_loadd(6, kb + 3 * kTile, 64); _tile_dpbf16ps(0, 4, 6); }
    _tile_stored(0, s + jb * kAmxTileRows, ls * sizeof(float));
  }
}

// Weighted sums of the values (p: [16][lp] bfloat16 probabilities, zero past each row's keys) over
// key slices 0..slices-1, N blocks of 16 value columns from block `first` on, into o [16][ld].
// Tiles: 0-3 the sums, 4 the probabilities, 5-6 the values.
template <int N>
AMX_BF16 static void weighted_values(const bf16* p, int64_t lp, const bf16* vt, int64_t ND, int64_t first,
                                     int64_t slices, float* o, int64_t ld) {
  _tile_zero(0);
  if constexpr (N >= 2) _tile_zero(1);
  if constexpr (N >= 3) _tile_zero(2);
  if constexpr (N >= 4) _tile_zero(3);
  for (int64_t kb = 0; kb < slices; ++kb) {
    const bf16* vb = vt + (kb * ND + first) * kTile;
    _tile_loadd(4, p + kb * kAmxTileDepth, lp * sizeof(bf16));
    _tile_loadd(5, vb, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (N >= 2) { _tile_loadd(6, vb + kTile, 64); _tile_dpbf16ps(1, 4, 6); }
    if constexpr (N >= 3) { _tile_loadd(5, vb + 2 * kTile, 64); _tile_dpbf16ps(2, 4, 5); }
    if constexpr (N >= 4) { _tile_loadd(6, vb + 3 * kTile, 64); _tile_dpbf16ps(3, 4, 6); }
  }
  float* oc = o + first * kAmxTileRows;
  _tile_stored(0, oc, ld * sizeof(float));
  if constexpr (N >= 2) _tile_stored(1, oc + kAmxTileRows, ld * sizeof(float));
  if constexpr (N >= 3) _tile_stored(2, oc + 2 * kAmxTileRows, ld * sizeof(float));
  if constexpr (N >= 4) _tile_stored(3, oc + 3 * kAmxTileRows, ld * sizeof(float));
}

// The lanes of 16 values from j on that are below `valid`.
static inline __mmask16 lanes_below(int64_t j, int64_t valid) {
  return j + 16 <= valid ? __mmask16(0xFFFF) : (j < valid ? __mmask16((1u << (valid - j)) - 1) : __mmask16(0));
}

// Row r of the scores (keys 0..valid-1 seen, s readable up to width) -> its probabilities
// exp((s - max) * scale) rounded to bfloat16 in p, zero from valid up to width (a multiple of 16);
// returns 1 / the sum of the unrounded ones. Written with intrinsics: GCC left the maximum's loop scalar.
AMX_BF16 static float softmax_row(const float* s, int64_t valid, int64_t width, float scale, bf16* p) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < valid; j += 16) {
    const __mmask16 m = lanes_below(j, valid);
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + j));
  }
  // exp((s - max) * scale) = 2^(s * c - max * c), c = scale * log2(e)
  const float c = scale * 1.44269504088896341f;
  const __m512 cs = _mm512_set1_ps(c), top = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * c);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 m = lanes_below(j, valid);
    const __m512 e = _mm512_maskz_mov_ps(m, exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), cs, top)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// Rows 0..rows-1 of o [rows][D] times their 1 / sum, rounded to bfloat16, to out (row stride ld).
AMX_BF16 static void store_rows(const float* o, const float* inv_sum, int64_t rows, int64_t D, bf16* out, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(inv_sum[r]);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ld + d), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

template <int NC>
AMX_BF16 static void attend(const bf16* qp, int64_t qs, const bf16* kp, int64_t ks, const bf16* vp, int64_t vs,
                            bf16* op, int64_t n, int64_t L, int64_t H, int64_t KVH) {
  constexpr int64_t D = NC * kAmxTileDepth, ND = D / kAmxTileRows;
  const int64_t G = H / KVH, blocks = (L + kAmxTileRows - 1) / kAmxTileRows;
  const int64_t Lk = blocks * kAmxTileRows, Lv = (L + kAmxTileDepth - 1) / kAmxTileDepth * kAmxTileDepth;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto packed = torch::empty({n * KVH * (Lk + Lv) * D}, torch::kBFloat16);
  bf16* kt = packed.data_ptr<bf16>();
  bf16* vt = kt + n * KVH * Lk * D;
  parallel_chunks(n * KVH, [&](int64_t begin, int64_t end) {
    for (int64_t sg = begin; sg < end; ++sg) {
      const int64_t s = sg / KVH, g = sg % KVH;
      pack_head(kp + s * L * ks + g * D, ks, vp + s * L * vs + g * D, vs, L, D, kt + sg * Lk * D, vt + sg * Lv * D);
    }
  });
  // Tasks: 16 positions of one head, the last blocks of every prompt first (they see the most keys),
  // so that the threads' last chunks are the short ones.
  parallel_chunks(n * H * blocks, [&](int64_t begin, int64_t end) {
    amx_configure();
    std::vector<float> sc(kAmxTileRows * Lv), ob(kAmxTileRows * D);  // rows of Lv: softmax_row reads to `width`
    std::unique_ptr<bf16[]> pb(new bf16[kAmxTileRows * Lv]), qa(new bf16[kAmxTileRows * D]);  // written before read
    float inv_sum[kAmxTileRows];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t qb = blocks - 1 - item / (n * H), s = item % (n * H) / H, h = item % H, g = h / G;
      const int64_t i0 = qb * kAmxTileRows, rows = std::min(kAmxTileRows, L - i0);
      const bf16* q = qp + (s * L + i0) * qs + h * D;
      int64_t lda = qs * sizeof(bf16);
      if (rows < kAmxTileRows) {  // the prompt's last, partial block: its rows and zeros, as whole tiles
        std::fill(qa.get(), qa.get() + kAmxTileRows * D, bf16{});
        for (int64_t r = 0; r < rows; ++r) std::copy(q + r * qs, q + r * qs + D, qa.get() + r * D);
        q = qa.get(), lda = D * sizeof(bf16);
      }
      const int64_t sg = s * KVH + g, seen = i0 + rows;
      scores<NC>(q, lda, kt + sg * Lk * D, qb + 1, sc.data(), Lv);
      const int64_t width = (seen + kAmxTileDepth - 1) / kAmxTileDepth * kAmxTileDepth;
      for (int64_t r = 0; r < kAmxTileRows; ++r) {
        if (r < rows) inv_sum[r] = softmax_row(sc.data() + r * Lv, i0 + r + 1, width, scale, pb.get() + r * Lv);
        else std::fill(pb.get() + r * Lv, pb.get() + r * Lv + width, bf16{});
      }
      const bf16* vh = vt + sg * Lv * D;
      for (int64_t first = 0; first < ND; first += kOutTiles) {
        switch (std::min(kOutTiles, ND - first)) {
          case 1: weighted_values<1>(pb.get(), Lv, vh, ND, first, width / kAmxTileDepth, ob.data(), D); break;
          case 2: weighted_values<2>(pb.get(), Lv, vh, ND, first, width / kAmxTileDepth, ob.data(), D); break;
          case 3: weighted_values<3>(pb.get(), Lv, vh, ND, first, width / kAmxTileDepth, ob.data(), D); break;
          default: weighted_values<4>(pb.get(), Lv, vh, ND, first, width / kAmxTileDepth, ob.data(), D); break;
        }
      }
      store_rows(ob.data(), inv_sum, rows, D, op + ((s * L + i0) * H + h) * D, H * D);
    }
    amx_release();
  });
}

}  // namespace prefill_amx
#endif

// Prompts up to this long: at 4,096 tokens a KV head's transposed keys (1 MB at head size 64) no
// longer stay in L2 and PyTorch's kernel, which takes 256-row blocks from 768 tokens on, is 1.4x
// faster (1.03x slower at 2,048; benchmarks/prefill_attention.py).
constexpr int64_t kMaxPromptLength = 2048;

// Whether prefill_causal takes q ([n * L, heads, head_dim]) of n prompts here: float32 built with
// AVX2 and FMA, head size a multiple of 8, except on Intel CPUs with AVX-512, where PyTorch's own
// kernel takes its AVX-512 path at full width and this was not measured against it (on a Zen 4 with
// AVX-512 this ran 2.0-2.6x SDPA's speed up to 512 tokens, 1.03x at 2,048); bfloat16 where the CPU has AMX-BF16,
// head size 32, 64, 96 or 128. Prompts up to kMaxPromptLength tokens either way.
bool prefill_causal_usable(const torch::Tensor& q, int64_t n) {
  if (q.dim() != 3 || n <= 0 || q.size(0) % n != 0 || q.size(0) / n > kMaxPromptLength) return false;
  const int64_t D = q.size(2);
  if (q.scalar_type() == at::kBFloat16) return cpu_has_amx_bf16() && D % kAmxTileDepth == 0 && D <= 128 && D > 0;
#if defined(__AVX2__) && defined(__FMA__)
  return q.scalar_type() == at::kFloat && D % 8 == 0 && !(cpu_has_avx512() && cpu_is_intel());
#else
  return false;
#endif
}

// Into out: [n * L, heads, head_dim] contiguous (the C++ layer loop passes its step's rows).
static void prefill_causal_into(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t n,
                                const torch::Tensor& out) {
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "prefill_causal: q, k and v all float32 or all bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_causal: q, k, v are [tokens, heads, head_dim]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(n > 0 && T % n == 0, "prefill_causal: ", T, " tokens are not ", n, " prompts of equal length");
  TORCH_CHECK(prefill_causal_usable(q, n), "prefill_causal: not for this CPU, dtype ", q.scalar_type(),
              ", head size ", D, " or prompt length ", T / n);
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && v.size(1) == KVH && k.size(2) == D && v.size(2) == D &&
                  KVH > 0 && H % KVH == 0,
              "prefill_causal: k and v must be [tokens, kv_heads, head_dim] with heads a multiple of kv_heads");
  for (const auto* x : {&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == D, "prefill_causal: each token's heads must be contiguous");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.is_contiguous() && out.sizes() == q.sizes(),
              "prefill_causal: out must be a contiguous tensor like q");
  if (T == 0) return;
  const int64_t L = T / n;
#if defined(__x86_64__)
  if (q.scalar_type() == at::kBFloat16) {
    const bf16* qp = q.data_ptr<bf16>();
    const bf16* kp = k.data_ptr<bf16>();
    const bf16* vp = v.data_ptr<bf16>();
    bf16* op = out.data_ptr<bf16>();
    switch (D / kAmxTileDepth) {
      case 1: prefill_amx::attend<1>(qp, q.stride(0), kp, k.stride(0), vp, v.stride(0), op, n, L, H, KVH); break;
      case 2: prefill_amx::attend<2>(qp, q.stride(0), kp, k.stride(0), vp, v.stride(0), op, n, L, H, KVH); break;
      case 3: prefill_amx::attend<3>(qp, q.stride(0), kp, k.stride(0), vp, v.stride(0), op, n, L, H, KVH); break;
      default: prefill_amx::attend<4>(qp, q.stride(0), kp, k.stride(0), vp, v.stride(0), op, n, L, H, KVH); break;
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  using namespace prefill;
  const int64_t G = H / KVH, Lp = (L + kKeys - 1) / kKeys * kKeys;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  // Keys transposed per prompt and KV head, [n, KVH, D, Lp], zero past L.
  std::vector<float> kt(n * KVH * D * Lp, 0.f);
  at::parallel_for(0, n * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t sg = begin; sg < end; ++sg) {
      const int64_t s = sg / KVH, g = sg % KVH;
      float* dst = kt.data() + sg * D * Lp;
      for (int64_t j = 0; j < L; ++j) {
        const float* src = kp + (s * L + j) * ks + g * D;
        for (int64_t d = 0; d < D; ++d) dst[d * Lp + j] = src[d];
      }
    }
  });
  const int64_t tiles = (L + kRows - 1) / kRows;
  at::parallel_for(0, n * H * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(kRows * Lp);
    float inv_sum[kRows];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / (H * tiles), h = item / tiles % H, i0 = item % tiles * kRows;
      const int64_t rows = std::min(kRows, L - i0), g = h / G;
      const int64_t jn = i0 + rows;  // keys the tile's last row sees
      scores(qp + (seq * L + i0) * qs + h * D, qs, rows, kt.data() + (seq * KVH + g) * D * Lp, Lp, D,
             (jn + kKeys - 1) / kKeys * kKeys, s.data());
      for (int64_t r = 0; r < rows; ++r) inv_sum[r] = softmax_row(s.data() + r * Lp, i0 + r + 1, jn, scale);
      const float* vh = vp + seq * L * vs + g * D;
      float* oh = op + (seq * L + i0) * H * D + h * D;
      for (int64_t r0 = 0; r0 < rows; r0 += kPvRows) {
        const int64_t pr = std::min(kPvRows, rows - r0), pjn = i0 + r0 + pr;
        int64_t c0 = 0;
        for (; c0 + 32 <= D; c0 += 32)
          weighted_sum32(s.data() + r0 * Lp, Lp, pr, vh + c0, vs, pjn, oh + r0 * H * D + c0, H * D, inv_sum + r0);
        for (; c0 < D; c0 += 8)
          weighted_sum8(s.data() + r0 * Lp, Lp, pr, vh + c0, vs, pjn, oh + r0 * H * D + c0, H * D, inv_sum + r0);
      }
    }
  });
#endif
}

torch::Tensor prefill_causal(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t n) {
  auto out = torch::empty(q.sizes(), q.options());
  prefill_causal_into(q, k, v, n, out);
  return out;
}
