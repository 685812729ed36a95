// Prompt attention of a bf16 layer on the CPU (built with cpu_kernels.cpp by cpu_kernels.py; issue 50, item 3):
// every sequence of a step computing several tokens (a whole prompt, a later chunk, a prompt behind cached
// pages), one call per layer, its K/V read from the pages (write_kv runs first), where SDPA ran once per prompt
// and gained nothing from bf16 on a CPU without AMX. The QK^T and PV products are AVX512-BF16 dot products of
// bf16 pairs (_mm512_dpbf16_ps, fp32 accumulation):
//
// 1. Repack, one task per (sequence, KV head): the keys a sequence's queries can see, in 16-key blocks laid out
// as the instruction pairs them -- K as [D/2][16 keys][2 dims] (a dim pair of 16 keys per vector), V as
// [8 key pairs][D/16][16 dims][2 keys] (a key pair of 16 dims per vector); keys no query of the sequence sees
// are zeros.
// 2. Attend, one task per (sequence, KV head, tile of kQueries queries): the tile's rows (each query times the
// GQA heads of the KV head) share every K/V load; the key blocks of kKeys keys wholly outside the tile's visible
// range (the causal upper triangle, behind a window or the chunk) are skipped; an online softmax (fp32 running
// max and sum per row) keeps memory bounded for long contexts; the probabilities are rounded to bf16 for the PV
// product, as torch's bf16 attention rounds them; the output is rounded to bf16 once.
//
// Visible keys of a query at position p (masks.py MaskKind): k <= p, and k > p - window (window > 0) or
// k // chunk == p // chunk (chunk > 0); soft-capping (softcap > 0) and a sink logit per query head (sinks [Hq]
// fp32) as in the decode kernel. `causal` false (an encoder's layer, no window or chunk): every key of the
// sequence, k < context (a pooling step's packed row, attention/packed.py, passes its rows as pages of one token).
// Shapes:
//   query [T, Hq, D], out [T, Hq, D] bf16 (any strides but a unit last one)
//   k_cache, v_cache [num_pages, P, Hkv, D] bf16 (unit last stride)
//   block_tables [S, W] int32; starts, query_lens, context_lens [S] int32 (context: the queries included)
// Head dims 32, 64, 128 and 256, with K and V alike, and up to kMaxGqa query heads per KV head;
// `prompt_attention_bf16_supported(D, Dv, gqa)` says whether this build takes a shape (false without AVX512-BF16
// at compile time): the engine asks it once, at load (the generation backend, attention/backends/prompt_kernel.py)
// or per layer (a pooling step, attention/packed.py). The module's `prompt_attention_key_block` is kKeys: a
// sequence's keys are computed a whole block at a time, so a packed text shorter than one stays on SDPA.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu_vector.h"  // exp_nonpositive, exp_nonpositive16

