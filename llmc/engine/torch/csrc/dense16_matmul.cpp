// llmc's CPU matmul over 16-bit weights in float32: y[M, N] = x[M, K] @ W^T, AVX-512.
//
// W is a 16-bit checkpoint's float16 or bfloat16 tensor (the logits layer) kept in that dtype: half the bytes of
// its float32 copy, and widening it to float32 is exact, so the products equal the float32 layer's up to
// summation order. Layout (llmc/engine/torch/cpu_ext.py: pack_tiles16): output channels in tiles of 16,
//   w: float16 | bfloat16 [N/16, K, 16]
// One pass over a tile widens each 16-channel column once for up to 16 rows of x (read column by column: see
// columns.h); tiles are spread over torch's thread pool.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op declared): half the build time
#include <ATen/EmptyTensor.h>  // at::detail::empty_cpu: ATen/ops/empty.h (the dispatched op) costs 1.5 s more to build
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "columns.h"

namespace {

template <bool kBF16>
inline __m512 widen(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// Few rows: the columns are split over kSplit independent accumulators per row, so consecutive FMAs do not wait
// on each other (one chain of dependent FMAs per row would cap a 1-row step at one column per FMA latency).
template <int M, bool kBF16>
void tile_rows(const float* xt, int64_t K, const uint16_t* w, float* y, int64_t N) {
  constexpr int kSplit = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  __m512 acc[M][kSplit];
  for (int m = 0; m < M; ++m)
    for (int s = 0; s < kSplit; ++s) acc[m][s] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kSplit <= K; k += kSplit) {
#pragma GCC unroll 4
    for (int s = 0; s < kSplit; ++s) {
      const __m512 wk = widen<kBF16>(w + (k + s) * 16);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[m][s] = _mm512_fmadd_ps(wk, _mm512_set1_ps(xt[(k + s) * M + m]), acc[m][s]);
    }
  }
  for (; k < K; ++k) {
    const __m512 wk = widen<kBF16>(w + k * 16);
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(wk, _mm512_set1_ps(xt[k * M + m]), acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    __m512 sum = acc[m][0];
    for (int s = 1; s < kSplit; ++s) sum = _mm512_add_ps(sum, acc[m][s]);
    _mm512_storeu_ps(y + m * N, sum);
  }
}

template <int M, bool kBF16>
void all_tiles(const float* xt, int64_t K, const uint16_t* w, float* y, int64_t N) {
  at::parallel_for(0, N / 16, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile_rows<M, kBF16>(xt, K, w + t * K * 16, y + t * 16, N);
  });
}

template <bool kBF16>
void rows_in_blocks(const float* xp, int64_t M, int64_t K, const uint16_t* wp, float* yp, int64_t N) {
  std::vector<float> buf;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {  // rows in blocks of up to 16 (16 accumulators in registers)
    const int64_t rows = std::min<int64_t>(16, M - m0);
    const float* xs = llmc::columns_of(xp + m0 * K, rows, K, buf);
    float* ys = yp + m0 * N;
    switch (rows) {
#define LLMC_ROWS(n) case n: all_tiles<n, kBF16>(xs, K, wp, ys, N); break;
      LLMC_ROWS(1) LLMC_ROWS(2) LLMC_ROWS(3) LLMC_ROWS(4) LLMC_ROWS(5) LLMC_ROWS(6) LLMC_ROWS(7) LLMC_ROWS(8)
      LLMC_ROWS(9) LLMC_ROWS(10) LLMC_ROWS(11) LLMC_ROWS(12) LLMC_ROWS(13) LLMC_ROWS(14) LLMC_ROWS(15)
      default: all_tiles<16, kBF16>(xs, K, wp, ys, N);
#undef LLMC_ROWS
    }
  }
}

}  // namespace

at::Tensor dense16_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(2) == 16 && w.size(1) == x.size(1) &&
                  (w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16),
              "w: contiguous float16 or bfloat16 [N/16, K, 16] with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 16;
  at::Tensor y = at::detail::empty_cpu({M, N}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  if (w.scalar_type() == at::kBFloat16) rows_in_blocks<true>(x.data_ptr<float>(), M, K, wp, y.data_ptr<float>(), N);
  else rows_in_blocks<false>(x.data_ptr<float>(), M, K, wp, y.data_ptr<float>(), N);
  return y;
}
