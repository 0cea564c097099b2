// llmc's CPU paged decode attention: each sequence has one new query token; its query heads attend over the
// sequence's cached keys and values, read in place through its block table (no gather copy, no padding).
// float32 math, exact two-pass softmax, AVX-512. The cache may be float32, float16 or bfloat16 (widened exactly
// as it is read); q and the output are float32.
//
//   q:        float [D, nh, hd], any strides on the first two dims (the model's q is a view of its qkv)
//   k_cache:  float | half | bfloat16 [num_blocks, block_size, nkv, hd] (v_cache alike), contiguous
//   tables:   int32 [D, max_blocks]: sequence i's token p lives in block tables[i, p / block_size]
//   lens:     int32 [D]: tokens to attend per sequence (its cached tokens, this step's included)
//   returns   float [D, nh, hd]
//
// One work item is (sequence, kv head): its `group` query heads share every key and value row loaded.
// Pass 1 scores all context tokens (16 at a time), pass 2 accumulates the probability-weighted values in registers
// (query heads in chunks, so at most 16 accumulators are live). Items are spread over torch's thread pool.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op declared): half the build time
#include <ATen/EmptyTensor.h>  // at::detail::empty_cpu: ATen/ops/empty.h (the dispatched op) costs 1.5 s more to build
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "vec_math.h"
#include "widen.h"

namespace {

using llmc::exp_ps;

using llmc::load16;  // 16 cache values widened to float32 (widen.h)

// Asks for the cache lines of one row (hd values) ahead of use: a context's rows are scattered over its blocks
// and strided by the other kv heads, which the hardware prefetchers do not follow far enough.
template <typename T>
inline void prefetch_row(const T* row, int64_t hd) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < hd * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

template <typename T>
struct Item {
  const float* q;       // the item's first query head; heads `q_head_stride` apart
  int64_t q_head_stride;
  const T* k;           // k_cache + h * hd: a token's row is at slot * row_stride
  const T* v;
  int64_t row_stride;   // nkv * hd
  const int32_t* table;
  int64_t block_size, len, group;
  int64_t hd;
  float scale;
  float* out;           // [group, hd] contiguous
};

// Each context token's cache slot (block * block_size + offset), from the block table.
template <typename T>
void context_slots(const Item<T>& it, std::vector<int64_t>& slots) {
  slots.resize(it.len);
  for (int64_t t0 = 0, b = 0; t0 < it.len; t0 += it.block_size, ++b) {
    const int64_t first = static_cast<int64_t>(it.table[b]) * it.block_size;
    for (int64_t o = 0; o < std::min(it.block_size, it.len - t0); ++o) slots[t0 + o] = first + o;
  }
}

// Pass 2 for query heads g0 .. g0 + QC - 1: out = sum_t p[g][t] v_t / sum[g], accumulated in registers.
template <int NV, int QC, typename T>
void weighted_values(const Item<T>& it, const int64_t* slots, const float* probs, const float* inv_sum, int64_t g0) {
  __m512 acc[QC][NV];
  for (int c = 0; c < QC; ++c)
    for (int j = 0; j < NV; ++j) acc[c][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < it.len; ++t) {
    if (t + 16 < it.len) prefetch_row(it.v + slots[t + 16] * it.row_stride, it.hd);
    const T* row = it.v + slots[t] * it.row_stride;
    __m512 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load16(row + 16 * j);
    for (int c = 0; c < QC; ++c) {
      const __m512 p = _mm512_set1_ps(probs[(g0 + c) * it.len + t]);
      for (int j = 0; j < NV; ++j) acc[c][j] = _mm512_fmadd_ps(p, v[j], acc[c][j]);
    }
  }
  for (int c = 0; c < QC; ++c) {
    const __m512 s = _mm512_set1_ps(inv_sum[g0 + c]);
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(it.out + (g0 + c) * 16 * NV + 16 * j, _mm512_mul_ps(acc[c][j], s));
  }
}

template <int NV, typename T>
void attend(const Item<T>& it, std::vector<float>& buf, std::vector<int64_t>& slot_buf) {
  constexpr int kMaxChunk = NV == 1 ? 8 : 16 / NV;  // query heads per value pass: QC * NV <= 16 accumulators
  const int64_t len = it.len, group = it.group;
  buf.resize(group * len + group);
  float* probs = buf.data();  // [group, len]: scores, then probabilities
  float* inv_sum = probs + group * len;
  context_slots(it, slot_buf);
  const int64_t* slots = slot_buf.data();
  // Pass 1: scores of every (query head, token), 16 tokens at a time: their keys are widened once into `keys`,
  // then each query head's 16 dot products are reduced together (sum16).
  alignas(64) float keys[16 * 16 * NV];
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t t = t0 + 16; t < std::min(len, t0 + 32); ++t) prefetch_row(it.k + slots[t] * it.row_stride, it.hd);
    if (t0 + 16 >= len)  // the values' first rows, for pass 2
      for (int64_t t = 0; t < std::min<int64_t>(len, 16); ++t) prefetch_row(it.v + slots[t] * it.row_stride, it.hd);
    for (int64_t i = 0; i < 16; ++i) {
      if (i < n) {
        const T* row = it.k + slots[t0 + i] * it.row_stride;
        for (int j = 0; j < NV; ++j) _mm512_store_ps(keys + (i * NV + j) * 16, load16(row + 16 * j));
      } else {
        for (int j = 0; j < NV; ++j) _mm512_store_ps(keys + (i * NV + j) * 16, _mm512_setzero_ps());
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = it.q + g * it.q_head_stride;
      __m512 qv[NV], d[16];
      for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qg + 16 * j);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        d[i] = _mm512_mul_ps(qv[0], _mm512_load_ps(keys + i * NV * 16));
        for (int j = 1; j < NV; ++j) d[i] = _mm512_fmadd_ps(qv[j], _mm512_load_ps(keys + (i * NV + j) * 16), d[i]);
      }
      const __m512 scores = _mm512_mul_ps(llmc::sum16(d), _mm512_set1_ps(it.scale));
      _mm512_mask_storeu_ps(probs + g * len + t0, static_cast<__mmask16>((1u << n) - 1), scores);
    }
  }
  // Softmax rows: subtract the max, exponentiate, keep 1 / sum for the end of pass 2.
  for (int64_t g = 0; g < group; ++g) {
    float* s = probs + g * len;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
    float m = _mm512_reduce_max_ps(mx);
    for (int64_t u = t; u < len; ++u) m = std::max(m, s[u]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t + 16 <= len; t += 16) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
      _mm512_storeu_ps(s + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (t < len) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), mv));
      _mm512_mask_storeu_ps(s + t, tail, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // Pass 2, in chunks of query heads.
  for (int64_t g0 = 0; g0 < group; g0 += kMaxChunk) {
    switch (std::min<int64_t>(kMaxChunk, group - g0)) {
#define LLMC_CHUNK(C) \
  case C:             \
    if constexpr (C <= kMaxChunk) weighted_values<NV, C, T>(it, slots, probs, inv_sum, g0); \
    break;
      LLMC_CHUNK(1) LLMC_CHUNK(2) LLMC_CHUNK(3) LLMC_CHUNK(4) LLMC_CHUNK(5) LLMC_CHUNK(6) LLMC_CHUNK(7)
      LLMC_CHUNK(8)
#undef LLMC_CHUNK
    }
  }
}