namespace {

constexpr int kKeys = 64;    // keys per block of the online softmax
constexpr int kMaxGqa = 16;  // query heads per KV head a tile holds

// the first key a query at `pos` sees: behind a sliding window or before its chunk, none
int64_t first_visible_key(int64_t pos, int64_t window, int64_t chunk) {
  if (window > 0) return std::max<int64_t>(0, pos - window + 1);
  if (chunk > 0) return pos - pos % chunk;
  return 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BATCHRUN_PROMPT_BF16 1

constexpr int kBlock = 16;                    // keys per vector (one dpbf16 lane per key)
constexpr int kQueries = 16;                  // queries per task
constexpr int kMaxRows = kQueries * kMaxGqa;  // rows of a tile: queries times GQA heads

struct Layer {
  const at::BFloat16 *q, *k, *v;
  at::BFloat16* o;
  const int32_t *tables, *starts, *qlens, *ctxs;
  int64_t sq_t, sq_h, so_t, so_h, sk_p, sk_s, sk_h, sv_p, sv_s, sv_h, st;
  int64_t P, Hq, Hkv, gqa;
  int64_t window, chunk;
  bool causal;
  float scale, softcap;
  const float* sinks;

  int64_t first_key(int64_t pos) const { return first_visible_key(pos, window, chunk); }
  int64_t key_start(int64_t s) const {  // the first key repacked: the block holding the first query's first key
    return first_key(ctxs[s] - qlens[s]) / kKeys * kKeys;
  }
};

// sequence s's keys [kstart, kend) of KV head h into its packed K and V (16-key blocks, see the header)
template <int D>
void repack(const Layer& L, int64_t s, int64_t h, int64_t kstart, int64_t kend, at::BFloat16* kp,
            at::BFloat16* vp) {
  // keys no query sees (behind the first query's window or chunk, past the context) are zeros, never read from
  // their page: NULL, given back, or never written (the pool is not cleared; a NaN there would survive a zero
  // probability in the PV product)
  const int64_t ctx = L.ctxs[s], seen = L.first_key(ctx - L.qlens[s]);
  const int32_t* table = L.tables + s * L.st;
  for (int64_t key = kstart; key < kend; ++key) {
    const int64_t j = key - kstart, blk = j / kBlock, lane = j % kBlock;
    at::BFloat16* kb = kp + blk * kBlock * D;
    at::BFloat16* vb = vp + blk * kBlock * D;
    const int32_t page = key >= seen && key < ctx ? table[key / L.P] : -1;
    if (page < 0) {
      for (int64_t d = 0; d < D / 2; ++d) std::memset(kb + (d * kBlock + lane) * 2, 0, 4);
      for (int64_t d = 0; d < D; ++d) vb[((lane / 2) * D + d) * 2 + lane % 2] = at::BFloat16(0.f);
      continue;
    }
    const at::BFloat16* ks = L.k + page * L.sk_p + (key % L.P) * L.sk_s + h * L.sk_h;
    const at::BFloat16* vs = L.v + page * L.sv_p + (key % L.P) * L.sv_s + h * L.sv_h;
    for (int64_t d = 0; d < D / 2; ++d) std::memcpy(kb + (d * kBlock + lane) * 2, ks + 2 * d, 4);
    // V: key pair lane / 2, dim d at [pair][d / 16][d % 16][parity] = [pair][d][parity]
    for (int64_t d = 0; d < D; ++d) vb[((lane / 2) * D + d) * 2 + lane % 2] = vs[d];
  }
}

// a task's rows: scores and probabilities of a key block, the running max, sum and output (heap: D 256 would
// make them a quarter of a megabyte)
template <int D>
struct Tile {
  std::vector<float> score_buf = std::vector<float>(kMaxRows * kKeys), acc_buf = std::vector<float>(kMaxRows * D);
  std::vector<at::BFloat16> prob_buf = std::vector<at::BFloat16>(kMaxRows * kKeys);
  float* scores(int64_t r) { return score_buf.data() + r * kKeys; }
  at::BFloat16* probs(int64_t r) { return prob_buf.data() + r * kKeys; }
  float* acc(int64_t r) { return acc_buf.data() + r * D; }
  float m[kMaxRows], l[kMaxRows];
  const at::BFloat16* qrow[kMaxRows];
  int64_t pos[kMaxRows], lo[kMaxRows];
};

// One tile: queries [q0, q0 + nq) of sequence s, the GQA heads of KV head h, against its packed K/V.
template <int D>
void attend_tile(const Layer& L, Tile<D>& w, int64_t s, int64_t h, int64_t q0, int64_t nq, int64_t kstart,
                 const at::BFloat16* kp, const at::BFloat16* vp) {
  constexpr int RQ = 4;                        // rows per pass of QK^T (4 x 4 accumulators)
  constexpr int RV = 256 / D > 8 ? 8 : 256 / D;  // rows per pass of PV (RV x D/16 accumulators)
  const int64_t ctx = L.ctxs[s], base = ctx - L.qlens[s];  // the position of the sequence's first query
  const int64_t rows = nq * L.gqa, padded = (rows + 7) / 8 * 8;
  float *m = w.m, *l = w.l;
  const at::BFloat16** qrow = w.qrow;
  int64_t *pos = w.pos, *lo = w.lo;
  for (int64_t r = 0; r < padded; ++r) {  // row r: query r / gqa, head h * gqa + r % gqa; padding repeats the last
    const int64_t rr = std::min(r, rows - 1), t = L.starts[s] + q0 + rr / L.gqa, head = h * L.gqa + rr % L.gqa;
    qrow[r] = L.q + t * L.sq_t + head * L.sq_h;
    pos[r] = base + q0 + rr / L.gqa;
    lo[r] = L.first_key(pos[r]);
    if (!L.causal) pos[r] = ctx - 1;  // the last key the row sees: the sequence's last
    m[r] = -INFINITY;
    l[r] = 0.f;
    std::fill(w.acc(r), w.acc(r) + D, 0.f);
  }
  const int64_t first_block = (lo[0] - kstart) / kKeys, last_block = (pos[rows - 1] - kstart) / kKeys;
  const __m512 scale = _mm512_set1_ps(L.scale);
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t k0 = kstart + b * kKeys;  // the block's first key
    const at::BFloat16* kb = kp + b * kKeys * D;
    const at::BFloat16* vb = vp + b * kKeys * D;
    // scores = Q K^T * scale: RQ rows x 4 16-key vectors per pass, each K vector loaded once for the RQ rows
    for (int64_t r0 = 0; r0 < padded; r0 += RQ) {
      __m512 sc[RQ][kKeys / kBlock];
      for (int r = 0; r < RQ; ++r)
        for (int c = 0; c < kKeys / kBlock; ++c) sc[r][c] = _mm512_setzero_ps();
      for (int d = 0; d < D / 2; ++d) {
        __m512i kv[kKeys / kBlock];
        for (int c = 0; c < kKeys / kBlock; ++c)
          kv[c] = _mm512_loadu_si512(kb + (c * D / 2 + d) * kBlock * 2);
        for (int r = 0; r < RQ; ++r) {
          const __m512i qv = bcast_pair(qrow[r0 + r] + 2 * d);
          for (int c = 0; c < kKeys / kBlock; ++c) sc[r][c] = dot2(sc[r][c], qv, kv[c]);
        }
      }
      for (int r = 0; r < RQ; ++r)
        for (int c = 0; c < kKeys / kBlock; ++c)
          _mm512_storeu_ps(w.scores(r0 + r) + c * kBlock, _mm512_mul_ps(sc[r][c], scale));
    }
    // the online softmax of each row over the block: soft-capping, the mask, the running max and sum
    for (int64_t r = 0; r < padded; ++r) {
      float* sr = w.scores(r);
      if (L.softcap > 0.f)
        for (int j = 0; j < kKeys; ++j) sr[j] = L.softcap * std::tanh(sr[j] / L.softcap);
      if (k0 < lo[r] || k0 + kKeys - 1 > pos[r])  // partly visible: the keys outside [lo, pos] out
        for (int j = 0; j < kKeys; ++j)
          if (k0 + j < lo[r] || k0 + j > pos[r]) sr[j] = -INFINITY;
      __m512 mx = _mm512_loadu_ps(sr);
      for (int c = 1; c < kKeys / kBlock; ++c) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + c * kBlock));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      if (m_new == -INFINITY) {  // nothing of this row seen yet
        std::fill(w.probs(r), w.probs(r) + kKeys, at::BFloat16(0.f));
        continue;
      }
      const float alpha = m[r] == -INFINITY ? 0.f : exp_nonpositive(m[r] - m_new);
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < kKeys / kBlock; c += 2) {  // masked keys (-inf) exactly 0
        const __m512 x0 = _mm512_loadu_ps(sr + c * kBlock), x1 = _mm512_loadu_ps(sr + (c + 1) * kBlock);
        const __m512 p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                              exp_nonpositive16(_mm512_sub_ps(x0, mv)));
        const __m512 p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x1, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                              exp_nonpositive16(_mm512_sub_ps(x1, mv)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);  // p0 in the low half: keys in order
        _mm512_storeu_si512(w.probs(r) + c * kBlock, (__m512i)pb);
      }
      m[r] = m_new;
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      if (alpha != 1.f) {
        const __m512 av = _mm512_set1_ps(alpha);
        float* a = w.acc(r);
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), av));
      }
    }
    // acc += P V: RV rows x D/16 accumulators per pass, each V vector loaded once for the RV rows
    for (int64_t r0 = 0; r0 < padded; r0 += RV) {
      __m512 o[RV][D / 16];
      for (int r = 0; r < RV; ++r)
        for (int c = 0; c < D / 16; ++c) o[r][c] = _mm512_loadu_ps(w.acc(r0 + r) + 16 * c);
      for (int kk = 0; kk < kKeys / 2; ++kk) {  // key pair kk: keys 2kk, 2kk + 1
        const at::BFloat16* vpair = vb + (kk / (kBlock / 2)) * kBlock * D + (kk % (kBlock / 2)) * D * 2;
        __m512i vv[D / 16];
        for (int c = 0; c < D / 16; ++c) vv[c] = _mm512_loadu_si512(vpair + 32 * c);
        for (int r = 0; r < RV; ++r) {
          const __m512i pv = bcast_pair(w.probs(r0 + r) + 2 * kk);
          for (int c = 0; c < D / 16; ++c) o[r][c] = dot2(o[r][c], pv, vv[c]);
        }
      }
      for (int r = 0; r < RV; ++r)
        for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(w.acc(r0 + r) + 16 * c, o[r][c]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // out = acc / l (the sink's term in the sum), rounded to bf16 once
    const int64_t t = L.starts[s] + q0 + r / L.gqa, head = h * L.gqa + r % L.gqa;
    float total = l[r], factor = 1.f;
    if (L.sinks) {
      const float sink = L.sinks[head], mx = std::max(m[r], sink);
      factor = exp_nonpositive(m[r] - mx);
      total = l[r] * factor + exp_nonpositive(sink - mx);
    }
    const float inv = factor / total;
    at::BFloat16* orow = L.o + t * L.so_t + head * L.so_h;
    for (int64_t d = 0; d < D; ++d) orow[d] = at::BFloat16(w.acc(r)[d] * inv);
  }
}

