// Paged decode attention of bf16 pages with AVX512-BF16 dot products (built with cpu_kernels.cpp by
// cpu_kernels.py; issue 50, item 3): what cpu_kernels.cpp's decode computes, with the same tasks (one per
// sequence and KV head) and the same layer terms (first visible key, soft-capping, sinks, relative bias), but
// multiplying bf16 pairs as they lie in the pages (_mm512_dpbf16_ps, fp32 accumulation) where the generic loops
// widen every K/V value to fp32 first -- the decode's cost on this CPU. Nothing is repacked: a decode uses each
// key once per GQA head, too few times to pay for a copy in the prompt kernel's pair layout
// (bench/micro/decode_attention.py measures both).
//
// QK: a key row's D/32 vectors against the query's give 16 lane-wise partial sums; 16 keys' sums reduce together
// (sum_lanes16). The key rows of 16 keys stay in L1 for the GQA heads after the first. Softmax in fp32 (16 lanes
// at once), the probabilities rounded to bf16 for the PV product (as torch's bf16 attention and the prompt
// kernel round them). PV: two value rows interleaved by 16-bit unpacks give the (key 2i, key 2i + 1) pairs
// _mm512_dpbf16_ps multiplies with a probability pair; each interleaved vector serves every GQA head of a pass;
// the unpacks permute the dims within each 128-bit quarter, which one permutation undoes at the output.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_decode.h"  // DecodeExtras, sum_lanes16, exp_nonpositive(16)

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BATCHRUN_DECODE_BF16 1

using bf16 = at::BFloat16;

inline __m512i load_row32(const bf16* x) { return _mm512_loadu_si512(x); }  // 32 bf16

struct Pages {  // where a task's keys and values lie
  const bf16 *kh, *vh;  // the KV head's first key and value in page 0
  const int32_t* table;  // from the page holding the first visible key
  int64_t P, sk_p, sk_s, sv_p, sv_s;
};

// a page's rows of the head into L1 (D bf16 each, `stride` apart): the pages lie anywhere in the pool, and
// the hardware prefetcher, which follows addresses, does not cross from one to the next
template <int D>
inline void prefetch_rows(const bf16* row, int64_t rows, int64_t stride) {
  for (int64_t s = 0; s < rows; ++s)
    for (int c = 0; c < D * 2; c += 64) _mm_prefetch(reinterpret_cast<const char*>(row + s * stride) + c, _MM_HINT_T0);
}

// scores[j] = scale * q . key j for the n keys of the pages (j counted from the table's first page); `fetch`
// (the first GQA head's pass) prefetches the next page's keys and this page's values, the PV product's
template <int D>
void score_keys(const bf16* q, const Pages& pg, int64_t n, float scale, float* scores, bool fetch) {
  __m512i qv[D / 32];
  for (int c = 0; c < D / 32; ++c) qv[c] = load_row32(q + 32 * c);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t first = 0, b = 0; first < n; first += pg.P, ++b) {
    const bf16* kp = pg.kh + pg.table[b] * pg.sk_p;
    const int64_t in_page = std::min(pg.P, n - first);
    if (fetch) {
      if (first + pg.P < n)
        prefetch_rows<D>(pg.kh + pg.table[b + 1] * pg.sk_p, std::min(pg.P, n - first - pg.P), pg.sk_s);
      prefetch_rows<D>(pg.vh + pg.table[b] * pg.sv_p, in_page, pg.sv_s);
    }
    for (int64_t s0 = 0; s0 < in_page; s0 += 16) {
      const int64_t m = std::min<int64_t>(16, in_page - s0);
      __m512 part[16];
      for (int s = 0; s < 16; ++s) {
        part[s] = _mm512_setzero_ps();
        if (s < m) {
          const bf16* key = kp + (s0 + s) * pg.sk_s;
          for (int c = 0; c < D / 32; ++c) part[s] = dot2(part[s], qv[c], load_row32(key + 32 * c));
        }
      }
      _mm512_mask_storeu_ps(scores + first + s0, static_cast<__mmask16>((1u << m) - 1),
                            _mm512_mul_ps(sum_lanes16(part), sv));
    }
  }
}

// probs[j] (bf16, rounded up to whole vectors, zeros past n and before `hidden`) = e^(scores[j] - max); returns
// their sum in fp32, the sink's term (sink: nullptr for none) included
inline float softmax(float* scores, int64_t hidden, int64_t n, const float* sink, bf16* probs) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < hidden; ++j) scores[j] = -INFINITY;  // before the window or the chunk
  auto tail = [&](int64_t j) { return static_cast<__mmask16>(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1); };
  __m512 mx = neg_inf;
  for (int64_t j = 0; j < n; j += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, tail(j), scores + j));
  float m = _mm512_reduce_max_ps(mx);
  if (sink) m = std::max(m, *sink);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 x = _mm512_mask_loadu_ps(neg_inf, tail(j), scores + j);
    const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ),
                                         exp_nonpositive16(_mm512_sub_ps(x, mv)));
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j), (__m256i)_mm512_cvtneps_pbh(p));
  }
  return _mm512_reduce_add_ps(sum) + (sink ? exp_nonpositive(*sink - m) : 0.f);
}

