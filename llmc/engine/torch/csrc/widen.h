// 16 consecutive float32, float16 or bfloat16 values widened to float32 (exact for all three): how llmc's CPU
// kernels read a KV cache of any of its dtypes.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

namespace llmc {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

}  // namespace llmc