template <int D>
void prompt_attention(const Layer& L, int64_t S) {
  // the packed keys of each (sequence, KV head) at offset[s] * Hkv + h * keys[s] (in keys, D values each)
  std::vector<int64_t> kstart(S), keys(S), offset(S + 1, 0), tiles(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    kstart[s] = L.key_start(s);
    keys[s] = (L.ctxs[s] - kstart[s] + kKeys - 1) / kKeys * kKeys;
    offset[s + 1] = offset[s] + keys[s];
    tiles[s + 1] = tiles[s] + (L.qlens[s] + kQueries - 1) / kQueries;
  }
  at::Tensor packed_k = at::empty({offset[S] * L.Hkv * D}, at::kBFloat16);
  at::Tensor packed_v = at::empty({offset[S] * L.Hkv * D}, at::kBFloat16);
  at::BFloat16* pk = packed_k.data_ptr<at::BFloat16>();
  at::BFloat16* pv = packed_v.data_ptr<at::BFloat16>();
  auto where = [&](int64_t s, int64_t h) { return (offset[s] * L.Hkv + h * keys[s]) * D; };
  at::parallel_for(0, S * L.Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / L.Hkv, h = task % L.Hkv;
      repack<D>(L, s, h, kstart[s], kstart[s] + keys[s], pk + where(s, h), pv + where(s, h));
    }
  });
  at::parallel_for(0, tiles[S] * L.Hkv, 1, [&](int64_t begin, int64_t end) {
    Tile<D> w;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = task / L.Hkv, h = task % L.Hkv;
      const int64_t s = std::upper_bound(tiles.begin(), tiles.end(), tile) - tiles.begin() - 1;
      const int64_t q0 = (tile - tiles[s]) * kQueries, nq = std::min<int64_t>(kQueries, L.qlens[s] - q0);
      attend_tile<D>(L, w, s, h, q0, nq, kstart[s], pk + where(s, h), pv + where(s, h));
    }
  });
}
#endif

}  // namespace

