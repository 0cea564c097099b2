// llmc's CPU GEMM for prefill: y[M, N] = x[M, K] @ W^T with x and W in bfloat16 and every product summed in
// float32 (AVX512-BF16's vdpbf16ps: two bfloat16 products per float32 lane per instruction, twice the FLOPs of
// a float32 FMA). x arrives in float32 and is rounded to bfloat16 here (round to nearest even), y leaves in
// float32: nothing but the two inputs is rounded.
//
// Layout (llmc/engine/torch/cpu_ext.py: pack_bf16_pairs): output channels in tiles of 16, columns in pairs,
//   w: bfloat16 [N/16, K/2, 16, 2]  (one 64-byte vector per (tile, column pair): 16 channels x 2 columns)
// x is rounded into bfloat16 pairs [M, K/2] (one 32-bit word per column pair: what vdpbf16ps broadcasts).
// Micro-tile: kRows rows x kTiles tiles, kRows * kTiles float32 accumulators held in registers for the whole K;
// each step loads kTiles weight vectors and broadcasts one pair per row. Threads split the weight tiles; rows
// go in chunks of kChunkBytes of rounded x, which stays in L2 while every weight tile passes over it.
// bf16_gemm_silu_mul: the MLP's stacked [fc; gate] weight, y = silu(x fc^T) * (x gate^T) [M, N/2] with no [M, N]
// intermediate: each panel's fc sums wait in a small buffer for the matching gate tiles' sums.
//
// Compiled for AVX512-BF16 (the target pragma below, this file only); callers check the CPU first
// (cpu_ext.bf16_prefill_why_not).
#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op declared): half the build time
#include <ATen/EmptyTensor.h>  // at::detail::empty_cpu: ATen/ops/empty.h (the dispatched op) costs 1.5 s more to build
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "vec_math.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

constexpr int kRows = 8;                  // rows per micro-tile
constexpr int kTiles = 3;                 // 16-channel weight tiles per micro-tile: 24 accumulators
constexpr int64_t kChunkBytes = 1 << 18;  // rounded x per chunk of rows, kept in L2 while every tile passes
// Measured (SmolLM2's four shapes, 128-2,048 rows, one Zen 4 core, 2026-12-01): 8 x 3 203-216 GFLOP/s,
// 6 x 4 190-214, 12 x 2 164-169; chunks of 128 KiB or 512 KiB within 2 % of 256 KiB.

// x [rows, K] float32 -> bfloat16 pairs [rows, K/2] (round to nearest even), K even.
void round_rows(const float* x, int64_t rows, int64_t K, uint32_t* out) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = x + m * K;
      uint32_t* o = out + m * (K / 2);
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k));
        _mm512_storeu_si512(o + k / 2, reinterpret_cast<__m512i>(v));
      }
      if (k < K) {  // the last K % 32 columns (an even count), padded with zeros
        const __mmask16 lo = _cvtu32_mask16((1u << std::min<int64_t>(16, K - k)) - 1);
        const __mmask16 hi = _cvtu32_mask16(K - k > 16 ? (1u << (K - k - 16)) - 1 : 0);
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, xr + k + 16), _mm512_maskz_loadu_ps(lo, xr + k));
        _mm512_mask_storeu_epi32(o + k / 2, _cvtu32_mask16((1u << ((K - k) / 2)) - 1), reinterpret_cast<__m512i>(v));
      }
    }
  });
}

// Where a micro-tile's float32 sums go: y[r][16 t + lane] = sum.
struct Store {
  float* y;
  int64_t ldy;
  void put(int r, int t, __m512 sum) const { _mm512_storeu_ps(y + r * ldy + t * 16, sum); }
};

// The sums are the gate of an MLP: y = silu(fc) * gate, fc from a buffer the matching fc tiles were stored in.
struct SiluMulStore {
  float* y;
  int64_t ldy;
  const float* fc;
  int64_t ldf;
  void put(int r, int t, __m512 gate) const {
    _mm512_storeu_ps(y + r * ldy + t * 16, llmc::silu_mul_ps(_mm512_loadu_ps(fc + r * ldf + t * 16), gate));
  }
};

// R rows (of x pairs, row stride ldx words) times T consecutive weight tiles (tile stride P * 16 words) over
// P column pairs -> out.put(r, t, sums of row r, tile t).
template <int R, int T, typename Out>
inline void micro_tile(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t P, const Out& out) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh wv[T];
    for (int t = 0; t < T; ++t)
      wv[t] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + (t * P + p) * 16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * ldx + p])));
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[t], b);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out.put(r, t, acc[r][t]);
}

