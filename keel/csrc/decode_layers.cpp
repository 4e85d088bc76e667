// The fused pass (see decode_layers.h): LlamaDecoderLayer.forward, layer after layer,
// with the Python layers' kernels and arguments.
#include "decode_layers.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/linear.h>

#include <limits>
#include <string_view>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kKernelRows = 4;  // rows per call of keel's quantized kernels

// n values from src into dst, 16 at a time (vec.h widens and rounds as c10 does).
template <typename From, typename To>
void convert_values(const From* src, To* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) keel::store16(dst + i, keel::load16(src + i));
  for (; i < n; ++i) dst[i] = static_cast<To>(static_cast<float>(src[i]));
}

// c (contiguous, elements of type From) in dtype `to` (elements of type To).
template <typename From, typename To>
at::Tensor converted_as(const at::Tensor& c, at::ScalarType to) {
  at::Tensor out = at::empty(c.sizes(), c.options().dtype(to));
  convert_values(c.data_ptr<From>(), out.data_ptr<To>(), c.numel());
  return out;
}

// x as float32 or bfloat16 (the other of the two), by keel's own loop: the bits of
// Tensor::to (vec.h rounds as c10::BFloat16 does), through one allocation instead of to's four
// dispatched ops. A one-row bfloat16 pass over quantized layers converts 8 times a layer, and
// through Tensor::to that cost the default .gguf ~5% of its single-stream decode against
// float32 (BENCHMARKS.md, fortieth round). Other dtypes go through Tensor::to.
at::Tensor converted(const at::Tensor& x, at::ScalarType to) {
  const at::ScalarType from = x.scalar_type();
  if (from == to) return x;
  const at::Tensor c = x.contiguous();
  if (from == at::kBFloat16 && to == at::kFloat) return converted_as<c10::BFloat16, float>(c, to);
  if (from == at::kFloat && to == at::kBFloat16) return converted_as<float, c10::BFloat16>(c, to);
  return c.to(to);
}

// torch.ops.mkldnn._linear_pointwise, as keel's packed_linear calls it (layers/gemm_choice.py).
at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& packed,
                            const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, std::string_view,
                            c10::List<std::optional<c10::Scalar>>,
                            std::optional<std::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(),
                 std::string_view(""));
}

// torch.ops.quantized.linear_dynamic(x, packed, reduce_range=True), boxed: the packed weight
// is a script object, passed through as the IValue Python gave.
at::Tensor linear_dynamic(const at::Tensor& x, const c10::IValue& packed) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
  std::vector<c10::IValue> stack{x, packed, true};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// torch_paged.paged_attention for a pass with prompt tokens (see PassAttention), [rows, H * D].
