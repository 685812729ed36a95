// batchrun's C++ kernels for the CPU (built and loaded by cpu_kernels.py):
//
// 1. Paged decode attention: each decoding sequence's one query token attends over its K/V where they lie in the
// pages, walking its block table -- no copy of the pages into a workspace.
// One task per (sequence, KV head), spread over the intra-op threads: each GQA query head of that KV head is
// scored against every key of the context (fp32 accumulation; bf16/fp16 pages widened on load), softmaxed, and
// the values summed with those weights. With AVX-512 and a head dim that is a multiple of 16, 16 keys are
// scored at once: 16 lane-wise partial dot products, then their 16 horizontal sums together (sum_lanes16);
// a horizontal sum per key made the kernel compute-bound (bench/micro/profile_step.py attention measures
// it; figures in bench/RESULTS.md). What a layer asks beyond full causal attention: the first key each sequence
// sees (a sliding window or a chunk: the pages wholly before it are not read), logit soft-capping, an
// attention-sink logit per query head (or per query token and head) in the softmax's denominator, a relative
// bias per query token and head by the key's backward distance (Inkling 2's), and ALiBi (Bloom's, MPT's). Shapes:
//   query [T, Hq, Dk], out [T, Hq, Dv] (any strides but a unit last one)
//   k_cache [num_pages, P, Hkv, Dk], v_cache [num_pages, P, Hkv, Dv] (Dk != Dv: MLA)
//   block_tables [G, max_blocks] int32   seq_lens [G] int32 (context, the new token included)
//   token_index [G] int64: the packed row of each decoding sequence's query (and output)
//   first_keys [G] int32 or None (0)   softcap: 0 = off   sinks [Hq] or [T, Hq] fp32, or None
//   relative_bias [T, Hq, R] fp32 (unit stride in R) or None: added to the score of the key d = p - k < R back
//   alibi_slopes [Hq] fp32 or None: ALiBi, -slope * (p - k) added to the score of the key at k (after the bias)
//
// 2. Greedy argmax over rows of logits [N, V] (fp32 or bf16), as torch.argmax decides it (the first index of the
// largest value; a NaN counts as the largest), at the speed of a plain reduction, where torch's argmax ran
// several times slower than its amax (bench/RESULTS.md) and was most of the host's time
// outside the forward at 256 rows a step.
//
// 3. The fused elementwise work of bf16/fp16 layers (RMSNorm, SiLU-and-mul): cpu_elementwise.cpp; 4. a bf16
// layer's prompt attention: cpu_prompt_attention.cpp; 5. the decode of bf16 pages with AVX512-BF16 dot products,
// where the build and the shape take it: cpu_decode_bf16.cpp (the loops below widen bf16 to fp32 elsewhere).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_decode.h"  // sum_lanes16, DecodeExtras, paged_decode_bf16 (cpu_decode_bf16.cpp)

namespace {

// dot product of a widened query row (fp32) with one key row, D known at compile time (0: at run time)
template <int kD, typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  const int64_t n = kD ? kD : D;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += q[d] * widen(k[d]);
  return s;
}

template <int kD, typename T>
inline void axpy(float* acc, float w, const T* v, int64_t D) {
  const int64_t n = kD ? kD : D;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += w * widen(v[d]);
}

