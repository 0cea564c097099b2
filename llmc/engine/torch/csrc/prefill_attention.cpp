// llmc's CPU attention for prefill chunks in bfloat16 products with float32 sums (AVX512-BF16's vdpbf16ps), over
// the paged KV cache read in place through the block tables: the precision of the prefill GEMMs
// (llmc/engine/torch/prefill_cpu.py).
//
//   q:       float [T, nh, hd], the step's packed tokens (any strides on the first two dims); hd 32, 64 or 128
//   k_cache: float | half | bfloat16 [num_blocks, block_size, nkv, hd] (v_cache alike), contiguous
//   tables:  int32 [B, max_blocks], the step's block tables
//   chunks:  int32 [P, 4]: (row of tables, packed index of the chunk's first token, its n tokens, c tokens cached
//            before it): token i sits at position c + i and attends to positions 0 .. c + i (its own included:
//            this step's keys and values are in the cache already)
//   out:     float [T, nh, hd], contiguous: the chunks' rows are written, the others left as they are
//
// Phase 1, per (chunk, kv head): the context's keys and values are read once, rounded to bfloat16 (nearest
// even) and laid out for vdpbf16ps (its query rows are rounded into pairs there too, read in order once): keys [ceil(ctx/16)][hd/2][16] (one vector = 16 keys x one pair of dims),
// values [ceil(ctx/16) * 8][hd/16][16] (one vector = 16 dims x one pair of keys), zero past the context.
// Phase 2: query rows (token-major over the kv head's query heads) in blocks of kRows, each one pass over its
// keys, 16 at a time, and an exact two-pass softmax: scores in float32 into a buffer, one max per row, then the
// probabilities (float32 sum; rounded to bfloat16 for the value products). Both phases spread over torch's
// thread pool.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op declared): half the build time
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec_math.h"
#include "widen.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

using llmc::exp_ps;
using llmc::load16;

// Two float32 vectors -> 32 bfloat16 (a's 16 then b's 16), rounded to nearest even.
inline __m512i round32(__m512 a, __m512 b) { return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)); }

inline __m512bh pairs_at(const uint32_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
inline __m512bh broadcast(uint32_t pair) {
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
}

// hd float32 values -> hd/2 bfloat16 pairs (dims 2p, 2p + 1 in word p).
template <typename T>
inline void round_row(const T* row, int64_t hd, uint32_t* out) {
  for (int64_t d = 0; d < hd; d += 32) _mm512_storeu_si512(out + d / 2, round32(load16(row + d), load16(row + d + 16)));
}

struct Geometry {
  int64_t block_size, nkv, hd;
};

// Phase 1 for one (chunk, kv head h): `ctx` context tokens through `table`.
template <typename T>
void pack_context(const T* k_cache, const T* v_cache, const int32_t* table, const Geometry& g, int64_t h,
                  int64_t ctx, uint32_t* keys, uint32_t* values) {
  const int64_t half = g.hd / 2, dv = g.hd / 16, blocks16 = (ctx + 15) / 16;
  std::fill(keys, keys + blocks16 * 16 * half, 0u);
  std::fill(values, values + blocks16 * 16 * half, 0u);
  auto row = [&](const T* cache, int64_t j) {
    const int64_t slot = static_cast<int64_t>(table[j / g.block_size]) * g.block_size + j % g.block_size;
    return cache + (slot * g.nkv + h) * g.hd;
  };
  alignas(64) uint32_t pairs[64];  // one key's hd/2 pairs (hd <= 128)
  for (int64_t j = 0; j < ctx; ++j) {
    round_row(row(k_cache, j), g.hd, pairs);
    uint32_t* dst = keys + (j / 16) * 16 * half + j % 16;
    for (int64_t p = 0; p < half; ++p) dst[p * 16] = pairs[p];
  }
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t j = 0; j < ctx; j += 2) {  // keys j and j + 1 (zero past the context) share each value vector
    const T* v0 = row(v_cache, j);
    const T* v1 = j + 1 < ctx ? row(v_cache, j + 1) : nullptr;
    for (int64_t c = 0; c < dv; ++c) {
      const __m512 a = load16(v0 + 16 * c), b = v1 ? load16(v1 + 16 * c) : _mm512_setzero_ps();
      _mm512_storeu_si512(values + ((j / 2) * dv + c) * 16, _mm512_permutexvar_epi16(interleave, round32(a, b)));
    }
  }
}

