// A pipeline stage's dense decoder layers (Llama family, one tensor-parallel rank, float32 or bfloat16 on CPU)
// in one call. The Python loop over layers costs a few microseconds per module call and per
// operator on every layer; at 30 layers that was 10-15 ms of a 60-70 ms decode step. This runs
// the same operators in the same order (so its output is bit-identical to the module path, which
// the tests check) without leaving C++ between them, and without holding the GIL.
//
// Compiled together with cpu_kernels.cpp (rms_norm, silu_and_mul, rotary_, paged_decode) and
// prefill_attention.cpp (prefill_causal).

#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>
#include <pybind11/pybind11.h>

#include <array>
#include <exception>

namespace {

// Per layer, in this order (cpu_decoder_stack.py builds the list); an empty tensor means "none".
// Each linear layer takes three: its weight, then for a float weight the oneDNN-packed copy and
// its panels (panel_gemm.cpp) or none, for a quantized one (uint8 blocks) its block type (one int64) and row scales.
enum LayerWeight : int64_t {
  kInputNorm, kQKV, kQKVAux, kQKVScale, kQKVBias, kO, kOAux, kOScale, kPostNorm, kGateUp, kGateUpAux,
  kGateUpScale, kDown, kDownAux, kDownScale, kWeightsPerLayer
};

bool present(const torch::Tensor& t) { return t.defined() && t.numel() > 0; }

struct PackedRows {  // the row counts that take the packed weight (cpu_gemm.PACKED_MIN_ROWS / _MAX_ROWS)
  int64_t min, max;
  int64_t gemv_max;  // up to this many rows, the weight as stored through gemv (cpu_gemm.gemv_max_rows)
  int64_t panel_max;  // up to this many rows, the panels through panel_gemm (cpu_gemm.panel_max_rows)
};

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor* w, const torch::Tensor& bias,
                     const PackedRows& rows) {
  // The same choice as cpu_gemm.PrepackedMatmul.matmul and quantization/matmul.py: a few rows
  // through the panels or the GEMV of the weight as stored, float or quantized; more rows through
  // oneDNN on the packed weight, MKL beyond (a bfloat16 weight without a packed copy in float32);
  // quantized weights through qmatmul whatever the rows.
  const torch::Tensor& weight = w[0];
  const torch::Tensor& packed = w[1];
  std::optional<torch::Tensor> b;
  if (present(bias)) b = bias;
  if (weight.scalar_type() == at::kByte) {
    const int64_t type = packed.data_ptr<int64_t>()[0];
    std::optional<torch::Tensor> scale;
    if (present(w[2])) scale = w[2];
    return qmatmul(x, weight, type, scale, b);
  }
  if (present(w[2]) && x.size(0) <= rows.panel_max) return panel_gemm(x.contiguous(), w[2], weight.size(0), b);
  if (x.size(0) <= rows.gemv_max) return gemv(x.contiguous(), weight, b);
  if (present(packed) && rows.min <= x.size(0) && x.size(0) <= rows.max) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                         .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                              const std::optional<torch::Tensor>&, c10::string_view,
                                              c10::List<std::optional<c10::Scalar>>,
                                              std::optional<c10::string_view>)>();
    return op.call(x.contiguous(), packed, b, "none", c10::List<std::optional<c10::Scalar>>(),
                   c10::string_view(""));
  }
  if (weight.scalar_type() == at::kBFloat16) {  // no packed copy: cpu_gemm.widens_bf16
    std::optional<torch::Tensor> wide_bias;
    if (b) wide_bias = b->to(at::kFloat);
    return at::linear(x.to(at::kFloat), weight.to(at::kFloat), wide_bias).to(at::kBFloat16);
  }
  return at::linear(x, weight, b);
}

struct StepAttention {
  const torch::Tensor& slot_mapping;
  const std::vector<int64_t>& prefill_groups;  // per group: q_start, q_end, sequences, cached tokens
  const std::vector<torch::Tensor>& prefill_tables;  // per group: its block table (cached groups only)
  int64_t num_prefill_tokens;
  const torch::Tensor& decode_tables;  // empty: no decodes
  const torch::Tensor& decode_lens;
};