// scores[j] = q . key j of the context, for the ctx keys in the pages of `table` (kh: the head's first key)
template <int kD, typename T>
inline void score_keys(const float* q, const T* kh, const int32_t* table, int64_t P, int64_t sk_p, int64_t sk_s,
                       int64_t ctx, int64_t D, float* scores) {
#ifdef __AVX512F__
  if constexpr (kD > 0 && kD % 16 == 0) {
    __m512 qv[kD / 16];
    for (int c = 0; c < kD / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t first = 0, b = 0; first < ctx; first += P, ++b) {
      const T* kp = kh + table[b] * sk_p;
      const int64_t n = std::min(P, ctx - first);
      for (int64_t s0 = 0; s0 < n; s0 += 16) {  // 16 keys: 16 lane-wise partial dot products, summed at once
        const int64_t m = std::min<int64_t>(16, n - s0);
        __m512 part[16];
        for (int s = 0; s < 16; ++s) {
          if (s < m) {
            const T* key = kp + (s0 + s) * sk_s;
            __m512 sum = _mm512_mul_ps(qv[0], load16(key));
            for (int c = 1; c < kD / 16; ++c) sum = _mm512_fmadd_ps(qv[c], load16(key + 16 * c), sum);
            part[s] = sum;
          } else {
            part[s] = _mm512_setzero_ps();
          }
        }
        _mm512_mask_storeu_ps(scores + first + s0, static_cast<__mmask16>((1u << m) - 1), sum_lanes16(part));
      }
    }
    return;
  }
#endif
  for (int64_t first = 0, b = 0; first < ctx; first += P, ++b) {
    const T* kp = kh + table[b] * sk_p;
    const int64_t n = std::min(P, ctx - first);
    for (int64_t s = 0; s < n; ++s) scores[first + s] = dot<kD>(q, kp + s * sk_s, D);
  }
}

// acc = the sum over the context of weights[j] * value j (vh: the head's first value)
template <int kD, typename T>
inline void sum_values(const float* weights, const T* vh, const int32_t* table, int64_t P, int64_t sv_p,
                       int64_t sv_s, int64_t ctx, int64_t D, float* acc) {
#ifdef __AVX512F__
  if constexpr (kD > 0 && kD % 16 == 0) {
    __m512 sum[kD / 16];  // the whole context summed in registers
    for (int c = 0; c < kD / 16; ++c) sum[c] = _mm512_setzero_ps();
    for (int64_t first = 0, b = 0; first < ctx; first += P, ++b) {
      const T* vp = vh + table[b] * sv_p;
      const int64_t n = std::min(P, ctx - first);
      for (int64_t s = 0; s < n; ++s) {
        const __m512 w = _mm512_set1_ps(weights[first + s]);
        for (int c = 0; c < kD / 16; ++c) sum[c] = _mm512_fmadd_ps(w, load16(vp + s * sv_s + 16 * c), sum[c]);
      }
    }
    for (int c = 0; c < kD / 16; ++c) _mm512_storeu_ps(acc + 16 * c, sum[c]);
    return;
  }
#endif
  std::fill(acc, acc + D, 0.f);
  for (int64_t first = 0, b = 0; first < ctx; first += P, ++b) {
    const T* vp = vh + table[b] * sv_p;
    const int64_t n = std::min(P, ctx - first);
    for (int64_t s = 0; s < n; ++s) axpy<kD>(acc, weights[first + s], vp + s * sv_s, D);
  }
}

