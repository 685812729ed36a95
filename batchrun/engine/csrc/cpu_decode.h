// What the paged decode kernels share (cpu_kernels.cpp: every dtype; cpu_decode_bf16.cpp: bf16 pages with
// AVX512-BF16): the layer's terms beyond full causal attention, 16 horizontal sums at once, and the bf16 entry
// point, which says whether it took the call.
#pragma once

#include "cpu_vector.h"  // widen, load16, exp_nonpositive, exp_nonpositive16

namespace batchrun {

// What a layer asks of a decode beyond full causal attention (cpu_kernels.cpp's header describes each)
struct DecodeExtras {
  const int32_t* first_keys = nullptr;  // nullptr: every sequence sees its whole context
  float softcap = 0.f;                  // 0: off
  const float* sinks = nullptr;         // nullptr: none; else row t's sink of a head at t * sink_stride + head
  int64_t sink_stride = 0;              // 0: one per head
  const float* rel = nullptr;           // nullptr: none; else row t's bias of a head at t * rel_st + head * rel_sh
  int64_t rel_extent = 0, rel_st = 0, rel_sh = 0;
  const float* alibi = nullptr;  // nullptr: none; else each query head's ALiBi slope
};

// ALiBi: the head's slope times the key's distance behind the query, taken from scores[hidden, n) (key j,
// the query's own j `last`), as the eager reference adds -slope * (query position - key position)
inline void subtract_alibi(float* scores, float slope, int64_t hidden, int64_t n, int64_t last) {
  for (int64_t j = hidden; j < n; ++j) scores[j] += -slope * static_cast<float>(last - j);
}

// The bf16 decode with AVX512-BF16 dot products (cpu_decode_bf16.cpp): false, computing nothing, where this
// build (no AVX512-BF16) or the shape (head dims other than 32/64/128 or unequal, pages of an odd size) is not
// its, and the caller's widening fp32 loops run instead.
bool paged_decode_bf16(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       const at::Tensor& token_index, double scale, const DecodeExtras& extras);

}  // namespace batchrun

namespace {

#ifdef __AVX512F__
// lane s of the result: the sum of v[s]'s 16 lanes -- 16 horizontal sums in 15 additions (halving the
// vectors' width each round), instead of a reduction of its own for each
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 128-bit quarters: [v2i 0+2, v2i 1+3, v2i+1 0+2, v2i+1 1+3]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter j: 4 partial sums of v(4i + j)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter j: 2 partial sums each of v(8i + j) and v(8i + 4 + j), interleaved
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  // lane 4j + i: the sum of v(4i + j); one permutation puts sum s in lane s
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
}
#endif

}  // namespace
