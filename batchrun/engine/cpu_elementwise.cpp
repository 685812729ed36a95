// Fused elementwise work of a bf16/fp16 decoder layer, on the CPU (built with cpu_kernels.cpp by cpu_kernels.py;
// engine/fused_elementwise.py decides where they replace HF's modules, issue 50):
//
// 1. rms_norm: Llama-style RMSNorm, `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)`, in one
// pass over each row (two reads of it, one write), where HF's module makes six passes and four temporaries
// (upcast, pow, mean, rsqrt and mul, downcast, mul). The two roundings to the model's dtype HF makes (after the
// normalization, after the weight) are made here too; only the sum of squares is added in another order, so a
// value can differ from HF's by one unit in the last place of bf16 where the variance's last bits decide it.
//
// 2. silu_and_mul: `silu(gate) * up` of a gated MLP (gate and up the halves of the fused gate/up product, any row
// stride), one pass instead of three (silu, its rounding, the multiply), rounding silu(gate) to the dtype before
// the multiply as HF's two operations do; e^x by the same polynomial as the attention's softmax (relative error
// about 2e-7, against torch's vectorized exp), so a value can differ from HF's in its last bf16 place.
//
// Both take an AVX-512 path for rows whose width is a multiple of 16 and the generic (scalar) loops otherwise,
// or where the compiler has no AVX-512. fp32 never comes here: the sums' order would show (fused_elementwise.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "cpu_vector.h"  // widen, load16, exp_nonpositive(16)

namespace {

template <typename T>
inline T narrow(float x) {  // round to nearest even, as torch's own conversion
  return static_cast<T>(x);
}

// silu(x) = x * sigmoid(x), sigmoid from e^-|x| (never overflows). Far left, torch's own: it computes
// x / (1 + e^-x), whose e^-x is infinite below -ln(FLT_MAX) (silu -0) and exact to there, where exp_nonpositive
// stops at e^-87 (a tiny value where HF's is 0, hundreds of bf16 places off): e^-|x| as (e^-|x|/2)^2 past -87.
constexpr float kSiluZero = -88.72283935546875f;  // -ln(FLT_MAX): torch's e^-x is inf below it
constexpr float kExpFloor = -87.0f;                // exp_nonpositive's clamp
inline float silu(float x) {
  if (x < kSiluZero) return -0.f;
  const float a = -std::fabs(x);
  const float h = a < kExpFloor ? exp_nonpositive(0.5f * a) : 0.f;
  const float e = a < kExpFloor ? h * h : exp_nonpositive(a);
  return x * (x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
}

#ifdef __AVX512F__
// round to nearest even (a NaN to bf16's quiet NaN), as c10::BFloat16's conversion: the bf16 in each lane's low half
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

inline __m512 silu16(__m512 x) {  // as silu above
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 a = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x));
  __m512 e = exp_nonpositive16(a);
  const __mmask16 deep = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kExpFloor), _CMP_LT_OQ);
  if (deep) {
    const __m512 h = exp_nonpositive16(_mm512_mul_ps(a, _mm512_set1_ps(0.5f)));
    e = _mm512_mask_mul_ps(e, deep, h, h);
  }
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_mov_ps(one, negative, e);
  const __m512 y = _mm512_mul_ps(x, _mm512_div_ps(numerator, _mm512_add_ps(one, e)));
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kSiluZero), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(y, zero, _mm512_set1_ps(-0.f));
}
#endif

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  int64_t j = 0;
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (; j < n; j += 16) {
      const __m512 v = load16(x + j);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
    const __m512 scale = _mm512_set1_ps(r);
    for (j = 0; j < n; j += 16)
      store16(out + j, _mm512_mul_ps(load16(w + j), round16<T>(_mm512_mul_ps(load16(x + j), scale))));
    return;
  }
#endif
  float sum = 0.f;
  for (j = 0; j < n; ++j) sum += widen(x[j]) * widen(x[j]);
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (j = 0; j < n; ++j) out[j] = narrow<T>(widen(w[j]) * widen(narrow<T>(widen(x[j]) * r)));
}

template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    for (int64_t j = 0; j < n; j += 16)
      store16(out + j, _mm512_mul_ps(round16<T>(silu16(load16(gate + j))), load16(up + j)));
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = narrow<T>(widen(narrow<T>(silu(widen(gate[j])))) * widen(up[j]));
}

template <typename T>
void rms_norm_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0), out_stride = out.stride(0);
  const T* src = reinterpret_cast<const T*>(x.data_ptr());
  const T* weight = reinterpret_cast<const T*>(w.data_ptr());
  T* dst = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(dst + r * out_stride, src + r * stride, weight, n, eps);
  });
}

template <typename T>
void silu_and_mul_typed(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  const int64_t rows = gate.size(0), n = gate.size(1);
  const int64_t gs = gate.stride(0), us = up.stride(0), os = out.stride(0);
  const T* g = reinterpret_cast<const T*>(gate.data_ptr());
  const T* u = reinterpret_cast<const T*>(up.data_ptr());
  T* dst = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_and_mul_row(dst + r * os, g + r * gs, u + r * us, n);
  });
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, what, ": [N, H] on the CPU, unit last stride");
  TORCH_CHECK(t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), what, ": shapes or dtypes differ");
}

}  // namespace

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, x, "rms_norm");
  check_rows(out, x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: a contiguous [H] weight of the input's dtype");
  switch (x.scalar_type()) {
    case at::kBFloat16:
      rms_norm_typed<at::BFloat16>(out, x, weight, static_cast<float>(eps));
      break;
    case at::kHalf:
      rms_norm_typed<at::Half>(out, x, weight, static_cast<float>(eps));
      break;
    default:
      TORCH_CHECK(false, "rms_norm: bfloat16 or float16");
  }
}

void silu_and_mul(at::Tensor out, at::Tensor gate, at::Tensor up) {
  check_rows(gate, gate, "silu_and_mul");
  check_rows(up, gate, "silu_and_mul");
  check_rows(out, gate, "silu_and_mul");
  switch (gate.scalar_type()) {
    case at::kBFloat16:
      silu_and_mul_typed<at::BFloat16>(out, gate, up);
      break;
    case at::kHalf:
      silu_and_mul_typed<at::Half>(out, gate, up);
      break;
    default:
      TORCH_CHECK(false, "silu_and_mul: bfloat16 or float16");
  }
}
