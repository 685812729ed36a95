// Paged decode attention for the CPU: each decoding sequence's one query token attends over its K/V where
// they lie in the pages, walking its block table -- no copy of the pages into a workspace.
//
// One task per (sequence, KV head), spread over the intra-op threads: the GQA query heads of that KV head are
// scored against every key of the context (fp32 accumulation; bf16/fp16 pages widened on load), softmaxed, and
// the values summed with those weights. Shapes:
//   out, query  [T, Hq, D] (any strides but a unit last one)   k_cache, v_cache [num_pages, P, Hkv, D]
//   block_tables [G, max_blocks] int32   seq_lens [G] int32 (context, the new token included)
//   token_index [G] int64: the packed row of each decoding sequence's query (and output)
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the pages (CPU)");
}
