// llmc's fused CPU elementwise ops, float32, AVX-512: each reads its inputs once and writes once, where
// PyTorch's decomposed forms make 3-6 passes (and as many op dispatches, which dominate at one decode token).
//
//   rms_norm(x [T, H], w [H], eps)            -> x / sqrt(mean(x^2) + eps) * w, as transformers' LlamaRMSNorm
//   add_rms_norm_(h [T, H], d [T, H], w, eps) -> h += d (in place), then rms_norm(h, w, eps)
//   silu_mul(a [T, 2I])                       -> silu(a[:, :I]) * a[:, I:]   (the MLP's fc and gate halves)
//   rope(x [T, heads, hd], cos, sin [T, 1, hd]) -> x * cos + cat(x2, x1) * sin (llmc/engine/torch/rope.py), with
//                                                 transformers' roundings: two products, then the sum (no FMA)
//   argmax_rows(x [R, V])                     -> int64 [R]: each row's first index of its maximum, as torch.argmax
//                                                 (NaN never wins: the sampler maps NaN to -inf first)
#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op declared): half the build time
#include <ATen/EmptyTensor.h>  // at::detail::empty_cpu: ATen/ops/empty.h (the dispatched op) costs 1.5 s more to build
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "vec_math.h"

namespace {

constexpr int64_t kGrainElements = 16384;  // elements per thread-pool chunk: small steps run inline

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

// One row: optionally h += d first, then out = h * (1 / sqrt(mean(h^2) + eps)) * w.
void norm_row(float* h, const float* d, const float* w, float* out, int64_t n, float eps) {
  __m512 ss = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_loadu_ps(h + j);
    if (d != nullptr) {
      v = _mm512_add_ps(v, _mm512_loadu_ps(d + j));
      _mm512_storeu_ps(h + j, v);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  if (j < n) {
    const __mmask16 m = tail_mask(n - j);
    __m512 v = _mm512_maskz_loadu_ps(m, h + j);
    if (d != nullptr) {
      v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, d + j));
      _mm512_mask_storeu_ps(h + j, m, v);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
  const __m512 s = _mm512_set1_ps(inv);
  for (j = 0; j + 16 <= n; j += 16)  // (h * inv) * w: transformers' order of the two products
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(h + j), s), _mm512_loadu_ps(w + j)));
  if (j < n) {
    const __mmask16 m = tail_mask(n - j);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, h + j), s);
    _mm512_mask_storeu_ps(out + j, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + j)));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [T, H]");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == x.size(1),
              "weight: contiguous float32 [H]");
}

at::Tensor norm_rows(const at::Tensor& h, const float* d, const at::Tensor& w, double eps) {
  at::Tensor out = at::detail::empty_cpu(h.sizes(), h.options());
  const int64_t n = h.size(1);
  float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, h.size(0), std::max<int64_t>(1, kGrainElements / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(hp + r * n, d == nullptr ? nullptr : d + r * n, wp, op + r * n, n, static_cast<float>(eps));
  });
  return out;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  return norm_rows(x, nullptr, w, eps);  // d == nullptr: x is only read
}

at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps) {
  check_rows(h, w);
  TORCH_CHECK(d.sizes() == h.sizes() && d.scalar_type() == at::kFloat && d.is_contiguous(),
              "delta: contiguous float32 like h");
  return norm_rows(h, d.data_ptr<float>(), w, eps);
}

at::Tensor silu_mul(const at::Tensor& a) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous() && a.size(1) % 2 == 0,
              "a: contiguous float32 [T, 2I]");
  const int64_t rows = a.size(0), n = a.size(1) / 2;
  at::Tensor out = at::detail::empty_cpu({rows, n}, a.options());
  const float* ap = a.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* fc = ap + r * 2 * n;
      const float* gate = fc + n;
      float* o = op + r * n;
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - j);
        const __m512 x = _mm512_maskz_loadu_ps(m, fc + j);
        _mm512_mask_storeu_ps(o + j, m, llmc::silu_mul_ps(x, _mm512_maskz_loadu_ps(m, gate + j)));
      }
    }
  });
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x: float32 [T, heads, hd] with contiguous heads");
  const int64_t t = x.size(0), heads = x.size(1), hd = x.size(2), half = hd / 2;
  TORCH_CHECK(hd % 32 == 0, "head_size must be a multiple of 32");
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->numel() == t * hd,
                "cos/sin: contiguous float32 [T, 1, hd]");
  at::Tensor out = at::detail::empty_cpu({t, heads, hd}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row = x.stride(0);
  at::parallel_for(0, t, std::max<int64_t>(1, kGrainElements / (heads * hd)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + i * hd;
      const float* s = sp + i * hd;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = xp + i * row + h * hd;
        float* o = op + (i * heads + h) * hd;
        for (int64_t j = 0; j < hd; j += 16) {
          const int64_t r = j < half ? j + half : j - half;  // cat(x2, x1): the other half, same offset
          const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(xh + j), _mm512_loadu_ps(c + j));
          const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(xh + r), _mm512_loadu_ps(s + j));
          _mm512_storeu_ps(o + j, _mm512_add_ps(a, b));
        }
      }
    }
  });
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) >= 1,
              "x: contiguous float32 [R, V] with V >= 1");
  const int64_t rows = x.size(0), v = x.size(1);
  at::Tensor out = at::detail::empty_cpu({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements * 4 / v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * v;
      // Per lane: the largest value seen and the first column holding it (only a strictly larger value moves it).
      __m512 best = _mm512_set1_ps(-INFINITY);
      __m512i where = _mm512_set1_epi32(-1);
      __m512i col = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      const __m512i step = _mm512_set1_epi32(16);
      for (int64_t j = 0; j < v; j += 16) {
        const __mmask16 m = v - j >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(v - j);
        const __m512 val = _mm512_maskz_loadu_ps(m, row + j);
        const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, val, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, val);
        where = _mm512_mask_mov_epi32(where, gt, col);
        col = _mm512_add_epi32(col, step);
      }
      const float top = _mm512_reduce_max_ps(best);
      // The first column among the lanes that hold the maximum; an all -inf (or all NaN) row gives column 0.
      const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ) &
                               _mm512_cmpge_epi32_mask(where, _mm512_setzero_si512());
      const int32_t first = at_top ? _mm512_mask_reduce_min_epi32(at_top, where) : 0;
      op[r] = first;
    }
  });
  return out;
}
