// keel's CPU kernels as C++ functions: bound to Python in bindings.cpp, and called directly by
// the fused decode pass (decode_layers.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <optional>
#include <tuple>

// A GEMM's optional bias (gemm, fp16_gemm, i16_gemm): its float32 data, or nullptr without one.
inline const float* float32_bias(const std::optional<at::Tensor>& bias, int64_t n,
                                 const char* what) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              what, ": bias must be a contiguous float32 [N]");
  return bias->data_ptr<float>();
}

at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_table, at::Tensor seq_lens,
                           std::optional<at::Tensor> rows, double scale, int64_t sliding_window,
                           std::optional<at::Tensor> key_scale = std::nullopt,
                           std::optional<at::Tensor> value_scale = std::nullopt);
// Whether decode attention prefetches a 16-bit or int8 cache's next chunk into L2 (else L1);
// `set` changes it for this process. Chosen for the CPU at first use (paged_attention_common.h).
bool attention_prefetch_into_l2(std::optional<bool> set = std::nullopt);
// Causal attention of one prompt chunk (query [L, H, D]) over its S >= L keys, into out.
void prefill_attention(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor out,
                       double scale, int64_t sliding_window);
// The same for bfloat16 on AMX tiles (prefill_attention_amx.cpp), where this build and CPU
// have them (prefill_attention_amx_available()); head size a multiple of 32.
void prefill_attention_amx(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor out,
                           double scale, int64_t sliding_window);
bool prefill_attention_amx_available();
// The same with both products on AVX512-VNNI's int16 dot products (prefill_attention_i16.cpp;
// float32 or bfloat16), where this build has them (prefill_attention_i16_available()).
void prefill_attention_i16(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor out,
                           double scale, int64_t sliding_window);
bool prefill_attention_i16_available();
// An int8 cache (key_cache int8) takes each row quantized, its float32 scale in key_scale /
// value_scale ([blocks, kv_heads, block_size]).
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                    at::Tensor value_cache, at::Tensor slot_mapping,
                    std::optional<at::Tensor> key_scale = std::nullopt,
                    std::optional<at::Tensor> value_scale = std::nullopt);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_neox_(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                  at::Tensor sin, int64_t head_dim);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor argmax_rows(at::Tensor x);
at::Tensor int4_gemm(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor mins);
at::Tensor int8_gemm(at::Tensor x, at::Tensor q, at::Tensor scale);
// The same with the activations quantized per group of 32 to `parts` int8 parts (1: int8;
// 2: ~15 bits) and integer dot products.
at::Tensor int4_gemm_q8(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor mins,
                        int64_t parts);
at::Tensor int8_gemm_q8(at::Tensor x, at::Tensor q, at::Tensor scale, int64_t parts);
// x @ W^T for keel's int4 (m given) or int8 weights, choosing the kernel for the pass;
// activations in `act_parts` int8 parts, 0 for float32.
at::Tensor quant_linear(at::Tensor x, at::Tensor q, at::Tensor d, std::optional<at::Tensor> m,
                        int64_t act_parts);
bool quant_gemm_available();
// keel's float32 GEMM (gemm.cpp): W [N, K] (float32 or bfloat16) packed once into panels of
// 16 output columns, then x [M, K] float32 @ W^T (+ bias float32 [N]) -> [M, N] float32.
at::Tensor gemm_pack(at::Tensor weight);
at::Tensor gemm(at::Tensor x, at::Tensor packed, int64_t n, std::optional<at::Tensor> bias);
// The same over a merged [gate; up] weight (N = 2I, I a multiple of 16), with the SiLU and
// product in the epilogue: [M, I] = silu_and_mul(gemm(x, packed, N, bias)), the same bits.
at::Tensor gemm_silu(at::Tensor x, at::Tensor packed, int64_t n,
                     std::optional<at::Tensor> bias);
// o[i] = silu(g[i]) * u[i] for n floats (a multiple of 8), as silu_and_mul computes it in
// float32 (fused_ops.cpp): gemm_silu's epilogue.
void silu_mul_f32(const float* g, const float* u, float* o, int64_t n);
bool gemm_available();
// bfloat16 x [M, K] @ W^T (+ bias) -> [M, N] bfloat16 on AMX tiles (amx_gemm.cpp), W packed
// once by amx_gemm_pack; K % 32 == 0, N % 16 == 0. Where the CPU has no tiles but AVX512-BF16,
// amx_gemm and amx_gemm_argmax run the dense copy on bf16_dot_gemm (amx_gemm_dense_available).
at::Tensor amx_gemm_pack(at::Tensor weight);
// Its int4 copy from keel's int4 form (q uint8 [N, K / 2], d and m [N, K / 32]: W = q d + m),
// or an empty tensor where that does not widen to exactly the bfloat16 `dense` [N, K].
// amx_gemm takes either copy.
at::Tensor amx_gemm_pack_int4(at::Tensor q, at::Tensor d, at::Tensor m, at::Tensor dense);
// Likewise from int8 in groups of 32 (q int8 [N, K], d [N, K / 32]: W = q d, a GGUF Q8_0
// tensor's numbers).
at::Tensor amx_gemm_pack_int8(at::Tensor q, at::Tensor d, at::Tensor dense);
// silu_mul: W's rows are a [gate; up] layer's interleaved by 16 (gate rows 16j.., then up
// rows 16j..), and the result is silu(gate) * up [M, N / 2], as silu_and_mul of the GEMM.
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t n, std::optional<at::Tensor> bias,
                    bool silu_mul = false);