// Phase 2 for R query rows: qp [R][hd/2] pairs, limit[r] = keys row r attends (>= 1); out[r] its float32 output
// row. Exact two-pass softmax per row: all scores first (into `scores` [R][keys rounded up to 16]), then one max,
// the probabilities (rounded to bfloat16 pairs into `probs` [R][keys / 2]) and their sum, then the values.
template <int R, int DV>
void query_rows(const uint32_t* qp, const int64_t* limit, const uint32_t* keys, const uint32_t* values, float scale,
                float* scores, uint32_t* probs, float* const* out) {
  constexpr int kHalf = DV * 8;  // hd / 2
  const int64_t needed = *std::max_element(limit, limit + R), blocks = (needed + 15) / 16, stride = blocks * 16;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax[R];
  for (int r = 0; r < R; ++r) vmax[r] = neg_inf;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const uint32_t* kv = keys + kb * 16 * kHalf;
    __m512 s0[R], s1[R];  // two partial sums per row: independent vdpbf16ps chains
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
    for (int p = 0; p < kHalf; p += 2) {
      const __m512bh k0 = pairs_at(kv + p * 16), k1 = pairs_at(kv + (p + 1) * 16);
      for (int r = 0; r < R; ++r) {
        s0[r] = _mm512_dpbf16_ps(s0[r], k0, broadcast(qp[r * kHalf + p]));
        s1[r] = _mm512_dpbf16_ps(s1[r], k1, broadcast(qp[r * kHalf + p + 1]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t valid = std::clamp<int64_t>(limit[r] - kb * 16, 0, 16);
      const __mmask16 mask = _cvtu32_mask16((1u << valid) - 1);
      const __m512 sr = _mm512_mask_blend_ps(mask, neg_inf, _mm512_mul_ps(_mm512_add_ps(s0[r], s1[r]), _mm512_set1_ps(scale)));
      vmax[r] = _mm512_max_ps(vmax[r], sr);
      _mm512_storeu_ps(scores + r * stride + kb * 16, sr);
    }
  }
  float inv_sum[R];
  for (int r = 0; r < R; ++r) {
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[r]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const int64_t valid = std::clamp<int64_t>(limit[r] - kb * 16, 0, 16);
      const __m512 p = _mm512_maskz_mov_ps(_cvtu32_mask16((1u << valid) - 1),
                                           exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + r * stride + kb * 16), m)));
      sum = _mm512_add_ps(sum, p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + r * (stride / 2) + kb * 8),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
    }
    inv_sum[r] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  __m512 o[R][DV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DV; ++c) o[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < blocks * 8; ++j) {  // pairs of keys
    __m512bh v[DV];
    for (int c = 0; c < DV; ++c) v[c] = pairs_at(values + (j * DV + c) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh b = broadcast(probs[r * (stride / 2) + j]);
      for (int c = 0; c < DV; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], v[c], b);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(inv_sum[r]);
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out[r] + 16 * c, _mm512_mul_ps(o[r][c], inv));
  }
}

struct Chunk {
  int64_t seq, start, n, cached;
};

