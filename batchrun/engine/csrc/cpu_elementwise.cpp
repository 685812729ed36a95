// Fused elementwise work of a bf16/fp16 decoder layer, on the CPU (built with cpu_kernels.cpp by cpu_kernels.py;
// engine/model/ops/fused_elementwise.py decides where they replace HF's modules, issue 50):
//
// 1. rms_norm: Llama-style RMSNorm, `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)`, in one
// pass over each row (two reads of it, one write), where HF's module makes six passes and four temporaries
// (upcast, pow, mean, rsqrt and mul, downcast, mul). The two roundings to the model's dtype HF makes (after the
// normalization, after the weight) are made here too; only the sum of squares is added in another order (one
// order on every CPU: sum_of_squares), so a value can differ from HF's by one unit in the last place of bf16
// where the variance's last bits decide it.
//
// 2. silu_and_mul: `silu(gate) * up` of a gated MLP (gate and up the halves of the fused gate/up product, any row
// stride), one pass instead of three (silu, its rounding, the multiply), rounding silu(gate) to the dtype before
// the multiply as HF's two operations do; e^x by the same polynomial as the attention's softmax (relative error
// about 2e-7, against torch's vectorized exp), so a value can differ from HF's in its last bf16 place.
//
// Both take their tensors' [..., H] rows as they come where the leading dims are one run of rows one stride
// apart (a layer's [1, T, H] hidden states, a column slice of the fused product), no reshape or view per call,
// and return false for any other layout (the module then makes it contiguous). Both take an AVX-512 path (the
// norm for each 16 values of a row, its tail by the generic loop; SiLU-and-mul for rows whose width is a multiple
// of 16) and the generic loops otherwise, or where the compiler has no AVX-512 (an AVX2 CPU: `make test-avx2`
// runs them on any). fp32 never comes here: the sums' order would show (fused_elementwise.py).
//
// 3. rotary_embedding: HF's `apply_rotary_pos_emb` (q * cos + rotate_half(q) * sin, and k's) in one call, for fp32
// and bf16/fp16 alike (engine/model/ops/fused_rotary.py): each value is HF's own, bit for bit. The two products are rounded
// to the dtype, the second's sign flipped where rotate_half negates (exact), and their sum rounded, as HF's
// separate operations do; no FMA (an asm barrier keeps the compiler from contracting a product into the add,
// whatever -ffp-contract says). A bf16/fp16 product is exact in fp32, so its one rounding is the dtype's, as
// torch's. Dims past cos's width (partial rotary) are copied, as HF's `torch.cat` of the pass-through part.
//
// 4. rms_norm_scale: an fp32 RMSNorm's steps after its variance, `weight * (x * rsqrt(variance + eps))`, in one
// pass, given the variance [..., 1] as ATen made it (`x.pow(2).mean(-1, keepdim=True)`: the sum's order is ATen's
// and would show). Each later step is one IEEE operation, as each of ATen's is: the add, then rsqrt as a correctly
// rounded square root and division (torch.rsqrt's fp32 values are exactly those), then the two products (no add
// to contract them into), so every value is HF's bit for bit (engine/model/ops/fused_elementwise.py `ExactRMSNorm`).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <optional>

#include "cpu_vector.h"  // widen, load16, store16, round16, exp_nonpositive(16)

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

// The sum of a row's squares in one order on every CPU: 16 running sums (sum l takes x[l], x[l + 16], ...; each
// square added with one rounding, as an FMA makes it), then halved (sum l + sum l + 8, ..., as a vector's halves
// are added). The AVX-512 path fills the 16 sums as one vector, the generic loop one by one; a single running sum
// (the loop's old order) strays further from torch's and put a fp16 value two places from HF's on an AVX2 CPU.
template <typename T>
float sum_of_squares(const T* x, int64_t n) {
  alignas(64) float sums[16] = {};
  int64_t j = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 v = load16(x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  _mm512_store_ps(sums, acc);
#endif
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) sums[l] = std::fma(widen(x[j + l]), widen(x[j + l]), sums[l]);
  for (int l = 0; j < n; ++j, ++l) sums[l] = std::fma(widen(x[j]), widen(x[j]), sums[l]);
  for (int half = 8; half > 0; half /= 2)
    for (int l = 0; l < half; ++l) sums[l] += sums[l + half];
  return sums[0];
}

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  const float r = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 scale = _mm512_set1_ps(r);
  for (; j + 16 <= n; j += 16)
    store16(out + j, _mm512_mul_ps(load16(w + j), round16<T>(_mm512_mul_ps(load16(x + j), scale))));