template <typename T>
void run_items(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
               const int32_t* lens, int64_t grain, float scale, at::Tensor& out) {
  const int64_t d = q.size(0), nh = q.size(1), hd = q.size(2), block_size = k_cache.size(1), nkv = k_cache.size(2);
  const int64_t group = nh / nkv;
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, d * nkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    std::vector<int64_t> slots;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / nkv, h = w % nkv;
      const Item<T> it{qp + i * q.stride(0) + h * group * q.stride(1), q.stride(1), kp + h * hd, vp + h * hd,
                       nkv * hd, tp + i * tables.size(1), block_size, lens[i], group, hd, scale,
                       op + (i * nh + h * group) * hd};
      if (hd == 16) attend<1>(it, buf, slots);
      else if (hd == 32) attend<2>(it, buf, slots);
      else if (hd == 64) attend<4>(it, buf, slots);
      else attend<8>(it, buf, slots);
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor tables, at::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1, "q: float32 [D, nh, hd]");
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kBFloat16),
              "caches: contiguous float32, float16 or bfloat16 [num_blocks, block_size, nkv, hd], both alike");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && lens.scalar_type() == at::kInt &&
                  tables.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "tables: int32 [D, nb]; lens: int32 [D]");
  const int64_t d = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t block_size = k_cache.size(1), nkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == hd && nh % nkv == 0, "head sizes or head counts disagree");
  TORCH_CHECK(hd == 16 || hd == 32 || hd == 64 || hd == 128, "head_size must be 16, 32, 64 or 128");
  const int64_t group = nh / nkv;
  at::Tensor out = at::detail::empty_cpu({d, nh, hd}, q.options());
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  int64_t max_len = 1;
  for (int64_t i = 0; i < d; ++i) {
    TORCH_CHECK(len_ptr[i] >= 1 && len_ptr[i] <= tables.size(1) * block_size, "a length exceeds its block table");
    max_len = std::max<int64_t>(max_len, len_ptr[i]);
  }
  // ~4 flops per (query head, token, channel); chunks of at least ~0.5 MFLOP keep the pool's overhead small.
  const int64_t per_item = std::max<int64_t>(1, 4 * group * max_len * hd);
  const int64_t grain = std::max<int64_t>(1, 500000 / per_item);
  if (cache_type == at::kFloat) run_items<float>(q, k_cache, v_cache, tables, len_ptr, grain, scale, out);
  else if (cache_type == at::kHalf) run_items<at::Half>(q, k_cache, v_cache, tables, len_ptr, grain, scale, out);
  else run_items<at::BFloat16>(q, k_cache, v_cache, tables, len_ptr, grain, scale, out);
  return out;
}