bool prompt_attention_bf16_supported(int64_t head_dim, int64_t v_head_dim, int64_t gqa) {
#ifdef BATCHRUN_PROMPT_BF16
  return head_dim == v_head_dim && (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256) &&
         gqa >= 1 && gqa <= kMaxGqa;
#else
  return false;
#endif
}

void paged_prompt_attention(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor starts, at::Tensor query_lens,
                            at::Tensor context_lens, double scale, int64_t window, int64_t chunk, double softcap,
                            c10::optional<at::Tensor> sinks, bool causal) {
  const int64_t D = query.size(2), Hq = query.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "paged_prompt_attention: query heads a multiple of KV heads");
  TORCH_CHECK(prompt_attention_bf16_supported(D, v_cache.size(3), Hq / Hkv), "paged_prompt_attention: head dims ", D,
              "/", v_cache.size(3), " with ", Hq / Hkv, " query heads per KV head not built here",
              " (prompt_attention_bf16_supported)");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "paged_prompt_attention runs on the CPU");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "paged_prompt_attention: bfloat16");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "unit stride in the head dimension");
  TORCH_CHECK(k_cache.size(3) == D && out.size(2) == D, "head dims: query = K = V = out");
  for (const at::Tensor* t : {&starts, &query_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->size(0) == starts.size(0),
                "starts, query_lens, context_lens: [S] int32");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == starts.size(0),
              "block_tables: [S, W] int32");
  TORCH_CHECK(causal || (window == 0 && chunk == 0), "paged_prompt_attention: a window or chunk is causal here");
  {  // every row, key and page a sequence names lies within the tensors (a bad caller errs, never overruns)
    const int32_t* st = starts.data_ptr<int32_t>();
    const int32_t* ql = query_lens.data_ptr<int32_t>();
    const int32_t* cl = context_lens.data_ptr<int32_t>();
    const int32_t* bt = block_tables.data_ptr<int32_t>();
    const int64_t T = std::min(query.size(0), out.size(0)), P = k_cache.size(1), W = block_tables.size(1);
    const int64_t pages = std::min(k_cache.size(0), v_cache.size(0));
    for (int64_t s = 0; s < starts.size(0); ++s) {
      TORCH_CHECK(st[s] >= 0 && ql[s] >= 0 && st[s] + int64_t(ql[s]) <= T && ql[s] <= cl[s] &&
                      (causal || ql[s] == cl[s]) && (int64_t(cl[s]) + P - 1) / P <= W,
                  "paged_prompt_attention: sequence ", s, "'s rows, keys or pages out of range");
      // the first key any of its queries sees: pages wholly before it (behind a window, before a chunk) are
      // never read, and may be NULL (-1) or given back
      const int64_t lo = first_visible_key(int64_t(cl[s]) - ql[s], window, chunk);  // its first query's
      for (int64_t j = lo / P; j < (int64_t(cl[s]) + P - 1) / P; ++j) {
        const int32_t page = bt[s * block_tables.stride(0) + j];
        TORCH_CHECK(page >= 0 && page < pages, "paged_prompt_attention: sequence ", s, " names page ", page,
                    " of ", pages);
      }
    }
  }