template <int DV, typename T>
void attend(const at::Tensor& q, const T* k_cache, const T* v_cache, const int32_t* tables, int64_t table_stride,
            const std::vector<Chunk>& chunks, const Geometry& g, float scale, float* out) {
  constexpr int R = DV >= 8 ? 2 : 4;  // rows per block: R * DV output accumulators stay in registers
  const int64_t nh = q.size(1), group = nh / g.nkv, half = g.hd / 2;
  const float* qp = q.data_ptr<float>();
  const int64_t q_token = q.stride(0), q_head = q.stride(1);
  // Per (chunk, kv head) item: its packed context (keys, then values) and its query rows rounded to pairs,
  // padded to whole blocks of R rows, all in one buffer.
  const int64_t items = static_cast<int64_t>(chunks.size()) * g.nkv;
  std::vector<int64_t> offset(items + 1, 0), first_block(items + 1, 0);
  for (int64_t i = 0; i < items; ++i) {
    const Chunk& c = chunks[i / g.nkv];
    const int64_t blocks = (group * c.n + R - 1) / R;
    offset[i + 1] = offset[i] + (c.cached + c.n + 15) / 16 * 16 * half * 2 + blocks * R * half;
    first_block[i + 1] = first_block[i] + blocks;
  }
  std::vector<uint32_t> packed(static_cast<size_t>(offset[items]));
  auto context_size = [&](const Chunk& c) { return (c.cached + c.n + 15) / 16 * 16 * half; };
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {  // phase 1
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& c = chunks[i / g.nkv];
      const int64_t h = i % g.nkv, size = context_size(c);
      uint32_t* base = packed.data() + offset[i];
      pack_context(k_cache, v_cache, tables + c.seq * table_stride, g, h, c.cached + c.n, base, base + size);
      uint32_t* rows = base + 2 * size;  // row r: token r / group, query head h * group + r % group
      for (int64_t r = 0; r < group * c.n; ++r)
        round_row(qp + (c.start + r / group) * q_token + (h * group + r % group) * q_head, g.hd, rows + r * half);
      std::fill(rows + group * c.n * half, packed.data() + offset[i + 1], 0u);
    }
  });
  int64_t longest = 0;
  for (const Chunk& c : chunks) longest = std::max(longest, c.cached + c.n);
  const int64_t stride = (longest + 15) / 16 * 16;
  at::parallel_for(0, first_block[items], 1, [&](int64_t begin, int64_t end) {  // phase 2: blocks of R rows
    std::vector<float> scores(R * stride);
    std::vector<uint32_t> probs(R * stride / 2);
    alignas(64) float discard[128];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t i = std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin() - 1;
      const Chunk& c = chunks[i / g.nkv];
      const int64_t h = i % g.nkv, rows = group * c.n, r0 = (b - first_block[i]) * R, size = context_size(c);
      const uint32_t* base = packed.data() + offset[i];
      int64_t limit[R];
      float* dst[R];
      for (int r = 0; r < R; ++r) {  // rows past the item (zero queries) attend like its last row, output discarded
        const int64_t row = std::min(r0 + r, rows - 1);
        limit[r] = c.cached + row / group + 1;
        dst[r] = r0 + r < rows ? out + ((c.start + row / group) * nh + h * group + row % group) * g.hd : discard;
      }
      query_rows<R, DV>(base + 2 * size + r0 * half, limit, base, base + size, scale, scores.data(), probs.data(), dst);
    }
  });
}

}  // namespace

void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& chunks, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1, "q: float32 [T, nh, hd]");
  const int64_t hd = q.size(2);
  TORCH_CHECK(hd == 32 || hd == 64 || hd == 128, "head size must be 32, 64 or 128");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.size(3) == hd && q.size(1) % k_cache.size(2) == 0,
              "k_cache, v_cache: contiguous [num_blocks, block_size, nkv, hd] of one dtype, nh a multiple of nkv");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kInt && tables.is_contiguous(),
              "tables: contiguous int32 [B, max_blocks]");
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == 4 && chunks.scalar_type() == at::kInt && chunks.is_contiguous(),
              "chunks: contiguous int32 [P, 4]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out: contiguous float32 shaped like q");
  const Geometry g{k_cache.size(1), k_cache.size(2), hd};
  std::vector<Chunk> list;
  const int32_t* c = chunks.data_ptr<int32_t>();
  for (int64_t i = 0; i < chunks.size(0); ++i) {
    const Chunk chunk{c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3]};
    TORCH_CHECK(chunk.seq >= 0 && chunk.seq < tables.size(0) && chunk.n > 0 && chunk.start >= 0 &&
                    chunk.start + chunk.n <= q.size(0) && chunk.cached >= 0 &&
                    (chunk.cached + chunk.n + g.block_size - 1) / g.block_size <= tables.size(1),
                "chunk ", i, " is out of range of q or of its block table");
    list.push_back(chunk);
  }
  const int32_t* t = tables.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "prefill_attention", [&] {
    TORCH_CHECK(k_cache.scalar_type() != at::kDouble, "the cache must be float32, float16 or bfloat16");
    const auto* k = k_cache.data_ptr<scalar_t>();
    const auto* v = v_cache.data_ptr<scalar_t>();
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (hd == 32) attend<2>(q, k, v, t, tables.size(1), list, g, s, o);
      else if (hd == 64) attend<4>(q, k, v, t, tables.size(1), list, g, s, o);
      else attend<8>(q, k, v, t, tables.size(1), list, g, s, o);
    }
  });
}

#pragma GCC pop_options
