// Causal attention of fresh prompts (nothing cached) in float32 on AVX2 CPUs: n prompts of equal
// length L packed back to back, q [n*L, H, D], k and v [n*L, KVH, D] (rows may be strided: they are
// column slices of the QKV output), grouped-query heads read their KV head's rows. PyTorch's flash
// attention on CPU multiplies 64-row blocks of each head through BLAS calls and rescales an online
// softmax; here each tile of six positions of one head takes its scores against exactly the keys it
// sees, in registers (six rows x sixteen keys), then an exact softmax over them and the weighted sum
// of the values (three rows x 32 columns). On a 2-core Zen 4 without AVX-512 this is 1.9x faster
// than F.scaled_dot_product_attention on the embedded model's 256-token prompts
// (benchmarks/prefill_attention.py).
//
// Compiled together with cpu_kernels.cpp (exp_approx, cpu_has_avx512).

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
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
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

// Prompts up to this long: at 4,096 tokens a KV head's transposed keys (1 MB at head size 64) no
// longer stay in L2 and PyTorch's kernel, which takes 256-row blocks from 768 tokens on, is 1.4x
// faster (1.03x slower at 2,048; benchmarks/prefill_attention.py).
constexpr int64_t kMaxPromptLength = 2048;

// Whether prefill_causal runs for float32 prompts of this length and head size here: built with
// AVX2 and FMA, head size a multiple of 8, and no AVX-512 (where PyTorch's own kernel takes its
// AVX-512 path, which this was not measured against).
bool prefill_causal_usable(int64_t head_dim, int64_t length) {
#if defined(__AVX2__) && defined(__FMA__)
  return head_dim % 8 == 0 && length <= kMaxPromptLength && !cpu_has_avx512();
#else
  (void)head_dim, (void)length;
  return false;
#endif
}

torch::Tensor prefill_causal(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t n) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prefill_causal: float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_causal: q, k, v are [tokens, heads, head_dim]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(n > 0 && T % n == 0, "prefill_causal: ", T, " tokens are not ", n, " prompts of equal length");
  TORCH_CHECK(prefill_causal_usable(D, T / n), "prefill_causal: not for this CPU, head size ", D,
              " or prompt length ", T / n);
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && v.size(1) == KVH && k.size(2) == D && v.size(2) == D &&
                  KVH > 0 && H % KVH == 0,
              "prefill_causal: k and v must be [tokens, kv_heads, head_dim] with heads a multiple of kv_heads");
  for (const auto* x : {&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == D, "prefill_causal: each token's heads must be contiguous");
  auto out = torch::empty({T, H, D}, q.options());
#if defined(__AVX2__) && defined(__FMA__)
  using namespace prefill;
  const int64_t L = T / n, G = H / KVH, Lp = (L + kKeys - 1) / kKeys * kKeys;
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
  return out;
}
