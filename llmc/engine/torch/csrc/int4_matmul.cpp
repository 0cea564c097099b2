// llmc's CPU W4A16 matmul for small steps (decode): y[M, N] = x[M, K] @ W^T with
//   W[n, k] = q[n, k] * scale[n, k / group],  q in [-8, 7]
// in float32 throughout (activations are not rounded), AVX-512.
//
// Layout (built by llmc/engine/torch/cpu_ext.py: pack_tiles): output channels in tiles of 16, columns in pairs.
//   packed: int8 [N/16, K/2, 16]  byte j of (tile, pair p) holds channel j's q at column 2p (low nibble) and at
//           column 2p + 1 (high nibble), both two's complement
//   scales: float [N/16, K/group, 16]
// One pass over a tile sign-extends each pair of 16-channel columns once (4 shifts and 2 conversions) for up to
// 16 rows of x, so unpacking is shared by the whole decode batch; tiles are spread over torch's thread pool.
// Each row sums q * x over a group exactly as integer-valued weights, then scales the group sum once: a row's
// result does not depend on how many rows share the call (batch-invariant).
#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op declared): half the build time
#include <ATen/EmptyTensor.h>  // at::detail::empty_cpu: ATen/ops/empty.h (the dispatched op) costs 1.5 s more to build
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "columns.h"

namespace {

// xt: x's columns [K, M]; y: the tile's 16 outputs of each row, rows N apart.
template <int M>
void tile_rows(const float* xt, int64_t K, const int8_t* w, const float* scales, int64_t group, float* y,
               int64_t N) {
  __m512 part[M];
  for (int64_t g = 0; g < K / group; ++g) {
    for (int m = 0; m < M; ++m) part[m] = _mm512_setzero_ps();
    const float* xg = xt + g * group * M;
    const int8_t* wg = w + g * group * 8;
    for (int64_t k = 0; k < group; k += 2) {
      const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + k * 8)));
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28));  // low nibble
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 4));                          // high nibble
      const float* xk = xg + k * M;
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        part[m] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xk[m]), part[m]);
        part[m] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xk[M + m]), part[m]);
      }
    }
    const __m512 s = _mm512_loadu_ps(scales + g * 16);
    for (int m = 0; m < M; ++m)  // the running sum lives in y (the group sums take all the registers)
      _mm512_storeu_ps(y + m * N, g == 0 ? _mm512_mul_ps(part[m], s)
                                         : _mm512_fmadd_ps(part[m], s, _mm512_loadu_ps(y + m * N)));
  }
}

template <int M>
void all_tiles(const float* xt, int64_t K, const int8_t* w, const float* scales, int64_t group, float* y,
               int64_t N) {
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      tile_rows<M>(xt, K, w + t * K * 8, scales + t * (K / group) * 16, group, y + t * 16, N);
  });
}

}  // namespace

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == 16, "packed: contiguous int8 [N/16, K/2, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 2 == K && group % 2 == 0 && K % group == 0, "packed/group do not match x's K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N / 16 &&
              scales.size(1) == K / group && scales.size(2) == 16, "scales: contiguous float32 [N/16, K/group, 16]");
  at::Tensor y = at::detail::empty_cpu({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> buf;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {  // rows in blocks of up to 16 (16 group sums in registers)
    const int64_t rows = std::min<int64_t>(16, M - m0);
    const float* xt = llmc::columns_of(xp + m0 * K, rows, K, buf);
    float* ys = yp + m0 * N;
    switch (rows) {
#define LLMC_ROWS(n) case n: all_tiles<n>(xt, K, wp, sp, group, ys, N); break;
      LLMC_ROWS(1) LLMC_ROWS(2) LLMC_ROWS(3) LLMC_ROWS(4) LLMC_ROWS(5) LLMC_ROWS(6) LLMC_ROWS(7) LLMC_ROWS(8)
      LLMC_ROWS(9) LLMC_ROWS(10) LLMC_ROWS(11) LLMC_ROWS(12) LLMC_ROWS(13) LLMC_ROWS(14) LLMC_ROWS(15)
      default: all_tiles<16>(xt, K, wp, sp, group, ys, N);
#undef LLMC_ROWS
    }
  }
  return y;
}
