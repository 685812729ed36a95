// A decoder layer's residual adds in place (built with cpu_kernels.cpp by cpu_kernels.py; engine/model/ops/fused_residual.py
// decides where): `residual + hidden_states` written into hidden_states, the attention's or the MLP's output (a
// tensor the layer's own product just made, read by nothing else), instead of a new tensor each; and the first
// add with the post-attention RMSNorm after it in one call (bf16/fp16). Each sum is torch's: both values widened
// to fp32, added, rounded once to the dtype (fp32: the add itself), so the values are HF's bit for bit; the norm is
// rms_norm's (cpu_elementwise.cpp). An AVX-512 path over 16 values at a time and the generic loop for the rest,
// or everywhere where the compiler has no AVX-512 (a tensor of fewer than 16 values, or the tail past a multiple of
// 16, takes the generic loop here too: the tests' odd sizes).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "cpu_vector.h"  // widen, load16, store16

bool rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);  // cpu_elementwise.cpp

namespace {

template <typename T>
void add_into(T* x, const T* r, int64_t begin, int64_t end) {
  int64_t i = begin;
#ifdef __AVX512F__
  for (; i + 16 <= end; i += 16) store16(x + i, _mm512_add_ps(load16(x + i), load16(r + i)));
#endif
  for (; i < end; ++i) x[i] = static_cast<T>(widen(x[i]) + widen(r[i]));
}

template <typename T>
void add_typed(at::Tensor& x, const at::Tensor& r) {
  T* dst = reinterpret_cast<T*>(x.data_ptr());
  const T* src = reinterpret_cast<const T*>(r.data_ptr());
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t begin, int64_t end) { add_into(dst, src, begin, end); });
}

bool fits(const at::Tensor& x, const at::Tensor& r) {
  return x.device().is_cpu() && r.device().is_cpu() && x.sizes() == r.sizes() &&
         x.scalar_type() == r.scalar_type() && x.is_contiguous() && r.is_contiguous() && !x.is_same(r);
}

void add(at::Tensor& x, const at::Tensor& r) {
  switch (x.scalar_type()) {
    case at::kFloat:
      add_typed<float>(x, r);
      break;
    case at::kBFloat16:
      add_typed<at::BFloat16>(x, r);
      break;
    default:
      add_typed<at::Half>(x, r);
  }
}

bool float_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
}

}  // namespace

// x += residual in place (contiguous tensors of one shape and dtype: fp32, bf16 or fp16); false, computing
// nothing, for anything else
bool residual_add(at::Tensor x, at::Tensor residual) {
  if (!fits(x, residual) || !float_dtype(x)) return false;
  add(x, residual);
  return true;
}

// x += residual in place, then out = the RMSNorm of x (rms_norm's, bf16/fp16); false, computing nothing, where
// residual_add or rms_norm would decline
bool add_rms_norm(at::Tensor out, at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  if (!fits(x, residual) || !fits(out, x) || (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf))
    return false;
  // rms_norm's own checks of the weight, made before x is written: declining must leave x as it was
  if (weight.dim() != 1 || !weight.is_contiguous() || weight.size(0) != x.size(-1) ||
      weight.scalar_type() != x.scalar_type())
    return false;
  add(x, residual);
  return rms_norm(out, x, weight, eps);  // contiguous rows: always taken
}