#endif
  for (; j < n; ++j) out[j] = narrow<T>(widen(w[j]) * widen(narrow<T>(widen(x[j]) * r)));
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

// x kept in a register the compiler cannot see into: a product it passes is never fused into the next add
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
inline float opaque(float x) {
  asm("" : "+x"(x));
  return x;
}
#else
inline float opaque(float x) {
  volatile float v = x;
  return v;
}
#endif
#ifdef __AVX512F__
inline __m512 opaque16(__m512 x) {
  asm("" : "+v"(x));
  return x;
}
// a vector rounded to the dtype and widened back; fp32's own already is
template <typename T>
inline __m512 rounded16(__m512 v) {
  return round16<T>(v);
}
template <>
inline __m512 rounded16<float>(__m512 v) {
  return v;
}
#endif

template <typename T>
inline float rounded(float x) {  // to the dtype and back (fp32: itself)
  return widen(narrow<T>(x));
}

// one head's row: out[j] = x[j] cos[j] - x[j + h] sin[j], out[j + h] = x[j + h] cos[j + h] + x[j] sin[j + h] for
// j < h = rot / 2, each product and the sum rounded to the dtype; out[j] = x[j] past rot
template <typename T>
void rotary_row(T* out, const T* x, const T* c, const T* s, int64_t rot, int64_t dim) {
  const int64_t h = rot / 2;
  int64_t j = 0;
#ifdef __AVX512F__
  if (h % 16 == 0) {
    for (; j < h; j += 16) {
      const __m512 x1 = load16(x + j), x2 = load16(x + j + h);
      const __m512 a1 = opaque16(rounded16<T>(_mm512_mul_ps(x1, load16(c + j))));
      const __m512 b1 = opaque16(rounded16<T>(_mm512_mul_ps(x2, load16(s + j))));
      const __m512 a2 = opaque16(rounded16<T>(_mm512_mul_ps(x2, load16(c + j + h))));
      const __m512 b2 = opaque16(rounded16<T>(_mm512_mul_ps(x1, load16(s + j + h))));
      store16(out + j, _mm512_sub_ps(a1, b1));
      store16(out + j + h, _mm512_add_ps(a2, b2));
    }
  }
#endif
  for (; j < h; ++j) {
    const float x1 = widen(x[j]), x2 = widen(x[j + h]);
    const float a1 = opaque(rounded<T>(x1 * widen(c[j]))), b1 = opaque(rounded<T>(x2 * widen(s[j])));
    const float a2 = opaque(rounded<T>(x2 * widen(c[j + h]))), b2 = opaque(rounded<T>(x1 * widen(s[j + h])));
    out[j] = narrow<T>(a1 - b1);
    out[j + h] = narrow<T>(a2 + b2);
  }
  if (rot < dim) std::memcpy(out + rot, x + rot, (dim - rot) * sizeof(T));
}

// a tensor's rows: every dim but the last, as one run of `count` rows `stride` apart (unit last stride)
struct Rows {
  int64_t count, stride;
};

// t's rows where its leading dims collapse into one stride (a view of [N, H] rows: a decoder layer's [1, T, H]
// hidden states, a column slice of a wider product), else nullopt
std::optional<Rows> rows_of(const at::Tensor& t) {
  if (t.dim() == 0 || t.stride(-1) != 1) return std::nullopt;
  const int64_t n = t.size(-1);
  int64_t stride = -1, next = -1;
  for (int64_t i = t.dim() - 2; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (stride < 0) {
      stride = t.stride(i);
      next = stride * t.size(i);
    } else if (t.stride(i) != next) {
      return std::nullopt;
    } else {
      next *= t.size(i);
    }
  }
  if (stride < 0) stride = n;  // one row
  if (stride < n) return std::nullopt;  // overlapping rows
  return Rows{n == 0 ? 0 : t.numel() / n, stride};
}

template <typename T>
void rms_norm_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, float eps, Rows xr, Rows outr) {
  const int64_t n = x.size(-1);
  const T* src = reinterpret_cast<const T*>(x.data_ptr());
  const T* weight = reinterpret_cast<const T*>(w.data_ptr());
  T* dst = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, xr.count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(dst + r * outr.stride, src + r * xr.stride, weight, n, eps);
  });
}

// g and u: each row's gate and up, n wide (the rows of two tensors, or the halves of one)
template <typename T>
void silu_and_mul_typed(T* dst, const T* g, const T* u, int64_t n, Rows gr, Rows ur, Rows outr) {
  at::parallel_for(0, gr.count, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_and_mul_row(dst + r * outr.stride, g + r * gr.stride, u + r * ur.stride, n);
  });
}