// One chunk's rounded rows (x, P pairs each) over tiles [t0, t0 + T): y = x @ W^T, y's row stride ldy.
template <int T>
struct Plain {
  const uint32_t* x;
  int64_t P;
  const uint32_t* w;
  float* y;
  int64_t ldy;
  template <int R>
  void panel(int64_t m) const { micro_tile<R, T>(x + m * P, P, w, P, Store{y + m * ldy, ldy}); }
};

// The same over fc tiles [t0, t0 + T) and their gate tiles (`gate_offset` tiles further): y = silu(fc) * gate.
template <int T>
struct SiluMul {
  const uint32_t* x;
  int64_t P;
  const uint32_t* w;
  int64_t gate_offset;
  float* y;
  int64_t ldy;
  template <int R>
  void panel(int64_t m) const {
    alignas(64) float fc[kRows * kTiles * 16];
    micro_tile<R, T>(x + m * P, P, w, P, Store{fc, kTiles * 16});
    micro_tile<R, T>(x + m * P, P, w + gate_offset * P * 16, P, SiluMulStore{y + m * ldy, ldy, fc, kTiles * 16});
  }
};

// Every row of the chunk in panels of kRows (then the remaining rows).
template <typename Panels>
void over_rows(const Panels& panels, int64_t rows) {
  int64_t m = 0;
  for (; m + kRows <= rows; m += kRows) panels.template panel<kRows>(m);
  switch (rows - m) {
#define LLMC_TAIL(n) case n: panels.template panel<n>(m); break;
    LLMC_TAIL(1) LLMC_TAIL(2) LLMC_TAIL(3) LLMC_TAIL(4) LLMC_TAIL(5) LLMC_TAIL(6) LLMC_TAIL(7)
#undef LLMC_TAIL
    default: break;
  }
}

// y [M, N or N/2] from x [M, K] and w's `tiles` tiles: N = 16 tiles outputs, or with `silu_mul` the N/2 outputs
// silu(fc) * gate of a stacked [fc; gate] weight. Threads split the (fc) tiles in groups of kTiles.
void gemm(const float* xp, int64_t M, int64_t K, const uint32_t* wp, int64_t tiles, bool silu_mul, float* yp) {
  const int64_t P = K / 2, out_tiles = silu_mul ? tiles / 2 : tiles, ldy = out_tiles * 16;
  const int64_t chunk = std::max<int64_t>(kRows, kChunkBytes / (K * 2) / kRows * kRows);
  std::vector<uint32_t> xb(static_cast<size_t>(std::min(M, chunk) * P));
  const int64_t groups = (out_tiles + kTiles - 1) / kTiles;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    round_rows(xp + m0 * K, rows, K, xb.data());
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t t0 = g * kTiles, count = std::min<int64_t>(kTiles, out_tiles - t0);
        const uint32_t* w = wp + t0 * P * 16;
        float* y = yp + m0 * ldy + t0 * 16;
        auto run = [&](auto tiles_constant) {
          constexpr int T = decltype(tiles_constant)::value;
          if (silu_mul) over_rows(SiluMul<T>{xb.data(), P, w, out_tiles, y, ldy}, rows);
          else over_rows(Plain<T>{xb.data(), P, w, y, ldy}, rows);
        };
        if (count == 3) run(std::integral_constant<int, 3>{});
        else if (count == 2) run(std::integral_constant<int, 2>{});
        else run(std::integral_constant<int, 1>{});
      }
    });
  }
}

void check_operands(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(2) == 16 &&
                  w.size(3) == 2 && w.size(1) * 2 == x.size(1),
              "w: contiguous bfloat16 [N/16, K/2, 16, 2] with x's K (even)");
}

}  // namespace

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w) {
  check_operands(x, w);
  at::Tensor y = at::detail::empty_cpu({x.size(0), w.size(0) * 16}, x.options());
  gemm(x.data_ptr<float>(), x.size(0), x.size(1), reinterpret_cast<const uint32_t*>(w.data_ptr()), w.size(0), false,
       y.data_ptr<float>());
  return y;
}

at::Tensor bf16_gemm_silu_mul(const at::Tensor& x, const at::Tensor& w) {
  check_operands(x, w);
  TORCH_CHECK(w.size(0) % 2 == 0, "w: a stacked [fc; gate] weight of whole tiles each");
  at::Tensor y = at::detail::empty_cpu({x.size(0), w.size(0) * 8}, x.options());
  gemm(x.data_ptr<float>(), x.size(0), x.size(1), reinterpret_cast<const uint32_t*>(w.data_ptr()), w.size(0), true,
       y.data_ptr<float>());
  return y;
}

#pragma GCC pop_options