// block_ids: each long chunk's KV blocks (int64, as many as its seq length covers), undefined
// for a whole prompt (its keys are the pass's own): chunk_blocks, once for every layer.
at::Tensor pass_attention(const DecodeLayer& L, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& block_table,
                          const PassAttention& A, const std::vector<at::Tensor>& block_ids,
                          const std::optional<at::Tensor>& ks,
                          const std::optional<at::Tensor>& vs) {
  const int64_t rows = q.size(0), D = L.head_dim;
  const at::Tensor q3 = q.view({rows, L.heads, D});
  if (!A.long_chunks.defined())  // one row per query token, K/V read in place
    return paged_attention(q3, L.key_cache, L.value_cache, block_table, A.token_seq_lens,
                           A.token_rows, L.scale, L.sliding_window, ks, vs)
        .view({rows, L.heads * D});
  at::Tensor out = at::empty({rows, L.heads * D}, q.options());
  if (A.short_tokens.defined()) {
    const at::Tensor r = paged_attention(q3.index_select(0, A.short_tokens), L.key_cache,
                                         L.value_cache, block_table, A.short_seq_lens,
                                         A.short_rows, L.scale, L.sliding_window, ks, vs);
    out.index_copy_(0, A.short_tokens, r.view({A.short_tokens.size(0), -1}));
  }
  const at::Tensor k3 = k.view({rows, L.kv_heads, D}), v3 = v.view({rows, L.kv_heads, D});
  const at::Tensor chunks = A.long_chunks.contiguous();
  const int64_t* c = chunks.data_ptr<int64_t>();
  for (int64_t i = 0; i < chunks.size(0); ++i) {
    const int64_t start = c[4 * i + 1], q_len = c[4 * i + 2], seq_len = c[4 * i + 3];
    at::Tensor key, value;
    if (!block_ids[i].defined()) {  // a whole prompt: its keys are this pass's own
      key = k3.narrow(0, start, q_len);
      value = v3.narrow(0, start, q_len);
    } else {  // its blocks gathered, [blocks, Hkv, bs, D] -> [blocks * bs, Hkv, D], in the
              // query's dtype (torch_paged.cache_rows: a bfloat16 cache under float32)
      const at::Tensor& blocks = block_ids[i];
      auto gather = [&](const at::Tensor& cache) {
        return cache.index_select(0, blocks).to(q.scalar_type()).transpose(1, 2)
            .reshape({-1, L.kv_heads, D}).narrow(0, 0, seq_len);
      };
      key = gather(L.key_cache);
      value = gather(L.value_cache);
    }
    at::Tensor o = out.narrow(0, start, q_len);
    const at::Tensor q = q3.narrow(0, start, q_len);
    switch (A.kernel) {
      case PassAttention::Kernel::kAmx:
        prefill_attention_amx(q, key, value, o, L.scale, L.sliding_window);
        break;
      case PassAttention::Kernel::kInt16:
        prefill_attention_i16(q, key, value, o, L.scale, L.sliding_window);
        break;
      default:
        prefill_attention(q, key, value, o, L.scale, L.sliding_window);
    }
  }
  return out;
}

// pass_attention's block_ids, once a pass: each long chunk's blocks of block_table (int32)
// as int64 where the chunk has keys before it, else undefined.
std::vector<at::Tensor> chunk_blocks(const PassAttention& A, const at::Tensor& block_table,
                                     int64_t block_size) {
  std::vector<at::Tensor> out;
  if (!A.long_chunks.defined()) return out;
  const at::Tensor chunks = A.long_chunks.contiguous();
  const int64_t* c = chunks.data_ptr<int64_t>();
  for (int64_t i = 0; i < chunks.size(0); ++i) {
    const int64_t req = c[4 * i], q_len = c[4 * i + 2], seq_len = c[4 * i + 3];
    out.push_back(seq_len == q_len ? at::Tensor()
                                   : block_table[req]
                                         .narrow(0, 0, (seq_len + block_size - 1) / block_size)
                                         .to(at::kLong));
  }
  return out;
}

}  // namespace

