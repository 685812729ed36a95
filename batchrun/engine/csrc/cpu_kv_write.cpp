// A layer's new K and V written to their pages in one call (built with cpu_kernels.cpp by cpu_kernels.py; the
// `torch` backend, attention/backends/cpu_paged.py, calls it): what `k_cache.index_put_((pages, offsets), key)`
// and the same for V compute, as two operations a layer, each checking and broadcasting its index tensors. Here
// each token's heads are copied row by row from K/V as they come (a [T, H, D] view of the attention module's
// [1, H, T, D] tensors: head-major for a prompt, any strides but a unit last one) to the page and offset the
// step's slot mapping gives, in the bytes of whatever dtype the cache has: no arithmetic, so the same bytes as
// index_put_'s.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstring>

namespace {

// t [T, H, D] into cache [N, P, H, D] (unit last strides, one dtype) at (pages[i], offsets[i])
bool fits(const at::Tensor& t, const at::Tensor& cache, int64_t tokens) {
  return t.device().is_cpu() && cache.device().is_cpu() && t.dim() == 3 && cache.dim() == 4 && t.size(0) == tokens &&
         t.size(1) == cache.size(2) && t.size(2) == cache.size(3) && t.scalar_type() == cache.scalar_type() &&
         (t.size(2) <= 1 || t.stride(2) == 1) && (cache.size(3) <= 1 || cache.stride(3) == 1);
}

void copy_rows(const at::Tensor& t, at::Tensor& cache, const int64_t* pages, const int64_t* offsets, int64_t i) {
  const int64_t bytes = t.element_size(), heads = t.size(1), row = t.size(2) * bytes;
  const char* src = static_cast<const char*>(t.data_ptr()) + i * t.stride(0) * bytes;
  char* dst = static_cast<char*>(cache.data_ptr()) + (pages[i] * cache.stride(0) + offsets[i] * cache.stride(1)) * bytes;
  for (int64_t h = 0; h < heads; ++h) std::memcpy(dst + h * cache.stride(2) * bytes, src + h * t.stride(1) * bytes, row);
}

}  // namespace

// key/value [T, Hkv, Dk|Dv] into k_cache/v_cache [num_pages, P, Hkv, Dk|Dv] at each token's page and offset
// ([T] int64 each); false, writing nothing, for any other layout or dtype (the caller then takes index_put_),
// an error for a page or offset out of range (index_put_'s own)
bool write_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor pages,
              at::Tensor offsets) {
  const int64_t tokens = pages.numel();
  for (const auto* index : {&pages, &offsets})
    if (!index->device().is_cpu() || index->scalar_type() != at::kLong || index->dim() != 1 ||
        index->numel() != tokens || !index->is_contiguous())
      return false;
  if (!fits(key, k_cache, tokens) || !fits(value, v_cache, tokens) || k_cache.size(0) != v_cache.size(0) ||
      k_cache.size(1) != v_cache.size(1))
    return false;
  const int64_t* page = pages.data_ptr<int64_t>();
  const int64_t* offset = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i)
    TORCH_CHECK(page[i] >= 0 && page[i] < k_cache.size(0) && offset[i] >= 0 && offset[i] < k_cache.size(1),
                "write_kv: token ", i, "'s slot (page ", page[i], ", offset ", offset[i], ") is out of range");
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      copy_rows(key, k_cache, page, offset, i);
      copy_rows(value, v_cache, page, offset, i);
    }
  });
  return true;
}