template <int kD, typename T>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& token_index,
            double scale, const batchrun::DecodeExtras& extras) {
  const int64_t G = seq_lens.size(0);
  const int64_t num_heads = query.size(1), D = query.size(2), Dv = v_cache.size(3);
  const int64_t P = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t gqa = num_heads / num_kv_heads;
  const T* q = query.data_ptr<T>();
  const T* k = k_cache.data_ptr<T>();
  const T* v = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* rows = token_index.data_ptr<int64_t>();
  const int64_t sq_t = query.stride(0), sq_h = query.stride(1);
  const int64_t so_t = out.stride(0), so_h = out.stride(1);
  const int64_t sk_p = k_cache.stride(0), sk_s = k_cache.stride(1), sk_h = k_cache.stride(2);
  const int64_t sv_p = v_cache.stride(0), sv_s = v_cache.stride(1), sv_h = v_cache.stride(2);
  const int64_t st = block_tables.stride(0);

  at::parallel_for(0, G * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(D), acc(Dv), scores;
    for (int64_t task = begin; task < end; ++task) {
      // sequence-major: consecutive tasks read neighbouring head slices of the same pages
      const int64_t g = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t t = rows[g], ctx = lens[g];
      // the keys read: from the page holding the first visible key; scores[j] is key first_page * P + j
      const int64_t first = extras.first_keys ? extras.first_keys[g] : 0;
      const int64_t first_page = first / P, hidden = first - first_page * P, n = ctx - first_page * P;
      const int32_t* table = tables + g * st + first_page;
      const T* kh = k + h * sk_h;
      const T* vh = v + h * sv_h;
      scores.resize(n);
      for (int64_t r = 0; r < gqa; ++r) {  // the GQA query rows of this KV head; its K/V stay in L2 after the first
        const int64_t head = h * gqa + r;
        const T* qr = q + t * sq_t + head * sq_h;
        for (int64_t d = 0; d < D; ++d) qf[d] = widen(qr[d]) * static_cast<float>(scale);
        score_keys<kD>(qf.data(), kh, table, P, sk_p, sk_s, n, D, scores.data());
        if (extras.softcap > 0.f) {
          const float cap = extras.softcap, inv_cap = 1.f / extras.softcap;
          for (int64_t j = hidden; j < n; ++j) scores[j] = cap * std::tanh(scores[j] * inv_cap);
        }
        if (extras.rel) {  // key j is at position base + j, the query at ctx - 1: distance back = ctx - 1 - base - j
          const float* bias = extras.rel + t * extras.rel_st + head * extras.rel_sh;
          const int64_t last = ctx - 1 - first_page * P;  // the query's own j
          for (int64_t j = std::max(hidden, last - extras.rel_extent + 1); j < n; ++j) scores[j] += bias[last - j];
        }
        if (extras.alibi)
          batchrun::subtract_alibi(scores.data(), extras.alibi[head], hidden, n, ctx - 1 - first_page * P);
        const float* sink = extras.sinks ? extras.sinks + t * extras.sink_stride + head : nullptr;
        float m = sink ? *sink : -INFINITY;
        for (int64_t j = hidden; j < n; ++j) m = scores[j] > m ? scores[j] : m;
        float total = sink ? exp_nonpositive(*sink - m) : 0.f;
        for (int64_t j = 0; j < hidden; ++j) scores[j] = 0.f;  // before the window or the chunk
#pragma omp simd reduction(+ : total)
        for (int64_t j = hidden; j < n; ++j) {
          scores[j] = exp_nonpositive(scores[j] - m);
          total += scores[j];
        }
        sum_values<kD>(scores.data(), vh, table, P, sv_p, sv_s, n, Dv, acc.data());
        T* orow = o + t * so_t + head * so_h;
        const float inv = 1.f / total;
        for (int64_t d = 0; d < Dv; ++d) orow[d] = static_cast<T>(acc[d] * inv);
      }
    }
  });
}

template <typename T>
void decode_any(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& token_index,
                double scale, const batchrun::DecodeExtras& extras) {
  // bf16 pages: AVX512-BF16 dot products where this build and the shape take them (cpu_decode_bf16.cpp)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (batchrun::paged_decode_bf16(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale,
                                    extras))
      return;
  }
  // the common head dims unrolled at compile time (where K and V share it); others take the generic loops
  const int64_t D = query.size(2);
  switch (D == v_cache.size(3) ? D : 0) {
    case 32:
      return decode<32, T>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale, extras);
    case 64:
      return decode<64, T>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale, extras);
    case 128:
      return decode<128, T>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale, extras);
    default:
      return decode<0, T>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale, extras);
  }
}

}  // namespace