// out rows of up to R heads (probs of head r at probs + r * pstride): the probability-weighted sum of the n values
template <int D, int R>
void sum_values(const bf16* probs, int64_t pstride, int nr, const Pages& pg, int64_t n, const float* inv,
                bf16* const* orow) {
  constexpr int C = D / 16;  // accumulators per head: (dims of a 128-bit quarter's low or high half) x quarters
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t first = 0, b = 0; first < n; first += pg.P, ++b) {
    const bf16* vp = pg.vh + pg.table[b] * pg.sv_p;
    const int64_t in_page = std::min(pg.P, n - first);
    for (int64_t j = 0; j < in_page; j += 2) {  // keys first + j and first + j + 1 (P even: both in this page)
      const bf16* v0 = vp + j * pg.sv_s;
      __m512i vv[C];
      for (int c = 0; c < D / 32; ++c) {
        const __m512i a = load_row32(v0 + 32 * c);
        // past the context: zeros, never read (the page's rest may never have been written)
        const __m512i b2 = j + 1 < in_page ? load_row32(v0 + pg.sv_s + 32 * c) : _mm512_setzero_si512();
        vv[2 * c] = _mm512_unpacklo_epi16(a, b2);  // quarter q: dims 32c + 8q + 0..3, each a (key, key + 1) pair
        vv[2 * c + 1] = _mm512_unpackhi_epi16(a, b2);  // dims 32c + 8q + 4..7
      }
      for (int r = 0; r < R; ++r) {
        if (r < nr) {
          const __m512i pp = bcast_pair(probs + r * pstride + first + j);
          for (int c = 0; c < C; ++c) acc[r][c] = dot2(acc[r][c], pp, vv[c]);
        }
      }
    }
  }
  // lanes 4q + i of the low and high halves hold dims 8q + i and 8q + 4 + i: in order, 16 dims at a time
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < nr; ++r) {
    const __m512 scale = _mm512_set1_ps(inv[r]);
    for (int c = 0; c < D / 32; ++c) {
      const __m512 lo = acc[r][2 * c], hi = acc[r][2 * c + 1];
      const __m512 x0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first16, hi), scale);
      const __m512 x1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second16, hi), scale);
      _mm512_storeu_si512(orow[r] + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
    }
  }
}

template <int D>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& token_index,
            float scale, const batchrun::DecodeExtras& extras) {
  constexpr int R = D == 128 ? 2 : D == 64 ? 4 : 8;  // GQA heads per PV pass: R x D/16 accumulators
  const int64_t G = seq_lens.size(0), num_heads = query.size(1), num_kv_heads = k_cache.size(2);
  const int64_t gqa = num_heads / num_kv_heads;
  const bf16* q = query.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* rows = token_index.data_ptr<int64_t>();
  const int64_t sq_t = query.stride(0), sq_h = query.stride(1), so_t = out.stride(0), so_h = out.stride(1);
  const int64_t st = block_tables.stride(0);
  Pages base{k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), nullptr, k_cache.size(1), k_cache.stride(0),
             k_cache.stride(1), v_cache.stride(0), v_cache.stride(1)};
  const int64_t sk_h = k_cache.stride(2), sv_h = v_cache.stride(2);

  at::parallel_for(0, G * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<bf16> probs;
    std::vector<float> inv(gqa);
    std::vector<bf16*> orow(gqa);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / num_kv_heads, h = task % num_kv_heads;  // sequence-major, as cpu_kernels.cpp
      const int64_t t = rows[g], ctx = lens[g];
      const int64_t first = extras.first_keys ? extras.first_keys[g] : 0;
      const int64_t first_page = first / base.P, hidden = first - first_page * base.P;
      const int64_t n = ctx - first_page * base.P, padded = (n + 15) / 16 * 16;
      Pages pg = base;
      pg.kh += h * sk_h, pg.vh += h * sv_h, pg.table = tables + g * st + first_page;
      scores.resize(padded);
      probs.resize(gqa * padded);
      for (int64_t r = 0; r < gqa; ++r) {
        const int64_t head = h * gqa + r;
        score_keys<D>(q + t * sq_t + head * sq_h, pg, n, scale, scores.data(), r == 0);
        if (extras.softcap > 0.f) {
          const float cap = extras.softcap, inv_cap = 1.f / extras.softcap;
          for (int64_t j = hidden; j < n; ++j) scores[j] = cap * std::tanh(scores[j] * inv_cap);
        }
        if (extras.rel) {  // key j is at position first_page * P + j, the query at ctx - 1
          const float* bias = extras.rel + t * extras.rel_st + head * extras.rel_sh;
          const int64_t last = ctx - 1 - first_page * base.P;  // the query's own j
          for (int64_t j = std::max(hidden, last - extras.rel_extent + 1); j < n; ++j) scores[j] += bias[last - j];
        }
        if (extras.alibi)
          batchrun::subtract_alibi(scores.data(), extras.alibi[head], hidden, n, ctx - 1 - first_page * base.P);
        const float* sink = extras.sinks ? extras.sinks + t * extras.sink_stride + head : nullptr;
        inv[r] = 1.f / softmax(scores.data(), hidden, n, sink, probs.data() + r * padded);
        orow[r] = o + t * so_t + head * so_h;
      }
      for (int64_t r0 = 0; r0 < gqa; r0 += R)
        sum_values<D, R>(probs.data() + r0 * padded, padded, static_cast<int>(std::min<int64_t>(R, gqa - r0)), pg,
                         n, inv.data() + r0, orow.data() + r0);
    }
  });
}
#endif

}  // namespace

bool batchrun::paged_decode_bf16(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, const at::Tensor& token_index, double scale,
                                 const DecodeExtras& extras) {
#ifdef BATCHRUN_DECODE_BF16
  const int64_t D = query.size(2);
  if (D != v_cache.size(3) || k_cache.size(1) % 2 != 0) return false;
  const float s = static_cast<float>(scale);
  switch (D) {
    case 32:
      return decode<32>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, s, extras), true;
    case 64:
      return decode<64>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, s, extras), true;
    case 128:
      return decode<128>(out, query, k_cache, v_cache, block_tables, seq_lens, token_index, s, extras), true;
    default:
      return false;
  }
#else
  return false;
#endif
}
