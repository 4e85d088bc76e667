// Python bindings of keel's CPU kernels (built by keel/cpu_ops.py). torch's pybind11 casters
// for tensors only: the whole of torch/extension.h took ~15 s more to compile.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_table, at::Tensor seq_lens,
                           std::optional<at::Tensor> rows, double scale, int64_t sliding_window);
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                    at::Tensor value_cache, at::Tensor slot_mapping);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_neox_(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                  at::Tensor sin, int64_t head_dim);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor int4_gemm(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor mins);
at::Tensor int8_gemm(at::Tensor x, at::Tensor q, at::Tensor scale);
bool quant_gemm_available();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention, one query token per row");
  m.def("write_kv_cache", &write_kv_cache, "this pass's K/V rows into their cache slots");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("fused_add_rms_norm_", &fused_add_rms_norm_, "residual += x; x = RMSNorm(residual)");
  m.def("rotary_neox_", &rotary_neox_, "rotate-half RoPE of q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :n]) * x[:, n:]");
  m.def("int4_gemm", &int4_gemm, "x @ W^T for int4 W (groups of 32), at most 4 rows");
  m.def("int8_gemm", &int8_gemm, "x @ W^T for int8 W (one scale per row), at most 4 rows");
  m.def("quant_gemm_available", &quant_gemm_available, "built with AVX2 + FMA");
}
