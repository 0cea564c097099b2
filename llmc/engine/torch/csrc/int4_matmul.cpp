// llmc's CPU W4A16 matmul for small steps (decode): y[M, N] = x[M, K] @ W^T with
//   W[n, k] = (u[n, k] - 8) * scale[n, k / group]
// in float32 throughout (activations are not rounded), AVX-512.
//
// Layout (built by llmc/engine/torch/cpu_ext.py: pack_tiles): output channels in tiles of 16.
//   packed: uint8 [N/16, K, 8]  byte j of (tile, k) holds channel 2j (low nibble) and 2j+1 (high nibble), u in [0, 15]
//   scales: float [N/16, K/group, 16]
// One pass over a tile dequantizes each 16-channel column once for up to 16 rows of x, so the cost of
// unpacking the weights is shared by the whole decode batch; tiles are spread over torch's thread pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

// Up to 8 rows: integer-valued weights into per-group sums, scaled once per group (fewer multiplies per
// column). More rows: the scale is folded into each dequantized column (half the accumulators).
template <int M>
void tile_rows(const float* x, int64_t K, const uint8_t* w, const float* scales, int64_t group, float* y,
               int64_t N) {
  constexpr bool kGroupSums = M <= 8;
  __m512 acc[M], part[kGroupSums ? M : 1];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m512 centred = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);  // u -> u - 8
  for (int64_t g = 0; g < K / group; ++g) {
    const __m512 s = _mm512_loadu_ps(scales + g * 16);
    if constexpr (kGroupSums) {
      for (int m = 0; m < M; ++m) part[m] = _mm512_setzero_ps();
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 8));  // columns k and k + 1
      const __m128i lo = _mm_and_si128(b, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      __m512 w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), centred);
      __m512 w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), centred);
      const float* xk = x + k;
      if constexpr (kGroupSums) {
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          part[m] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xk[m * K]), part[m]);
          part[m] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xk[m * K + 1]), part[m]);
        }
      } else {
        w0 = _mm512_mul_ps(w0, s);
        w1 = _mm512_mul_ps(w1, s);
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          acc[m] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xk[m * K]), acc[m]);
          acc[m] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xk[m * K + 1]), acc[m]);
        }
      }
    }
    if constexpr (kGroupSums) {
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(part[m], s, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * N, acc[m]);
}

template <int M>
void all_tiles(const float* x, int64_t K, const uint8_t* w, const float* scales, int64_t group, float* y,
               int64_t N) {
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      tile_rows<M>(x, K, w + t * K * 8, scales + t * (K / group) * 16, group, y + t * 16, N);
  });
}

}  // namespace

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(2) == 8,
              "packed: contiguous uint8 [N/16, K, 8]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) == K && group % 2 == 0 && K % group == 0, "packed/group do not match x's K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N / 16 &&
              scales.size(1) == K / group && scales.size(2) == 16, "scales: contiguous float32 [N/16, K/group, 16]");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += 16) {  // rows in blocks of up to 16 (16 accumulators in registers)
    const float* xs = xp + m0 * K;
    float* ys = yp + m0 * N;
    switch (std::min<int64_t>(16, M - m0)) {
#define LLMC_ROWS(n) case n: all_tiles<n>(xs, K, wp, sp, group, ys, N); break;
      LLMC_ROWS(1) LLMC_ROWS(2) LLMC_ROWS(3) LLMC_ROWS(4) LLMC_ROWS(5) LLMC_ROWS(6) LLMC_ROWS(7) LLMC_ROWS(8)
      LLMC_ROWS(9) LLMC_ROWS(10) LLMC_ROWS(11) LLMC_ROWS(12) LLMC_ROWS(13) LLMC_ROWS(14) LLMC_ROWS(15)
      default: all_tiles<16>(xs, K, wp, sp, group, ys, N);
#undef LLMC_ROWS
    }
  }
  return y;
}