// [B, H, T, D] (unsqueeze_dim 1) or [B, T, H, D] (2) tensors, cos/sin [B or 1, T, rot]: every head of each token
template <typename T>
void rotary_typed(const at::Tensor& q, const at::Tensor& k, at::Tensor& qo, at::Tensor& ko, const at::Tensor& cos,
                  const at::Tensor& sin, int64_t token_axis) {
  const int64_t head_axis = 3 - token_axis, B = q.size(0), S = q.size(token_axis), D = q.size(3);
  const int64_t rot = cos.size(2);
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), sb = sin.size(0) == 1 ? 0 : sin.stride(0);
  const T* c = reinterpret_cast<const T*>(cos.data_ptr());
  const T* s = reinterpret_cast<const T*>(sin.data_ptr());
  at::parallel_for(0, B * S, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / S, t = i % S;
      const T* ct = c + b * cb + t * cos.stride(1);
      const T* st = s + b * sb + t * sin.stride(1);
      for (const auto* pair : {&q, &k}) {
        const at::Tensor& x = *pair;
        at::Tensor& o = pair == &q ? qo : ko;
        const T* src = reinterpret_cast<const T*>(x.data_ptr()) + b * x.stride(0) + t * x.stride(token_axis);
        T* dst = reinterpret_cast<T*>(o.data_ptr()) + b * o.stride(0) + t * o.stride(token_axis);
        for (int64_t hd = 0; hd < x.size(head_axis); ++hd)
          rotary_row(dst + hd * o.stride(head_axis), src + hd * x.stride(head_axis), ct, st, rot, D);
      }
    }
  });
}

// an empty tensor of x's shape whose dims lie in memory in the order of x's strides (as torch's elementwise
// operations lay out their output: what follows, a transpose back to tokens first, finds the layout HF's has)
at::Tensor empty_as(const at::Tensor& x) {
  std::vector<int64_t> order{0, 1, 2, 3};
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  std::vector<int64_t> strides(4);
  int64_t step = 1;
  for (int64_t i = 3; i >= 0; --i) {
    strides[order[i]] = step;
    step *= x.size(order[i]);
  }
  return at::empty_strided(x.sizes(), strides, x.options());
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* what) {  // like's own: on the CPU
  TORCH_CHECK(t.device().is_cpu() && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), what,
              ": shapes, dtypes or devices differ");
}

}  // namespace

// Both return false, computing nothing, where a tensor's rows are not one stride apart (the caller then makes
// them so): any leading dims, a unit last stride.
bool rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_like(x, x, "rms_norm");
  check_like(out, x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: a contiguous [H] weight of the input's dtype");
  const auto xr = rows_of(x), outr = rows_of(out);
  if (!xr || !outr) return false;
  switch (x.scalar_type()) {
    case at::kBFloat16:
      rms_norm_typed<at::BFloat16>(out, x, weight, static_cast<float>(eps), *xr, *outr);
      break;
    case at::kHalf:
      rms_norm_typed<at::Half>(out, x, weight, static_cast<float>(eps), *xr, *outr);
      break;
    default:
      TORCH_CHECK(false, "rms_norm: bfloat16 or float16");
  }
  return true;
}

bool silu_and_mul(at::Tensor out, at::Tensor gate, at::Tensor up) {
  check_like(gate, gate, "silu_and_mul");
  check_like(up, gate, "silu_and_mul");
  check_like(out, gate, "silu_and_mul");
  const auto gr = rows_of(gate), ur = rows_of(up), outr = rows_of(out);
  if (!gr || !ur || !outr) return false;
  switch (gate.scalar_type()) {
    case at::kBFloat16:
      silu_and_mul_typed(out.data_ptr<at::BFloat16>(), gate.data_ptr<at::BFloat16>(), up.data_ptr<at::BFloat16>(),
                         gate.size(-1), *gr, *ur, *outr);
      break;
    case at::kHalf:
      silu_and_mul_typed(out.data_ptr<at::Half>(), gate.data_ptr<at::Half>(), up.data_ptr<at::Half>(),
                         gate.size(-1), *gr, *ur, *outr);
      break;
    default:
      TORCH_CHECK(false, "silu_and_mul: bfloat16 or float16");
  }
  return true;
}

