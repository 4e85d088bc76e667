// The fused pass: a Llama-family model's decoder layers for a pass of decode rows (one token
// per request), or of prompt tokens beside them, run as one C++ call.
//
// At one row a decode step's kernels take ~12 ms on the default model (quantized), and the
// Python between them (module calls, views, splits, ~10 ops per layer x 30 layers) took ~8 ms
// more (at 64 dense float32 rows the GEMMs dominate and the gain is within noise). Here the
// same kernels run in the same order with the same arguments as the Python layers
// (keel/model_executor/models/llama.py), so the result is bit-identical; only the interpreter
// is gone. keel/model_executor/layers/fused_decode.py decides when a pass can take it.
#pragma once

#include "ops.h"

#include <ATen/core/ivalue.h>

#include <vector>

// x @ W^T (+ bias), as keel's LinearBase._matmul computes it: on keel's quantized kernels
// (int4 in groups of 32: q uint8 [N, K/2], d and m [N, K/32], W = q d + m; or int8 per row:
// q int8 [N, K], d = scale float32 [N]) for passes of at most `max_rows` rows, else on the
// packed weight (keel's gemm or oneDNN's), else on the dense weight.
struct PlanLinear {
  at::Tensor q, d;
  std::optional<at::Tensor> m;  // int4's mins; none for int8
  int64_t max_rows = 0;         // quantized kernels up to this many rows (0: no quantized form)
  int64_t act_parts = 0;        // quant_linear's activations, as the Python layers choose
  at::Tensor packed, weight, bias;  // packed / dense weight, bias; each may be undefined
  int64_t gemm_rows = 0;  // > 0: `packed` is keel's gemm_pack panels of this many rows
  // A bfloat16 pass computed in float32 and rounded back (keel's panels, or oneDNN's
  // float32 upcast), as layers/packed_weights.py cpu_gemm does.
  bool float32_compute = false;
  // quantization="w8a8": fbgemm's packed int8 weight (a LinearPackedParams script object),
  // run as quantized_linear runs it, at every pass size; None otherwise.
  c10::IValue w8a8;
  // bfloat16 passes of up to amx_rows rows: keel's AMX GEMM over `amx` (amx_gemm_pack of the
  // [amx_n, K] weight), as layers/packed_weights.py cpu_gemm takes it.
  at::Tensor amx;
  int64_t amx_rows = 0, amx_n = 0;
  // `amx` is a [gate; up] layer's rows interleaved by 16 (amx_gemm's silu_mul form, with
  // `amx_bias` interleaved alike): only silu_mul takes it.
  bool amx_silu = false;
  at::Tensor amx_bias;
  // Passes above max_rows: fp16_gemm over `fp16` (fp16_gemm_pack's panels of the [fp16_n, K]
  // weight, its largest |W| fp16_w_max; a bfloat16 pass in float32, rounded back), as
  // layers/packed_weights.py cpu_gemm takes it. fp16_silu: the rows are a [gate; up] layer's
  // interleaved by 16 (fp16_bias alike): silu_mul takes them in the epilogue, and a plain pass
  // puts its columns back in [gate; up] order by fp16_unorder.
  // With `i16_scales` defined, `fp16` is i16_gemm_pack's int16 panels instead (and these
  // their blocks' scales): i16_gemm takes the passes, as packed_by "i16" in Python.
  at::Tensor fp16;
  double fp16_w_max = 0;
  int64_t fp16_n = 0;
  bool fp16_silu = false;
  at::Tensor fp16_bias, fp16_unorder, i16_scales;
  // fp16_gemm or i16_gemm over `fp16`, float32 x.
  at::Tensor low_gemm(const at::Tensor& x, const at::Tensor& b, bool silu) const;
  at::Tensor operator()(const at::Tensor& x) const;
  // silu(gate) * up of a merged [gate; up] layer: in keel's GEMM epilogue where it applies.
  at::Tensor silu_mul(const at::Tensor& x) const;
};

struct DecodeLayer {
  at::Tensor input_norm, post_norm;  // RMSNorm weights [hidden]
  PlanLinear qkv, o, gate_up, down;
  at::Tensor q_norm, k_norm;  // Qwen3's per-head RMSNorm weights [head_dim], else undefined
  at::Tensor cos, sin;        // RoPE caches [max_pos, rot_dim] (float32)
  at::Tensor key_cache, value_cache;  // [num_blocks, Hkv, block_size, D]
  int64_t heads, kv_heads, head_dim, sliding_window;  // sliding_window 0: none
  double scale, eps;
  at::Tensor key_scale, value_scale;  // an int8 cache's [num_blocks, Hkv, block_size], else undefined
};

// The attention of a pass that is not all decode rows, as torch_paged.paged_attention runs it
// (the same kernels, arguments and order): rows of prompt tokens each see the keys up to their
// own position; a pass with long prompt chunks sends every other token to paged_attention and
// each long chunk to the causal prefill kernel (torch_paged._split_attention).
struct PassAttention {
  // Per token: its request (block-table row, int32) and the keys it sees (int64). Undefined
  // for a pass of decode rows only (row t is request t, seq_lens).
  at::Tensor token_rows, token_seq_lens;
  // A pass with long chunks: (request, first token, query length, seq length) of each, int64
  // [n, 4]; the other tokens (undefined where none) with their requests and key counts.
  at::Tensor long_chunks, short_tokens, short_rows, short_seq_lens;
  // The kernel of the long chunks: prefill_attention, prefill_attention_amx (bfloat16 on AMX
  // tiles) or prefill_attention_i16 (int16 dot products; dtype="auto" on i16_gemm).
  enum class Kernel { kFloat, kAmx, kInt16 } kernel = Kernel::kFloat;
};

class DecodePlan {
 public:
  void add_layer(DecodeLayer layer) { layers_.push_back(std::move(layer)); }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // hidden [M, hidden] in the model's dtype (the embedding's output, or the previous stage's with
  // `residual`) -> (hidden, residual) after every layer, as LlamaModel's loop returns them.
  // `attention` describes a pass with prompt tokens (none: every row one decode token);
  // `output_rows`: only these rows' outputs are wanted, and the last layer computes its output
  // projection and MLP for them alone (the result has just those rows), as the Python layers.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, std::optional<at::Tensor> residual,
                                         at::Tensor positions, at::Tensor block_table,
                                         at::Tensor seq_lens, at::Tensor slot_mapping,
                                         const std::optional<PassAttention>& attention,
                                         const std::optional<at::Tensor>& output_rows) const;

 private:
  std::vector<DecodeLayer> layers_;
};