// to_cache, from_cache and write_kv of layers/attention/base.py (the same ATen calls, so the same
// bits): an fp8 cache stores x / scale saturated to its range and reads stored * scale.
bool fp8_dtype(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

torch::Tensor to_cache(const torch::Tensor& x, at::ScalarType cache_dtype, double scale) {
  if (cache_dtype == x.scalar_type() || !fp8_dtype(cache_dtype)) return x.to(cache_dtype);
  const double fmax = cache_dtype == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
  auto y = x.to(at::kFloat);
  if (scale != 1.0) y = y / scale;
  return y.clamp(-fmax, fmax).to(cache_dtype);
}

torch::Tensor from_cache(const torch::Tensor& x, at::ScalarType dtype, double scale) {
  if (x.scalar_type() == dtype) return x;
  return scale == 1.0 ? x.to(dtype) : (x.to(at::kFloat) * scale).to(dtype);
}

void write_kv(torch::Tensor cache, const torch::Tensor& slots, torch::Tensor x, int64_t kvh, int64_t d) {
  if (fp8_dtype(cache.scalar_type())) {  // as bytes: index_copy_ has no fp8 kernels
    cache = cache.view(at::kByte);
    x = x.view(at::kByte);
  }
  // A token's KVH x D values are one contiguous row of x (a column slice of the QKV output) and
  // one row of the cache: a copy each, where index_copy_ sets up a TensorIterator per call (about
  // 5 us, two a layer, which a batch-1 decode step of a few ms feels).
  const bool rows = cache.is_contiguous() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == d &&
                    slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == x.size(0);
  if (!rows) return cache.view({-1, kvh, d}).index_copy_(0, slots, x), void();
  const int64_t n_slots = cache.numel() / (kvh * d), row_bytes = kvh * d * cache.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(x.data_ptr());
  const int64_t src_stride = x.stride(0) * x.element_size();
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < n_slots, "write_kv: slot ", slot[t], " out of range [0, ", n_slots, ")");
    std::memcpy(dst + slot[t] * row_bytes, src + t * src_stride, row_bytes);
  }
}

// AttentionBackend.forward (layers/attention/base.py) with the CPU backend's attention (cpu.py).
// The output has `rows` rows (the step's tokens, then zeros up to the padded row count).
// k_scale / v_scale: the layer's KV-cache scales (an fp8 cache's; others ignore them).
torch::Tensor attention(const torch::Tensor& q, torch::Tensor k, torch::Tensor v, const torch::Tensor& kv_cache,
                        const StepAttention& s, int64_t kvh, int64_t d, int64_t rows, double k_scale,
                        double v_scale) {
  auto k_cache = kv_cache[0], v_cache = kv_cache[1];
  auto kq = to_cache(k, k_cache.scalar_type(), k_scale), vq = to_cache(v, v_cache.scalar_type(), v_scale);
  write_kv(k_cache, s.slot_mapping, kq, kvh, d);
  write_kv(v_cache, s.slot_mapping, vq, kvh, d);
  if (fp8_dtype(k_cache.scalar_type())) {  // attention sees this step's K/V as the cache holds them
    k = from_cache(kq, k.scalar_type(), k_scale);
    v = from_cache(vq, v.scalar_type(), v_scale);
  }
  auto decode = [&](int64_t first) {  // the step's decoding rows, from `first` on
    return paged_decode(q.slice(0, first).contiguous(), k_cache.contiguous(), v_cache.contiguous(), s.decode_tables,
                        s.decode_lens, std::pow(static_cast<double>(d), -0.5), k_scale, v_scale);
  };
  const bool decode_only = s.prefill_groups.empty() && s.num_prefill_tokens == 0 && rows == q.size(0);
  if (decode_only && present(s.decode_tables)) return decode(0);  // the kernel's output is the layer's: no copy
  auto out = torch::empty({rows, q.size(1), q.size(2)}, q.options());
  out.slice(0, q.size(0)).zero_();
  for (size_t g = 0; g * 4 < s.prefill_groups.size(); ++g) {
    const int64_t a = s.prefill_groups[4 * g], b = s.prefill_groups[4 * g + 1];
    const int64_t n = s.prefill_groups[4 * g + 2], cached = s.prefill_groups[4 * g + 3];
    auto qs = q.slice(0, a, b);
    torch::Tensor o;
    if (cached == 0 && prefill_causal_usable(qs, n)) {
      // as attention/cpu.py chooses; straight into the step's rows
      prefill_causal_into(qs, k.slice(0, a, b), v.slice(0, a, b), n, out.slice(0, a, b));
      continue;
    } else if (cached == 0) {  // n equal-length fresh prompts: one causal SDPA over [n, heads, L, D]
      auto heads_first = [n](const torch::Tensor& x) {
        return x.view({n, -1, x.size(1), x.size(2)}).transpose(1, 2);
      };
      o = at::scaled_dot_product_attention(heads_first(qs), heads_first(k.slice(0, a, b)),
                                           heads_first(v.slice(0, a, b)), std::nullopt, 0.0, true,
                                           std::nullopt, true);
      // straight into the output's rows: reshaping to tokens first cost a second copy of them
      out.slice(0, a, b).view({n, -1, qs.size(1), qs.size(2)}).copy_(o.transpose(1, 2));
      continue;
    } else {  // a chunk after cached tokens attends to the cache
      const int64_t ctx = cached + (b - a);
      const auto& table = s.prefill_tables[g];
      auto kk = from_cache(k_cache.index({table}).flatten(0, 1).slice(0, 0, ctx), q.scalar_type(), k_scale);
      auto vv = from_cache(v_cache.index({table}).flatten(0, 1).slice(0, 0, ctx), q.scalar_type(), v_scale);
      auto opts = torch::TensorOptions().dtype(torch::kLong).device(q.device());
      auto pos = torch::arange(cached, ctx, opts);
      auto mask = torch::arange(ctx, opts).unsqueeze(0) <= pos.unsqueeze(1);
      o = at::scaled_dot_product_attention(qs.transpose(0, 1).unsqueeze(0), kk.transpose(0, 1).unsqueeze(0),
                                           vv.transpose(0, 1).unsqueeze(0), mask, 0.0, false, std::nullopt,
                                           true);
      o = o.squeeze(0).transpose(0, 1);
    }
    out.slice(0, a, b).copy_(o);
  }
  if (present(s.decode_tables)) out.slice(0, s.num_prefill_tokens, q.size(0)).copy_(decode(s.num_prefill_tokens));
  return out;
}


