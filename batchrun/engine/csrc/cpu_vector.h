// What batchrun's C++ CPU kernels share (cpu_kernels.cpp, cpu_elementwise.cpp, cpu_prompt_attention.cpp,
// cpu_decode_bf16.cpp, cpu_residual.cpp, compiled into one module by cpu_kernels.py): widening a value of the
// model's dtype to fp32, 16 of them at once on AVX-512, and 16 fp32 lanes stored in it (rounded as torch rounds);
// e^x for x <= 0 in plain arithmetic (one value or 16 lanes), and the bf16 pair products of AVX512-BF16. Inside an unnamed namespace: each source gets its own copy, no symbol is exported.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

#ifdef __AVX512F__
// 16 elements widened to fp32
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {  // each bf16 the top half of an fp32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
#endif

// e^x for x <= 0 (the softmax's exponent, SiLU's e^-|x|), in plain arithmetic so that a loop over it vectorizes
// (std::exp is a scalar call here): 2^(x log2 e) = 2^i * 2^f, 2^f by a degree-6 polynomial on [0, 1); relative
// error about 2e-7. Each step of the polynomial an FMA, as the 16 lanes' below: the same value on every CPU,
// whatever the compiler would contract
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float i = std::floor(t);
  const float f = t - i;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, f, 1.339887440266574e-3f);
  p = std::fma(p, f, 9.618437357674640e-3f);
  p = std::fma(p, f, 5.550332471162809e-2f);
  p = std::fma(p, f, 2.402264791363012e-1f);
  p = std::fma(p, f, 6.931472028550421e-1f);
  p = std::fma(p, f, 1.0f);
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef __AVX512F__
// exp_nonpositive, 16 lanes at once (the same polynomial and clamp)
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, i);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(i), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#ifdef __AVX512F__
// 16 fp32 lanes stored in the dtype (cpu_elementwise.cpp, cpu_residual.cpp): round to nearest even (a NaN to bf16's quiet NaN), as c10::BFloat16's conversion: the bf16 in each lane's low half
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
inline void store16(at::BFloat16* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline void store16(at::Half* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// v rounded to the dtype and widened back, in registers
template <typename T>
inline __m512 round16(__m512 v);
template <>
inline __m512 round16<at::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
template <>
inline __m512 round16<at::Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// the bf16 attention kernels' products (cpu_prompt_attention.cpp, cpu_decode_bf16.cpp): two bf16 as one 32-bit
// lane, in every lane; and acc + the pairs' dot products, lane by lane (vdpbf16ps)
inline __m512i bcast_pair(const at::BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return _mm512_set1_epi32(pair);
}

inline __m512 dot2(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
#endif

}  // namespace