at::Tensor PlanLinear::operator()(const at::Tensor& x) const {
  if (!w8a8.isNone()) {  // layers/quantization.py w8a8_linear: one scale per token
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor s =
        at::linalg_vector_norm(xf, std::numeric_limits<double>::infinity(), {-1}, true)
            .clamp_(1e-30);
    at::Tensor out = linear_dynamic(xf.div(s), w8a8).mul_(s).to(x.scalar_type());
    return bias.defined() ? out.add(bias) : out;
  }
  const int64_t rows = x.size(0);
  if (max_rows > 0 && rows <= max_rows) {  // quantized_linear: 4 rows a call, then bias
    // keel's kernels take and give float32; a bfloat16 pass is converted in and out.
    const at::Tensor xf = converted(x, at::kFloat);
    at::Tensor out;
    if (rows <= kKernelRows) {
      out = quant_linear(xf, q, d, m, act_parts);
    } else {
      std::vector<at::Tensor> parts;
      for (int64_t i = 0; i < rows; i += kKernelRows)
        parts.push_back(quant_linear(xf.narrow(0, i, std::min(kKernelRows, rows - i)), q, d,
                                     m, act_parts));
      out = at::cat(parts);
    }
    out = converted(out, x.scalar_type());
    return bias.defined() ? out.add_(bias) : out;
  }
  if (fp16.defined()) {  // fp16_gemm or i16_gemm, in float32 (packed_weights.py cpu_gemm)
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor& b = fp16_silu ? fp16_bias : bias;
    at::Tensor out = low_gemm(xf, b, false);
    if (fp16_silu) out = out.index_select(1, fp16_unorder);  // back in [gate; up] order
    return out.to(x.scalar_type());
  }
  if (amx_rows > 0 && !amx_silu && rows <= amx_rows && x.scalar_type() == at::kBFloat16)
    return amx_gemm(x, amx, amx_n, bias.defined() ? std::optional<at::Tensor>(bias)
                                                  : std::nullopt);
  // A float32 layer of bfloat16 values: its float32 passes on the tiles (amx_gemm_f32).
  if (amx_rows > 0 && !amx_silu && rows <= amx_rows && x.scalar_type() == at::kFloat)
    return amx_gemm_f32(x, amx, amx_n,
                        bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, false);
  // A bfloat16 pass over keel's panels or oneDNN's upcast: in float32, rounded back once.
  const bool upcast = (gemm_rows > 0 || float32_compute) && x.scalar_type() != at::kFloat;
  const at::Tensor xin = upcast ? x.to(at::kFloat) : x;
  const std::optional<at::Tensor> b =
      bias.defined() ? std::optional<at::Tensor>(upcast ? bias.to(at::kFloat) : bias)
                     : std::nullopt;
  const at::Tensor out = gemm_rows > 0      ? gemm(xin, packed, gemm_rows, b)
                         : packed.defined() ? linear_pointwise(xin, packed, b)
                                            : at::linear(xin, weight, b);
  return upcast ? out.to(x.scalar_type()) : out;
}

at::Tensor PlanLinear::low_gemm(const at::Tensor& x, const at::Tensor& b, bool silu) const {
  const std::optional<at::Tensor> bias_opt =
      b.defined() ? std::optional<at::Tensor>(b) : std::nullopt;
  return i16_scales.defined() ? i16_gemm(x, fp16, i16_scales, fp16_n, bias_opt, silu)
                              : fp16_gemm(x, fp16, fp16_n, fp16_w_max, bias_opt, silu);
}