// Each row's argmax over columns [0, n_valid) of amx_gemm(x, packed, n, bias)'s output, as
// torch's argmax of it gives it, without writing the output: greedy sampling in the LM head.
at::Tensor amx_gemm_argmax(at::Tensor x, at::Tensor packed, int64_t n, int64_t n_valid,
                           std::optional<at::Tensor> bias);
// float32 x [M, K] @ W^T (+ float32 bias) -> float32 [M, N] (silu_mul: [M, N / 2]) on the same
// tiles, W's values all bfloat16 (amx_gemm_pack of it), x split into three bfloat16 parts.
at::Tensor amx_gemm_f32(at::Tensor x, at::Tensor packed, int64_t n, std::optional<at::Tensor> bias,
                        bool silu_mul);
bool amx_gemm_available();
// Whether amx_gemm and amx_gemm_argmax run over amx_gemm_pack's copy here: on AMX tiles, or
// on AVX512-BF16's dot products (the int4 / int8 copies and amx_gemm_f32 need the tiles).
bool amx_gemm_dense_available();
// float32 x [M, K] @ W^T (+ bias) on AVX512-FP16's float16 FMAs (fp16_gemm.cpp), W packed once
// by fp16_gemm_pack (which also gives the largest |W|, fp16_gemm's w_max); silu_mul: W's rows
// interleaved by 16 as amx_gemm's, the result silu(gate) * up [M, N / 2]. dtype="auto" takes it
// for a float32 model on a CPU with AVX512-FP16 and no AMX (layers/gemm_choice.py).
std::tuple<at::Tensor, double> fp16_gemm_pack(at::Tensor weight);
at::Tensor fp16_gemm(at::Tensor x, at::Tensor packed, int64_t n, double w_max,
                     std::optional<at::Tensor> bias, bool silu_mul = false);
bool fp16_gemm_available();
// float32 x [M, K] @ W^T (+ bias) on AVX512-VNNI's int16 dot products (i16_gemm.cpp): x and W
// as int16 scaled per block of 128 values of k (W's by i16_gemm_pack, with its scales), each
// block's products summed exactly in int32; silu_mul as fp16_gemm's.
std::tuple<at::Tensor, at::Tensor> i16_gemm_pack(at::Tensor weight);
at::Tensor i16_gemm(at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t n,
                    std::optional<at::Tensor> bias, bool silu_mul = false);
// Each row's argmax over columns [0, n_valid) of i16_gemm(x, packed, scales, n, bias)'s
// output, as torch's argmax of it gives it, without writing the output (greedy sampling in the
// LM head, as amx_gemm_argmax).
at::Tensor i16_gemm_argmax(at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t n,
                           int64_t n_valid, std::optional<at::Tensor> bias);
bool i16_gemm_available();
// A greedy LM head (greedy_head.cpp): each row's argmax over columns [0, n_valid) of
// x @ W^T in float32 (bfloat16-rounded with round_bf16), found by screening the columns with
// int8 dot products (W's by greedy_head_pack) and a rigorous bound on their error, then
// computing exactly only the columns the bound cannot rule out (at most `cap` a row, else the
// whole row); returns the token ids and how many columns each row computed exactly (-1: all).
std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_head_pack(at::Tensor weight);
std::tuple<at::Tensor, at::Tensor> greedy_head(at::Tensor x, at::Tensor packed,
                                               at::Tensor scales, at::Tensor norms,
                                               at::Tensor weight, int64_t n_valid,
                                               bool round_bf16, int64_t cap);
bool greedy_head_available();
// Whether i16_gemm's and bf16_dot_gemm's decode passes prefetch weights non-temporally
// (set= changes it; vendor_choice.h).
bool gemm_prefetch_nta(std::optional<bool> set = std::nullopt);
// amx_gemm's dense copy on AVX512-BF16's `vdpbf16ps` (bf16_dot_gemm.cpp), which amx_gemm and
// amx_gemm_argmax run on where the CPU has no AMX tiles: x [M, K] bfloat16 (M > 0) against
// amx_gemm_pack's `packed` for N = n into `out` [M, n] (silu: [M, n / 2]), the bias float32
// or bfloat16 (or none), or, with `argmax`, each row's argmax into it; amx_gemm's checks
// (check_amx_gemm, the bias's too) made by the caller.
namespace keel {
struct ArgmaxSink;
}
void bf16_dot_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                   const std::optional<at::Tensor>& bias, bool silu, c10::BFloat16* out,
                   keel::ArgmaxSink* argmax);
bool bf16_dot_gemm_available();