// ---- decode steps in one parallel region ------------------------------------------------------------
// A decode step of a few rows through the weight panels is a chain of small operators: per layer
// four matmuls of 20-110 us at the memory's pace, and between them the attention and norms, rotary
// and cache writes of a few microseconds. As separate calls every matmul opened and closed a
// parallel region and every operator allocated its output: 0.5 ms of a 9 ms batch-1 step of the
// embedded model's layers on a 2-core Zen 3. Here the threads stay in one region for all the layers:
// each runs the row-wise operators on its share of the rows into buffers made once per step, all
// of them take the panels from a shared counter, and each decodes its share of the
// attention (KV heads of sequences, so that one sequence's heads are shared too). The operators are
// the same functions on the same values, so the bits are the same.

std::atomic<int64_t> fused_steps{0};

// How many decode steps took the one-region loop since the process started (the tests' evidence).
int64_t fused_decode_steps() { return fused_steps.load(); }

const std::array<LayerWeight, 4> kMatmuls{kQKV, kO, kGateUp, kDown};

// Whether the step is decodes only, each of its rows through the panels (as `linear` chooses them),
// on a cache of the activations' dtype.
bool fusable(const torch::Tensor& h, const std::vector<torch::Tensor>& weights,
             const std::vector<torch::Tensor>& kv_caches, const StepAttention& s, const PackedRows& rows) {
  const int64_t T = h.size(0);
  if (!s.prefill_groups.empty() || s.num_prefill_tokens != 0 || !present(s.decode_tables) || T == 0 ||
      T > rows.panel_max || s.decode_tables.size(0) != T || !h.is_contiguous())
    return false;
  const bool bfloat16 = h.scalar_type() == at::kBFloat16;
  if (!bfloat16 && h.scalar_type() != at::kFloat) return false;
  if (bfloat16 && T >= kAmxMinRows && cpu_has_amx_bf16()) return false;  // the tiles read x as stored
  for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
    const torch::Tensor& cache = kv_caches[layer];
    if (cache.scalar_type() != h.scalar_type() || !cache.is_contiguous() || cache.dim() != 5) return false;
    for (const auto m : kMatmuls) {
      const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer + m;
      if (!present(w[2]) || w[0].scalar_type() != h.scalar_type()) return false;
    }
  }
  return true;
}

