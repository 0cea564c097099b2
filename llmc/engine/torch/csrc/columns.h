// x [M, K] row-major -> its columns [K, M]: the M values a kernel broadcasts for column k are then contiguous at
// one pointer (constant offsets), instead of M row pointers that do not fit in the general registers.
#pragma once

#include <cstdint>
#include <vector>

namespace llmc {

inline const float* columns_of(const float* x, int64_t M, int64_t K, std::vector<float>& buf) {
  if (M == 1) return x;  // one row is its own column layout
  buf.resize(static_cast<size_t>(M * K));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) buf[k * M + m] = x[m * K + k];
  return buf.data();
}

}  // namespace llmc
