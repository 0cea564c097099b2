// The Python module of llmc's CPU kernels (llmc/engine/torch/cpu_ext.py builds it from the sources here).
// pybind11 with torch's at::Tensor caster: all this module needs. torch/extension.h adds the whole C++ frontend
// (torch::nn, optim, ...) and took this file from 6 to 17 s to build (2-core Xeon, -O3).
#include <torch/csrc/utils/pybind.h>

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group);
at::Tensor dense16_matmul(const at::Tensor& x, const at::Tensor& w);
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w);
at::Tensor bf16_gemm_silu_mul(const at::Tensor& x, const at::Tensor& w);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& a);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                                  at::Tensor lens, double scale);
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& chunks, double scale, at::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_matmul", &int4_matmul, "W4A16 matmul, float32, AVX-512 (int4_matmul.cpp)");
  m.def("dense16_matmul", &dense16_matmul, "float32 x @ 16-bit W^T, float32 math, AVX-512 (dense16_matmul.cpp)");
  m.def("bf16_gemm", &bf16_gemm, "float32 x @ W^T in bfloat16 products, float32 sums, AVX512-BF16 (bf16_gemm.cpp)");
  m.def("bf16_gemm_silu_mul", &bf16_gemm_silu_mul,
        "silu(x @ fc^T) * (x @ gate^T) of a stacked bfloat16 [fc; gate] weight, float32 sums (bf16_gemm.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows (fused_ops.cpp)");
  m.def("add_rms_norm_", &add_rms_norm_, "h += d in place, then RMSNorm of h (fused_ops.cpp)");
  m.def("silu_mul", &silu_mul, "silu(first half) * second half of float32 rows (fused_ops.cpp)");
  m.def("rope", &rope, "NeoX rotary embedding of float32 heads (fused_ops.cpp)");
  m.def("argmax_rows", &argmax_rows, "each float32 row's first index of its maximum (fused_ops.cpp)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token queries over a paged KV cache, float32, AVX-512 (paged_attention.cpp)");
  m.def("prefill_attention", &prefill_attention,
        "prefill chunks over a paged KV cache, bfloat16 products, float32 sums, AVX512-BF16 (prefill_attention.cpp)");
}