void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, at::Tensor token_index, double scale,
                            c10::optional<at::Tensor> first_keys, double softcap, c10::optional<at::Tensor> sinks,
                            c10::optional<at::Tensor> relative_bias, c10::optional<at::Tensor> alibi_slopes) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "unit stride in the head dimension");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, pages and output share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  token_index.scalar_type() == at::kLong,
              "int32 block tables and lengths, int64 token index");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && out.size(2) == v_cache.size(3), "head dims: query = K, out = V");
  batchrun::DecodeExtras extras;
  extras.softcap = static_cast<float>(softcap);
  if (first_keys.has_value()) {
    TORCH_CHECK(first_keys->scalar_type() == at::kInt && first_keys->is_contiguous() &&
                    first_keys->size(0) == seq_lens.size(0),
                "first_keys: [G] int32");
    extras.first_keys = first_keys->data_ptr<int32_t>();
  }
  if (sinks.has_value()) {
    const bool per_token = sinks->dim() == 2;
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->size(-1) == query.size(1) && (!per_token || sinks->size(0) == query.size(0)),
                "sinks: [Hq] or [T, Hq] float32");
    extras.sinks = sinks->data_ptr<float>();
    extras.sink_stride = per_token ? query.size(1) : 0;
  }
  if (relative_bias.has_value()) {
    TORCH_CHECK(relative_bias->scalar_type() == at::kFloat && relative_bias->dim() == 3 &&
                    relative_bias->size(0) == query.size(0) && relative_bias->size(1) == query.size(1) &&
                    relative_bias->stride(2) == 1,
                "relative_bias: [T, Hq, R] float32, unit stride in R");
    extras.rel = relative_bias->data_ptr<float>();
    extras.rel_extent = relative_bias->size(2);
    extras.rel_st = relative_bias->stride(0);
    extras.rel_sh = relative_bias->stride(1);
  }
  if (alibi_slopes.has_value()) {
    TORCH_CHECK(alibi_slopes->scalar_type() == at::kFloat && alibi_slopes->is_contiguous() &&
                    alibi_slopes->dim() == 1 && alibi_slopes->size(0) == query.size(1),
                "alibi_slopes: [Hq] float32");
    extras.alibi = alibi_slopes->data_ptr<float>();
  }
  switch (query.scalar_type()) {
    case at::kFloat:
      decode_any<float>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale, extras);
      break;
    case at::kBFloat16:
      decode_any<at::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale, extras);
      break;
    case at::kHalf:
      decode_any<at::Half>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale, extras);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16");
  }
}

namespace {

// x[begin:end] into the running largest value m, its first index mi, and whether a NaN was seen
template <typename T>
void argmax_row_scalar(const T* x, int64_t begin, int64_t end, float& m, int64_t& mi, bool& nan) {
  for (int64_t j = begin; j < end; ++j) {
    const float v = widen(x[j]);
    nan = nan || v != v;
    if (v > m) {
      m = v;
      mi = j;
    }
  }
}

// One pass over the row: the largest value so far and its first index, in independent lanes; a NaN found
// anywhere sends a second pass looking for the first one. All -inf: index 0, as torch.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float m = -INFINITY;
  int64_t mi = 0, j = 0;
  bool nan = false;
#ifdef __AVX512F__
  // 4 x 16 lanes, each keeping its largest value and that value's first index
  constexpr int U = 4;
  __m512 best[U];
  __m512i index[U];
  __mmask16 unordered = 0;
  for (int u = 0; u < U; ++u) {
    best[u] = _mm512_set1_ps(-INFINITY);
    index[u] = _mm512_setzero_si512();
  }
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i sixteen = _mm512_set1_epi32(16);
  for (; j + 16 * U <= n; j += 16 * U) {
    for (int u = 0; u < U; ++u) {
      const __m512 v = load16(x + j + 16 * u);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best[u], _CMP_GT_OQ);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best[u] = _mm512_mask_mov_ps(best[u], greater, v);
      index[u] = _mm512_mask_mov_epi32(index[u], greater, at);
      at = _mm512_add_epi32(at, sixteen);
    }
  }
  alignas(64) float lane_best[16];
  alignas(64) int32_t lane_index[16];
  for (int u = 0; u < U; ++u) {
    _mm512_store_ps(lane_best, best[u]);
    _mm512_store_si512(reinterpret_cast<__m512i*>(lane_index), index[u]);
    for (int l = 0; l < 16; ++l) {
      if (lane_best[l] > m || (lane_best[l] == m && lane_index[l] < mi)) {
        m = lane_best[l];
        mi = lane_index[l];
      }
    }
  }
  nan = unordered != 0;