at::Tensor PlanLinear::silu_mul(const at::Tensor& x) const {
  // The AMX GEMM with silu in its epilogue, as the Python layer's gemm_silu takes it.
  if (amx_silu && amx_rows > 0 && x.size(0) <= amx_rows && x.scalar_type() == at::kBFloat16 &&
      !(max_rows > 0 && x.size(0) <= max_rows))
    return amx_gemm(x, amx, amx_n,
                    amx_bias.defined() ? std::optional<at::Tensor>(amx_bias) : std::nullopt,
                    true);
  if (amx_silu && amx_rows > 0 && x.size(0) <= amx_rows && x.scalar_type() == at::kFloat &&
      !(max_rows > 0 && x.size(0) <= max_rows))
    return amx_gemm_f32(x, amx, amx_n,
                        amx_bias.defined() ? std::optional<at::Tensor>(amx_bias) : std::nullopt,
                        true);
  // fp16_gemm or i16_gemm with silu in its epilogue, as the Python layer's gemm_silu takes it.
  if (fp16_silu && x.scalar_type() == at::kFloat && !(max_rows > 0 && x.size(0) <= max_rows))
    return low_gemm(x, fp16_bias, true);
  // keel's panels in float32, as the Python layer's gemm_silu (layers/linear.py) chooses it.
  if (w8a8.isNone() && !(max_rows > 0 && x.size(0) <= max_rows) && gemm_rows > 0 &&
      gemm_rows % 32 == 0 && x.scalar_type() == at::kFloat)
    return gemm_silu(x, packed, gemm_rows,
                     bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  return silu_and_mul((*this)(x));
}

std::tuple<at::Tensor, at::Tensor> DecodePlan::run(at::Tensor hidden,
                                                   std::optional<at::Tensor> residual_in,
                                                   at::Tensor positions,
                                                   at::Tensor block_table, at::Tensor seq_lens,
                                                   at::Tensor slot_mapping,
                                                   const std::optional<PassAttention>& attention,
                                                   const std::optional<at::Tensor>& output_rows) const {
  TORCH_CHECK(hidden.dim() == 2 && (hidden.scalar_type() == at::kFloat ||
                                    hidden.scalar_type() == at::kBFloat16),
              "DecodePlan.run: hidden must be float32 or bfloat16 [M, hidden]");
  const int64_t rows = hidden.size(0);
  // Converted once for all layers (paged_attention would convert them in every layer).
  block_table = block_table.to(at::kInt).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  positions = positions.to(at::kLong).contiguous();
  // A long chunk's blocks (pass_attention), once for all layers.
  const std::vector<at::Tensor> blocks =
      attention.has_value() && !layers_.empty()
          ? chunk_blocks(*attention, block_table, layers_.front().key_cache.size(2))
          : std::vector<at::Tensor>();
  at::Tensor x = hidden.contiguous();
  at::Tensor residual;
  bool first = !residual_in.has_value();
  if (!first) residual = residual_in->contiguous();
  for (const DecodeLayer& L : layers_) {
    // input_layernorm: the first layer keeps the embedding as the residual.
    if (first) {
      residual = x;
      x = rms_norm(x, L.input_norm, L.eps);
      first = false;
    } else {
      fused_add_rms_norm_(x, residual, L.input_norm, L.eps);
    }
    // self_attn: views of one [M, q + 2 kv] output, rotated in place.
    const int64_t q_size = L.heads * L.head_dim, kv_size = L.kv_heads * L.head_dim;
    at::Tensor qkv = L.qkv(x);
    at::Tensor q = qkv.narrow(1, 0, q_size);
    at::Tensor k = qkv.narrow(1, q_size, kv_size);
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    if (L.q_norm.defined()) {  // Qwen3: RMSNorm over each head before RoPE
      q = rms_norm(q.reshape({rows * L.heads, L.head_dim}), L.q_norm, L.eps)
              .view({rows, q_size});
      k = rms_norm(k.reshape({rows * L.kv_heads, L.head_dim}), L.k_norm, L.eps)
              .view({rows, kv_size});
    }
    rotary_neox_(positions, q, k, L.cos, L.sin, L.head_dim);
    std::optional<at::Tensor> ks, vs;  // an int8 cache's scales
    if (L.key_scale.defined()) ks = L.key_scale, vs = L.value_scale;
    write_kv_cache(k.view({rows, L.kv_heads, L.head_dim}),
                   v.view({rows, L.kv_heads, L.head_dim}), L.key_cache, L.value_cache,
                   slot_mapping, ks, vs);
    at::Tensor attn =
        attention.has_value()
            ? pass_attention(L, q, k, v, block_table, *attention, blocks, ks, vs)
            : paged_attention(q.view({rows, L.heads, L.head_dim}), L.key_cache, L.value_cache,
                              block_table, seq_lens, std::nullopt, L.scale, L.sliding_window,
                              ks, vs)
                  .view({rows, q_size});
    if (output_rows.has_value() && &L == &layers_.back()) {  // the rows anyone reads
      attn = attn.index_select(0, *output_rows);
      residual = residual.index_select(0, *output_rows);
    }
    x = L.o(attn);
    // post_attention_layernorm (residual += x; x = norm(residual)), then the MLP.
    fused_add_rms_norm_(x, residual, L.post_norm, L.eps);
    x = L.down(L.gate_up.silu_mul(x));
  }
  return {x, residual};
}