#ifdef BATCHRUN_PROMPT_BF16
  Layer L{};
  L.q = query.data_ptr<at::BFloat16>();
  L.k = k_cache.data_ptr<at::BFloat16>();
  L.v = v_cache.data_ptr<at::BFloat16>();
  L.o = out.data_ptr<at::BFloat16>();
  L.tables = block_tables.data_ptr<int32_t>();
  L.starts = starts.data_ptr<int32_t>();
  L.qlens = query_lens.data_ptr<int32_t>();
  L.ctxs = context_lens.data_ptr<int32_t>();
  L.sq_t = query.stride(0), L.sq_h = query.stride(1), L.so_t = out.stride(0), L.so_h = out.stride(1);
  L.sk_p = k_cache.stride(0), L.sk_s = k_cache.stride(1), L.sk_h = k_cache.stride(2);
  L.sv_p = v_cache.stride(0), L.sv_s = v_cache.stride(1), L.sv_h = v_cache.stride(2);
  L.st = block_tables.stride(0);
  L.P = k_cache.size(1), L.Hq = Hq, L.Hkv = Hkv, L.gqa = Hq / Hkv;
  L.window = window, L.chunk = chunk, L.causal = causal;
  L.scale = static_cast<float>(scale), L.softcap = static_cast<float>(softcap);
  L.sinks = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == Hq,
                "sinks: [Hq] float32");
    L.sinks = sinks->data_ptr<float>();
  }
  const int64_t S = starts.size(0);
  switch (D) {
    case 32:
      return prompt_attention<32>(L, S);
    case 64:
      return prompt_attention<64>(L, S);
    case 128:
      return prompt_attention<128>(L, S);
    default:
      return prompt_attention<256>(L, S);
  }
#endif
}

void register_prompt_attention(py::module_& m) {  // called by cpu_kernels.cpp's module definition
  m.def("prompt_attention_bf16_supported", &prompt_attention_bf16_supported,
        "whether paged_prompt_attention takes these head dims and query heads per KV head in this build (AVX512-BF16)",
        py::arg("head_dim"), py::arg("v_head_dim"), py::arg("gqa"));
  m.attr("prompt_attention_key_block") = kKeys;  // a sequence's keys are computed this many at a time
  m.def("paged_prompt_attention", &paged_prompt_attention, "bf16 prompt attention of a step over the pages (CPU)",
        py::arg("out"), py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("starts"), py::arg("query_lens"), py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("chunk") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), py::arg("causal") = true);
}