#endif
  argmax_row_scalar(x, j, n, m, mi, nan);  // the rest (every value, without AVX-512)
  if (nan) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = widen(x[i]);
      if (v != v) return i;
    }
  }
  return mi;
}

template <typename T>
void argmax_rows_typed(const at::Tensor& logits, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const T* base = reinterpret_cast<const T*>(logits.data_ptr());
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(base + r * stride, n);
  });
}

}  // namespace

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1,
              "argmax_rows: [N, V] logits on the CPU with a unit last stride");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: rows of no values");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  switch (logits.scalar_type()) {
    case at::kFloat:
      argmax_rows_typed<float>(logits, out);
      break;
    case at::kBFloat16:
      argmax_rows_typed<at::BFloat16>(logits, out);
      break;
    default:
      TORCH_CHECK(false, "argmax_rows: float32 or bfloat16");
  }
  return out;
}

// cpu_elementwise.cpp
bool rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
bool rms_norm_scale(at::Tensor out, at::Tensor x, at::Tensor variance, at::Tensor weight, double eps);
bool silu_and_mul(at::Tensor out, at::Tensor gate, at::Tensor up);
bool silu_and_mul_halves(at::Tensor out, at::Tensor gate_up);
std::vector<at::Tensor> rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin,
                                         int64_t unsqueeze_dim, bool partial);
void register_prompt_attention(py::module_& m);  // cpu_prompt_attention.cpp
bool write_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor pages,
              at::Tensor offsets);  // cpu_kv_write.cpp
bool residual_add(at::Tensor x, at::Tensor residual);  // cpu_residual.cpp
bool add_rms_norm(at::Tensor out, at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the pages (CPU)",
        py::arg("out"), py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("token_index"), py::arg("scale"), py::arg("first_keys") = py::none(),
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), py::arg("relative_bias") = py::none(),
        py::arg("alibi_slopes") = py::none());
  m.def("argmax_rows", &argmax_rows, "greedy argmax of each row of [N, V] logits, as torch.argmax (CPU)");
  m.def("rms_norm", &rms_norm, "Llama-style RMSNorm of [..., H] bf16/fp16 rows in one pass, or false (CPU)", py::arg("out"),
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("rms_norm_scale", &rms_norm_scale,
        "an fp32 RMSNorm after its variance, weight * (x * rsqrt(variance + eps)), bit-equal, or false (CPU)",
        py::arg("out"), py::arg("x"), py::arg("variance"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [..., I] bf16/fp16 rows in one pass, or false (CPU)",
        py::arg("out"), py::arg("gate"), py::arg("up"));
  m.def("silu_and_mul_halves", &silu_and_mul_halves,
        "silu(gate) * up of the [..., 2I] rows of the fused gate/up product, taken whole, or false (CPU)",
        py::arg("out"), py::arg("gate_up"));
  m.def("rotary_embedding", &rotary_embedding, "HF's apply_rotary_pos_emb of q and k in one call, or [] (CPU)",
        py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("unsqueeze_dim"), py::arg("partial"));
  m.def("write_kv", &write_kv, "a layer's new K/V [T, H, D] into their pages, or false (CPU)", py::arg("key"),
        py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("pages"), py::arg("offsets"));
  m.def("residual_add", &residual_add, "x += residual in place, or false (CPU)", py::arg("x"), py::arg("residual"));
  m.def("add_rms_norm", &add_rms_norm, "x += residual in place, then out = rms_norm(x), or false (CPU)",
        py::arg("out"), py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  register_prompt_attention(m);
}