// What paged_decode, rotary_ and write_kv would refuse, refused before the region (an exception
// thrown inside it cannot leave it).
void check_decode_step(const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
                       const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lens,
                       const torch::Tensor& cache, int64_t T) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == cache.size(4) &&
              sin.sizes() == cos.sizes(), "rotary_: cos and sin must be float32 [positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T);
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && lens.scalar_type() == at::kLong &&
              lens.is_contiguous() && lens.numel() == T);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t blocks = cache.size(1), bs = cache.size(2), max_blocks = tables.size(1);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_: position out of range");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < blocks * bs, "write_kv: slot ", slot[t], " out of range [0, ", blocks * bs, ")");
    TORCH_CHECK(len[t] >= 1 && len[t] <= max_blocks * bs, "paged_decode: context length out of range");
    for (int64_t i = 0; i < (len[t] + bs - 1) / bs; ++i)
      TORCH_CHECK(table[t * max_blocks + i] >= 0 && table[t * max_blocks + i] < blocks,
                  "paged_decode: block id out of range");
  }
}

template <typename W>
std::vector<torch::Tensor> decode_fused(const torch::Tensor& h, const std::vector<torch::Tensor>& weights,
                                        const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& positions,
                                        const torch::Tensor& cos, const torch::Tensor& sin, const StepAttention& s,
                                        int64_t H, int64_t KVH, int64_t D, double eps,
                                        const std::vector<double>& kv_scales) {
  const int64_t T = h.size(0), E = h.size(1), QKV = (H + 2 * KVH) * D;
  const int64_t I = weights[kGateUp].size(0) / 2, kv_row = KVH * D, G = H / KVH;
  for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
    const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    const int64_t in[] = {E, H * D, E, I};
    for (size_t i = 0; i < kMatmuls.size(); ++i) {
      const torch::Tensor* m = w + kMatmuls[i];
      const torch::Tensor bias = kMatmuls[i] == kQKV ? w[kQKVBias] : torch::Tensor();
      check_panels(h.scalar_type(), in[i], m[2], m[0].size(0), present(bias) ? &bias : nullptr, "decoder_stack");
    }
    TORCH_CHECK(w[kQKV].size(0) == QKV && w[kO].size(0) == E && w[kGateUp].size(0) == 2 * I && w[kDown].size(0) == E,
                "decoder_stack: weight shapes do not match the heads");
    TORCH_CHECK(kv_caches[layer].sizes() == kv_caches[0].sizes(), "decoder_stack: KV caches of one shape");
  }
  check_decode_step(positions, cos, sin, s.slot_mapping, s.decode_tables, s.decode_lens, kv_caches[0], T);
  fused_steps.fetch_add(1);
  auto residual = h.clone(), hn = torch::empty_like(h), out = torch::empty_like(h);
  auto qkv = torch::empty({T, QKV}, h.options()), q = torch::empty({T, H, D}, h.options());
  auto attn = torch::empty({T, H * D}, h.options()), gate_up = torch::empty({T, 2 * I}, h.options());
  auto act = torch::empty({T, I}, h.options());
  W *rp = residual.data_ptr<W>(), *hnp = hn.data_ptr<W>(), *op = out.data_ptr<W>(), *qkvp = qkv.data_ptr<W>();
  W *qp = q.data_ptr<W>(), *ap = attn.data_ptr<W>(), *gup = gate_up.data_ptr<W>(), *actp = act.data_ptr<W>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = s.slot_mapping.data_ptr<int64_t>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const double scale = std::pow(static_cast<double>(D), -0.5);
  const int threads = at::get_num_threads();
  // The step's attention in T x S items, S slices of each sequence's KV heads: one KV head a slice
  // where decode_heads (paged_decode.cpp) takes part of a sequence's heads, so that one sequence
  // is shared by the threads; else whole sequences (the AMX kernel through paged_decode).
  const int64_t* tables = s.decode_tables.data_ptr<int64_t>();
  const int64_t* lens = s.decode_lens.data_ptr<int64_t>();
  const int64_t bs = kv_caches[0].size(2), max_blocks = s.decode_tables.size(1);
  const bool by_heads = decode_splits_heads(h.scalar_type(), H, KVH, D, bs);
  const int64_t S = by_heads ? KVH : 1;
  // Where the panels do not read x as stored: the next matmul's rows transposed, each thread
  // writing the transposes of its rows.
  const bool as_stored = panel_reads_rows(T);
  std::vector<uint32_t> xt(as_stored ? 0 : panel_transpose_size<W>(T, std::max({E, H * D, I})));
  std::atomic<int64_t> next{0};  // the next panel of the current matmul
  std::exception_ptr failed;
  // By every thread: its share of the panels of one matmul of x ([T, K]), after rows_in(x, K).
  auto matmul = [&](const torch::Tensor* m, const torch::Tensor& bias, const W* x, W* y) {
    const int64_t N = m[0].size(0), P = (N + kPanelWidth - 1) / kPanelWidth, K = m[0].size(1);
    const W* pp = m[2].data_ptr<W>();
    const W* bp = present(bias) ? bias.data_ptr<W>() : nullptr;
    const void* xr = as_stored ? static_cast<const void*>(x) : xt.data();
    take_runs(next, P, threads, guided_runs(P), [&](int64_t p0, int64_t p1) {
      panel_range(pp, xr, K, T, K, bp, y, N, p0, p1, static_cast<PanelArgmax*>(nullptr));
    });
  };
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t i0 = T * S * me / team, i1 = T * S * (me + 1) / team;  // this thread's items
    // The row-wise operators between the matmuls, on this thread's rows: at 64 rows one thread alone
    // held the other at the barrier for them.
    const int64_t r0 = T * me / team, r1 = T * (me + 1) / team;
    auto rows_in = [&](const W* x, int64_t K) {  // by every thread, then a barrier
      if (!as_stored) panel_transpose_rows(x, K, T, K, r0, r1, xt.data());
      if (me == 0) next.store(0, std::memory_order_relaxed);
    };
    for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
      const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
      if (layer == 0) rms_norm_rows<W>(rp, E, w[kInputNorm].data_ptr<W>(), nullptr, 0, hnp, r0, r1, E, eps);
      else rms_norm_rows<W>(op, E, w[kInputNorm].data_ptr<W>(), rp, E, hnp, r0, r1, E, eps);
      rows_in(hnp, E);