// fp32 rows: out = weight * (x * (1 / sqrt(variance + eps))), each row's variance one value of a contiguous
// tensor (rows in order); false as above
bool rms_norm_scale(at::Tensor out, at::Tensor x, at::Tensor variance, at::Tensor weight, double eps) {
  check_like(x, x, "rms_norm_scale");
  check_like(out, x, "rms_norm_scale");
  const int64_t n = x.size(-1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.is_contiguous() && weight.size(0) == n && variance.device().is_cpu() &&
                  variance.scalar_type() == at::kFloat && variance.is_contiguous() &&
                  variance.numel() * n == x.numel(),
              "rms_norm_scale: fp32 rows, a contiguous [H] weight and a variance per row");
  const auto xr = rows_of(x), outr = rows_of(out);
  if (!xr || !outr) return false;
  const float* src = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* var = variance.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float e = static_cast<float>(eps);  // as ATen takes a Python float added to an fp32 tensor
  at::parallel_for(0, xr->count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float s = 1.f / std::sqrt(var[r] + e);
      const float* row = src + r * xr->stride;
      float* o = dst + r * outr->stride;
      for (int64_t j = 0; j < n; ++j) o[j] = w[j] * (row[j] * s);
    }
  });
  return true;
}

// silu_and_mul of the fused gate/up product's output taken whole: each [..., 2I] row's gate is its first I
// columns and its up the last I, read at their offsets (no column views made per call); false as above
bool silu_and_mul_halves(at::Tensor out, at::Tensor gate_up) {
  check_like(out, out, "silu_and_mul_halves");
  const int64_t n = out.size(-1);
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == out.scalar_type() && gate_up.dim() == out.dim() &&
                  gate_up.sizes().slice(0, out.dim() - 1) == out.sizes().slice(0, out.dim() - 1) &&
                  gate_up.size(-1) == 2 * n,
              "silu_and_mul_halves: gate_up [..., 2I] and out [..., I] of one dtype");
  const auto gr = rows_of(gate_up), outr = rows_of(out);
  if (!gr || !outr) return false;
  switch (out.scalar_type()) {
    case at::kBFloat16: {
      const auto* g = gate_up.data_ptr<at::BFloat16>();
      silu_and_mul_typed(out.data_ptr<at::BFloat16>(), g, g + n, n, *gr, *gr, *outr);
      break;
    }
    case at::kHalf: {
      const auto* g = gate_up.data_ptr<at::Half>();
      silu_and_mul_typed(out.data_ptr<at::Half>(), g, g + n, n, *gr, *gr, *outr);
      break;
    }
    default:
      TORCH_CHECK(false, "silu_and_mul_halves: bfloat16 or float16");
  }
  return true;
}

// HF's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim) as new tensors (q's, k's layout), or nothing where the
// call is not of the form computed here (engine/model/ops/fused_rotary.py then calls HF's function): q/k [B, H, T, D]
// (unsqueeze_dim 1) or [B, T, H, D] (2) with unit last stride, cos/sin [B or 1, T, rot], one dtype throughout
// (fp32, bf16 or fp16), rot even and equal to D (or at most D where `partial`: the rest passes through)
std::vector<at::Tensor> rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin,
                                         int64_t unsqueeze_dim, bool partial) {
  const auto dtype = q.scalar_type();
  if (unsqueeze_dim != 1 && unsqueeze_dim != 2) return {};
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) return {};
  for (const auto* t : {&q, &k, &cos, &sin})
    if (!t->device().is_cpu() || t->scalar_type() != dtype || t->is_conj() || t->is_neg() ||
        t->dim() != (t == &cos || t == &sin ? 3 : 4) || t->stride(-1) != 1)
      return {};
  const int64_t token_axis = unsqueeze_dim == 1 ? 2 : 1, B = q.size(0), S = q.size(token_axis), D = q.size(3);
  const int64_t rot = cos.size(2);
  if (k.size(0) != B || k.size(token_axis) != S || k.size(3) != D || cos.sizes() != sin.sizes()) return {};
  if ((cos.size(0) != B && cos.size(0) != 1) || cos.size(1) != S || rot % 2 != 0 || rot > D) return {};
  if (rot != D && !partial) return {};
  at::Tensor qo = empty_as(q), ko = empty_as(k);
  switch (dtype) {
    case at::kFloat:
      rotary_typed<float>(q, k, qo, ko, cos, sin, token_axis);
      break;
    case at::kBFloat16:
      rotary_typed<at::BFloat16>(q, k, qo, ko, cos, sin, token_axis);
      break;
    default:
      rotary_typed<at::Half>(q, k, qo, ko, cos, sin, token_axis);
  }
  return {qo, ko};
}
