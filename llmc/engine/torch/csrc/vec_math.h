// Shared AVX-512 float32 math for llmc's CPU kernels.
#pragma once
#include <immintrin.h>

namespace llmc {

// exp(x), float32: x = n ln2 + r, exp(r) by Cephes' degree-6 polynomial, times 2^n (scalef).
// Relative error ~1e-7. Inputs are clamped to [-87.3, 88.7]: below, results flush towards 0; above, ~3.3e38.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split in two: exact n * hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333345093e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// silu(x) * gate = x / (1 + exp(-x)) * gate, silu as PyTorch computes it (the MLP's activation).
inline __m512 silu_mul_ps(__m512 x, __m512 gate) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x)))), gate);
}

// Lane t of the result = the sum of the 16 lanes of v[t] (16 horizontal sums at once: 45 shuffles and adds,
// where 16 separate reductions take ~130). Each level halves the vectors, pairing halves of two of them.
inline __m512 sum16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: a[i] = [v[2i] 8 sums | v[2i+1] 8 sums]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: b[i] = [v[4i] | v[4i+1] | v[4i+2] | v[4i+3]], 4 sums each
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // within 128-bit lanes: pairs of sums
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // d's lane 4j + r holds the sum of v[4r + j]; one permute puts the sum of v[t] in lane t.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, d);
}

}  // namespace llmc
