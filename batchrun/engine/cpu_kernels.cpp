// batchrun's C++ kernels for the CPU (built and loaded by cpu_kernels.py):
//
// 1. Paged decode attention: each decoding sequence's one query token attends over its K/V where they lie in the
// pages, walking its block table -- no copy of the pages into a workspace.
// One task per (sequence, KV head), spread over the intra-op threads: the GQA query heads of that KV head are
// scored against every key of the context (fp32 accumulation; bf16/fp16 pages widened on load), softmaxed, and
// the values summed with those weights. Shapes:
//   out, query  [T, Hq, D] (any strides but a unit last one)   k_cache, v_cache [num_pages, P, Hkv, D]
//   block_tables [G, max_blocks] int32   seq_lens [G] int32 (context, the new token included)
//   token_index [G] int64: the packed row of each decoding sequence's query (and output)
//
// 2. Greedy argmax over rows of logits [N, V] (fp32 or bf16), as torch.argmax decides it (the first index of the
// largest value; a NaN counts as the largest), at the speed of a plain reduction: on 256 x 49,152 fp32 logits
// torch's argmax took 5.3 ms, its amax 0.57 and this 0.58 (bench/host_ops.py, 2 threads); at 256 rows a step it
// was most of the host's time outside the forward.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

// e^x for the softmax's x <= 0, in plain arithmetic so that the loop vectorizes (std::exp is a scalar call
// here): 2^(x log2 e) = 2^i * 2^f, 2^f by a degree-6 polynomial on [0, 1); relative error about 2e-7
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float i = std::floor(t);
  const float f = t - i;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

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

template <int kD, typename T>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& token_index,
            double scale) {
  const int64_t G = seq_lens.size(0);
  const int64_t num_heads = query.size(1), D = query.size(2);
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
    std::vector<float> qf(gqa * D), acc(gqa * D), total(gqa), scores;
    for (int64_t task = begin; task < end; ++task) {
      // sequence-major: consecutive tasks read neighbouring head slices of the same pages
      const int64_t g = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t t = rows[g], ctx = lens[g];
      const int32_t* table = tables + g * st;
      for (int64_t r = 0; r < gqa; ++r) {
        const T* qr = q + t * sq_t + (h * gqa + r) * sq_h;
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = widen(qr[d]) * static_cast<float>(scale);
      }
      // scores [gqa, ctx]: the keys page by page, each key row loaded once for the gqa query rows
      scores.resize(gqa * ctx);
      for (int64_t first = 0, b = 0; first < ctx; first += P, ++b) {
        const int64_t n = std::min(P, ctx - first);
        const T* kp = k + table[b] * sk_p + h * sk_h;
        for (int64_t s = 0; s < n; ++s) {
          for (int64_t r = 0; r < gqa; ++r) scores[r * ctx + first + s] = dot<kD>(qf.data() + r * D, kp + s * sk_s, D);
        }
      }
      for (int64_t r = 0; r < gqa; ++r) {
        float* sr = scores.data() + r * ctx;
        float m = -INFINITY;
        for (int64_t j = 0; j < ctx; ++j) m = sr[j] > m ? sr[j] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < ctx; ++j) {
          sr[j] = exp_nonpositive(sr[j] - m);
          sum += sr[j];
        }
        total[r] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t first = 0, b = 0; first < ctx; first += P, ++b) {
        const int64_t n = std::min(P, ctx - first);
        const T* vp = v + table[b] * sv_p + h * sv_h;
        for (int64_t s = 0; s < n; ++s) {
          for (int64_t r = 0; r < gqa; ++r) axpy<kD>(acc.data() + r * D, scores[r * ctx + first + s], vp + s * sv_s, D);
        }
      }
      for (int64_t r = 0; r < gqa; ++r) {
        T* orow = o + t * so_t + (h * gqa + r) * so_h;
        const float inv = 1.f / total[r];
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[r * D + d] * inv);
      }
    }
  });
}

template <typename T>
void decode_any(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& token_index,
                double scale) {
  switch (query.size(2)) {  // the common head dims unrolled at compile time
    case 64:
      return decode<64, T>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale);
    case 128:
      return decode<128, T>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale);
    default:
      return decode<0, T>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale);
  }
}

}  // namespace

void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, at::Tensor token_index, double scale) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "unit stride in the head dimension");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, pages and output share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  token_index.scalar_type() == at::kLong,
              "int32 block tables and lengths, int64 token index");
  switch (query.scalar_type()) {
    case at::kFloat:
      decode_any<float>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale);
      break;
    case at::kBFloat16:
      decode_any<at::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale);
      break;
    case at::kHalf:
      decode_any<at::Half>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, scale);
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

#ifdef __AVX512F__
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {  // 16 bf16 widened to fp32: each the top half of one
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the pages (CPU)");
  m.def("argmax_rows", &argmax_rows, "greedy argmax of each row of [N, V] logits, as torch.argmax (CPU)");
}
