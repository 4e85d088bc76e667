// The fused decode pass: a Llama-family model's decoder layers for a pass of a few decode
// rows (one user's decode), run as one C++ call over keel's quantized weights.
//
// At one row a decode step's kernels take ~12 ms on the default model, and the Python between
// them (module calls, views, splits, ~10 ops per layer x 30 layers) took ~8 ms more. Here the
// same kernels run in the same order with the same arguments as the Python layers
// (keel/model_executor/models/llama.py), so the result is bit-identical; only the interpreter
// is gone. keel/model_executor/layers/fused_decode.py decides when a pass can take it.
#pragma once

#include "ops.h"

#include <vector>

// x @ W^T (+ bias) with W kept quantized: int4 in groups of 32 (q uint8 [N, K/2], d and m
// [N, K/32], W = q d + m) or int8 per row (q int8 [N, K], d = scale float32 [N]).
struct QLinear {
  at::Tensor q, d;
  std::optional<at::Tensor> m;  // none for int8
  at::Tensor bias;  // undefined when there is none
  int64_t act_parts;  // quant_linear's choice, as the Python layers make it
  at::Tensor operator()(const at::Tensor& x) const;
};

struct DecodeLayer {
  at::Tensor input_norm, post_norm;  // RMSNorm weights [hidden]
  QLinear qkv, o, gate_up, down;
  at::Tensor q_norm, k_norm;  // Qwen3's per-head RMSNorm weights [head_dim], else undefined
  at::Tensor cos, sin;        // RoPE caches [max_pos, rot_dim] (float32)
  at::Tensor key_cache, value_cache;  // [num_blocks, block_size, Hkv, D]
  int64_t heads, kv_heads, head_dim, sliding_window;  // sliding_window 0: none
  double scale, eps;
};

class DecodePlan {
 public:
  void add_layer(DecodeLayer layer) { layers_.push_back(std::move(layer)); }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // hidden [M, hidden] float32 (the embedding's output, or the previous stage's with
  // `residual`) -> (hidden, residual) after every layer, as LlamaModel's loop returns them.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, std::optional<at::Tensor> residual,
                                         at::Tensor positions, at::Tensor block_table,
                                         at::Tensor seq_lens, at::Tensor slot_mapping) const;

 private:
  std::vector<DecodeLayer> layers_;
};