#pragma omp barrier
      matmul(w + kQKV, w[kQKVBias], hnp, qkvp);
#pragma omp barrier
      if (me == 0) next.store(0, std::memory_order_relaxed);  // the O projection's: all are past QKV's panels
      if (i0 < i1) {
        const torch::Tensor& cache = kv_caches[layer];
        W* kc = cache.data_ptr<W>();
        W* vc = kc + cache.numel() / 2;
        const int64_t b0 = i0 / S, b1 = (i1 + S - 1) / S;  // the sequences this thread has heads of
        for (int64_t t = b0; t < b1; ++t) {
          // its KV heads [g0, g1) of sequence t, and their query heads: rotated, K/V into the cache
          const int64_t g0 = std::max<int64_t>(i0 - t * S, 0) * KVH / S, g1 = std::min(i1 - t * S, S) * KVH / S;
          W* row = qkvp + t * QKV;
          const float *c = cp + pos[t] * D, *sn = sp + pos[t] * D;
          rotary_row(row + g0 * G * D, c, sn, (g1 - g0) * G, D);
          rotary_row(row + (H + g0) * D, c, sn, g1 - g0, D);
          std::memcpy(kc + slot[t] * kv_row + g0 * D, row + (H + g0) * D, (g1 - g0) * D * sizeof(W));
          std::memcpy(vc + slot[t] * kv_row + g0 * D, row + (H + KVH + g0) * D, (g1 - g0) * D * sizeof(W));
          std::memcpy(qp + (t * H + g0 * G) * D, row + g0 * G * D, (g1 - g0) * G * D * sizeof(W));
          if (by_heads)
            decode_heads(qp, kc, vc, ap, tables, lens, t, t + 1, g0, g1, H, D, KVH, bs, max_blocks,
                         static_cast<float>(scale));
        }
        if (!by_heads) try {  // checked before the region: nothing is expected to throw here
          auto o = paged_decode(q.slice(0, b0, b1), cache[0], cache[1], s.decode_tables.slice(0, b0, b1),
                                s.decode_lens.slice(0, b0, b1), scale, kv_scales[2 * layer], kv_scales[2 * layer + 1]);
          std::memcpy(ap + b0 * H * D, o.data_ptr<W>(), (b1 - b0) * H * D * sizeof(W));
        } catch (...) {
#pragma omp critical
          if (!failed) failed = std::current_exception();
        }
      }
#pragma omp barrier
      if (!as_stored) {  // the transposes of rows whose heads several threads wrote
        rows_in(ap, H * D);
#pragma omp barrier
      }
      matmul(w + kO, torch::Tensor(), ap, op);
#pragma omp barrier
      rms_norm_rows<W>(op, E, w[kPostNorm].data_ptr<W>(), rp, E, hnp, r0, r1, E, eps);
      rows_in(hnp, E);
#pragma omp barrier
      matmul(w + kGateUp, torch::Tensor(), hnp, gup);
#pragma omp barrier
      silu_and_mul_rows<W>(gup, 2 * I, actp, r0, r1, I);
      rows_in(actp, I);
#pragma omp barrier
      matmul(w + kDown, torch::Tensor(), actp, op);
#pragma omp barrier
    }
  }
  if (failed) std::rethrow_exception(failed);
  return {out, residual};
}

}  // namespace

// Runs the layers on the stage's input h (the whole hidden state); returns {h, residual} as
// LlamaDecoderLayer.forward leaves them after the last one. With row_multiple > 1 every row-wise
// operator runs on the step's tokens padded with zero rows up to a multiple of it, as the packed
// matmuls of cpu_gemm.PrepackedMatmul do (see cpu_gemm.py: oneDNN builds a primitive per row count);
// attention and the cache writes take the real rows only.
std::vector<torch::Tensor> decoder_stack(torch::Tensor h, std::vector<torch::Tensor> weights,
                                         std::vector<torch::Tensor> kv_caches, torch::Tensor positions,
                                         torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                                         std::vector<int64_t> prefill_groups, std::vector<torch::Tensor> prefill_tables,
                                         int64_t num_prefill_tokens, torch::Tensor decode_tables,
                                         torch::Tensor decode_lens, int64_t num_heads, int64_t num_kv_heads,
                                         int64_t head_dim, double eps, int64_t packed_min_rows,
                                         int64_t packed_max_rows, int64_t row_multiple, int64_t gemv_max_rows,
                                         int64_t panel_max_rows, std::vector<double> kv_scales) {
  pybind11::gil_scoped_release no_gil;
  TORCH_CHECK(weights.size() == kv_caches.size() * kWeightsPerLayer, "decoder_stack: weights per layer mismatch");
  TORCH_CHECK(prefill_groups.size() % 4 == 0 && prefill_tables.size() * 4 == prefill_groups.size());
  TORCH_CHECK(kv_scales.size() == 2 * kv_caches.size(), "decoder_stack: a k_scale and a v_scale per layer");
  const StepAttention step{slot_mapping, prefill_groups, prefill_tables, num_prefill_tokens, decode_tables,
                           decode_lens};
  const PackedRows packed_rows{packed_min_rows, packed_max_rows, gemv_max_rows, panel_max_rows};
  const int64_t H = num_heads, KVH = num_kv_heads, D = head_dim, T = h.size(0);
  TORCH_CHECK(!kv_caches.empty(), "decoder_stack: no layers");
  TORCH_CHECK(row_multiple >= 1, "decoder_stack: row_multiple must be >= 1");
  // gemv and panel_gemm take any row count: no padding for oneDNN
  if (T <= std::max(gemv_max_rows, panel_max_rows)) row_multiple = 1;
  const int64_t rows = (T + row_multiple - 1) / row_multiple * row_multiple;
  if (rows == T && fusable(h, weights, kv_caches, step, packed_rows)) {
    std::vector<torch::Tensor> out;
    dispatch(h, "decoder_stack", [&](auto tag) {
      out = decode_fused<decltype(tag)>(h, weights, kv_caches, positions, cos, sin, step, H, KVH, D, eps, kv_scales);
    });
    return out;
  }
  if (rows != T) h = at::constant_pad_nd(h, {0, 0, 0, rows - T});
  torch::Tensor residual;
  for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
    const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    if (layer == 0) {
      residual = h;
      h = rms_norm(h, w[kInputNorm], std::nullopt, eps);
    } else {
      residual = residual.contiguous();
      h = rms_norm(h, w[kInputNorm], residual, eps);
    }
    auto qkv = linear(h, w + kQKV, w[kQKVBias], packed_rows);
    auto real = qkv.slice(0, 0, T);
    rotary_(real, positions, cos, sin, H + KVH, D);
    auto q = real.slice(1, 0, H * D).view({T, H, D});
    auto k = real.slice(1, H * D, (H + KVH) * D).view({T, KVH, D});
    auto v = real.slice(1, (H + KVH) * D, (H + 2 * KVH) * D).view({T, KVH, D});
    auto o = attention(q, k, v, kv_caches[layer], step, KVH, D, rows, kv_scales[2 * layer], kv_scales[2 * layer + 1]);
    h = linear(o.view({rows, H * D}), w + kO, torch::Tensor(), packed_rows);
    h = rms_norm(h, w[kPostNorm], residual, eps);
    h = linear(silu_and_mul(linear(h, w + kGateUp, torch::Tensor(), packed_rows)), w + kDown, torch::Tensor(),
               packed_rows);
  }
  if (rows != T) return {h.slice(0, 0, T), residual.slice(0, 0, T)};
  return {h, residual};
}
