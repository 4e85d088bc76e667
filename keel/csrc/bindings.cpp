// Python bindings of keel's CPU kernels (built by keel/cpu_ops.py). torch's pybind11 casters
// for tensors only: the whole of torch/extension.h took ~15 s more to compile.
#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "decode_layers.h"
#include "ops.h"

namespace {

PlanLinear make_linear(std::optional<at::Tensor> q, std::optional<at::Tensor> d,
                       std::optional<at::Tensor> m, int64_t max_rows, int64_t act_parts,
                       std::optional<at::Tensor> packed, std::optional<at::Tensor> weight,
                       std::optional<at::Tensor> bias, pybind11::object w8a8,
                       int64_t gemm_rows, bool float32_compute, std::optional<at::Tensor> amx,
                       int64_t amx_rows, int64_t amx_n, bool amx_silu,
                       std::optional<at::Tensor> amx_bias, std::optional<at::Tensor> fp16,
                       int64_t fp16_n, double fp16_w_max, bool fp16_silu,
                       std::optional<at::Tensor> fp16_bias,
                       std::optional<at::Tensor> fp16_unorder,
                       std::optional<at::Tensor> i16_scales) {
  PlanLinear lin;
  lin.fp16 = fp16.value_or(at::Tensor());
  lin.i16_scales = i16_scales.value_or(at::Tensor());
  TORCH_CHECK(!lin.i16_scales.defined() || lin.fp16.defined(),
              "PlanLinear: i16_scales come with the int16 panels in `fp16`");
  lin.fp16_n = fp16_n;
  lin.fp16_w_max = fp16_w_max;
  lin.fp16_silu = lin.fp16.defined() && fp16_silu;
  lin.fp16_bias = fp16_bias.value_or(at::Tensor());
  lin.fp16_unorder = fp16_unorder.value_or(at::Tensor());
  TORCH_CHECK(!lin.fp16_silu || lin.fp16_unorder.defined(),
              "PlanLinear: an interleaved fp16 weight needs fp16_unorder");
  lin.amx = amx.value_or(at::Tensor());
  lin.amx_rows = lin.amx.defined() ? amx_rows : 0;
  lin.amx_n = amx_n;
  lin.amx_silu = amx_silu;
  lin.amx_bias = amx_bias.value_or(at::Tensor());
  if (!w8a8.is_none()) lin.w8a8 = torch::jit::toIValue(w8a8, c10::AnyType::get());
  if (max_rows > 0) {
    TORCH_CHECK(q.has_value() && d.has_value() &&
                    q->scalar_type() == (m.has_value() ? at::kByte : at::kChar),
                "PlanLinear: int4 weights are uint8 with mins, int8 weights int8 without");
    lin.q = *q;
    lin.d = *d;
    lin.m = m;
  }
  lin.max_rows = max_rows;
  lin.act_parts = act_parts;
  lin.packed = packed.value_or(at::Tensor());
  lin.weight = weight.value_or(at::Tensor());
  lin.bias = bias.value_or(at::Tensor());
  lin.gemm_rows = gemm_rows;
  lin.float32_compute = float32_compute;
  TORCH_CHECK(gemm_rows == 0 || (lin.packed.defined() && lin.packed.dim() == 3),
              "PlanLinear: gemm_rows > 0 needs `packed` from gemm_pack");
  TORCH_CHECK(!lin.w8a8.isNone() || lin.packed.defined() || lin.fp16.defined() ||
                  (lin.weight.defined() && lin.weight.numel() > 0) ||
                  max_rows >= (int64_t{1} << 62),
              "PlanLinear: a layer without a dense weight must take every pass quantized");
  return lin;
}

void add_layer(DecodePlan& plan, at::Tensor input_norm, at::Tensor post_norm, double eps,
               std::vector<PlanLinear> linears, std::optional<at::Tensor> q_norm,
               std::optional<at::Tensor> k_norm, at::Tensor cos, at::Tensor sin,
               at::Tensor kv_cache, int64_t heads, int64_t kv_heads, int64_t head_dim,
               double scale, int64_t sliding_window, std::optional<at::Tensor> kv_scale) {
  TORCH_CHECK(linears.size() == 4, "DecodePlan.add_layer: qkv, o, gate_up, down expected");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "DecodePlan.add_layer: kv_cache must be a contiguous [2, blocks, bs, Hkv, D]");
  plan.add_layer(DecodeLayer{input_norm, post_norm, linears[0], linears[1], linears[2],
                             linears[3], q_norm.value_or(at::Tensor()),
                             k_norm.value_or(at::Tensor()), cos.contiguous(), sin.contiguous(),
                             kv_cache[0], kv_cache[1], heads, kv_heads, head_dim,
                             sliding_window, scale, eps,
                             kv_scale ? (*kv_scale)[0] : at::Tensor(),
                             kv_scale ? (*kv_scale)[1] : at::Tensor()});
}

PassAttention make_pass_attention(at::Tensor token_rows, at::Tensor token_seq_lens,
                                  std::optional<at::Tensor> long_chunks,
                                  std::optional<at::Tensor> short_tokens,
                                  std::optional<at::Tensor> short_rows,
                                  std::optional<at::Tensor> short_seq_lens,
                                  const std::string& long_kernel) {
  TORCH_CHECK(token_rows.scalar_type() == at::kInt && token_seq_lens.scalar_type() == at::kLong,
              "PassAttention: token_rows int32 and token_seq_lens int64 expected");
  PassAttention a;
  a.token_rows = token_rows;
  a.token_seq_lens = token_seq_lens;
  if (long_chunks.has_value()) {
    TORCH_CHECK(long_chunks->dim() == 2 && long_chunks->size(1) == 4 &&
                    long_chunks->scalar_type() == at::kLong,
                "PassAttention: long_chunks int64 [n, 4] (request, start, query len, seq len)");
    a.long_chunks = *long_chunks;
  }
  TORCH_CHECK(short_tokens.has_value() == short_rows.has_value() &&
                  short_rows.has_value() == short_seq_lens.has_value() &&
                  (!short_tokens.has_value() || long_chunks.has_value()),
              "PassAttention: short_tokens, short_rows and short_seq_lens go together, with "
              "long_chunks");
  a.short_tokens = short_tokens.value_or(at::Tensor());
  a.short_rows = short_rows.value_or(at::Tensor());
  a.short_seq_lens = short_seq_lens.value_or(at::Tensor());
  if (long_kernel == "prefill_attention_amx")
    a.kernel = PassAttention::Kernel::kAmx;
  else if (long_kernel == "prefill_attention_i16")
    a.kernel = PassAttention::Kernel::kInt16;
  else
    TORCH_CHECK(long_kernel == "prefill_attention", "PassAttention: long_kernel ",
                long_kernel, " is none of prefill_attention, prefill_attention_amx and "
                "prefill_attention_i16");
  return a;
}

// The instruction sets this build was compiled for (its -march), as the compiler saw them.
std::vector<std::string> built_for() {
  std::vector<std::string> isa;
#ifdef __AVX2__
  isa.emplace_back("avx2");
#endif
#ifdef __FMA__
  isa.emplace_back("fma");
#endif
#ifdef __AVX512F__
  isa.emplace_back("avx512f");
#endif
#ifdef __AVX512BF16__
  isa.emplace_back("avx512_bf16");
#endif
#ifdef __AVX512FP16__
  isa.emplace_back("avx512_fp16");
#endif
#ifdef __AVX512VNNI__
  isa.emplace_back("avx512_vnni");
#endif
#ifdef __AVXVNNI__
  isa.emplace_back("avx_vnni");
#endif
#ifdef __AMX_TILE__
  isa.emplace_back("amx_tile");
#endif
#ifdef __AMX_BF16__
  isa.emplace_back("amx_bf16");
#endif
  return isa;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention, one query token per row",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("rows"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("key_scale") = py::none(), py::arg("value_scale") = py::none());
  m.def("attention_prefetch_into_l2", &attention_prefetch_into_l2,
        "whether decode attention prefetches a 16-bit or int8 cache's next chunk into L2 "
        "(else L1); set= changes it for this process", py::arg("set") = py::none());
  m.def("prefill_attention", &prefill_attention, "causal attention of one long prompt chunk");
  m.def("prefill_attention_amx", &prefill_attention_amx,
        "causal attention of one long bfloat16 prompt chunk on AMX tiles");
  m.def("amx_gemm_pack", &amx_gemm_pack, "a bfloat16 weight [N, K] in amx_gemm's tile layout");
  m.def("amx_gemm_pack_int4", &amx_gemm_pack_int4,
        "amx_gemm's int4 copy of a weight kept as int4 in groups of 32 (empty where it does "
        "not widen to exactly the dense bfloat16 weight)");
  m.def("amx_gemm_pack_int8", &amx_gemm_pack_int8,
        "amx_gemm's int8 copy of a weight given as int8 in groups of 32, W = q d (empty where "
        "it does not widen to exactly the dense bfloat16 weight)");
  m.def("amx_gemm", &amx_gemm,
        "bfloat16 x @ W^T (+ bias) on AMX tiles (or AVX512-BF16's dot products without them)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("silu_mul") = false);
  m.def("amx_gemm_argmax", &amx_gemm_argmax,
        "each row's argmax over columns [0, n_valid) of amx_gemm's output, the output not "
        "written", py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("n_valid"),
        py::arg("bias") = py::none());
  m.def("amx_gemm_f32", &amx_gemm_f32,
        "float32 x @ W^T (+ bias) on AMX tiles, W all bfloat16 values, x in three bfloat16 parts",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("silu_mul") = false);
  m.def("amx_gemm_available", &amx_gemm_available,
        "whether this build and CPU have the AMX tiles (every copy of amx_gemm, amx_gemm_f32)");
  m.def("amx_gemm_dense_available", &amx_gemm_dense_available,
        "whether amx_gemm and amx_gemm_argmax run over amx_gemm_pack's copy here (on AMX "
        "tiles, or without them on AVX512-BF16's dot products)");
  m.def("bf16_dot_gemm_available", &bf16_dot_gemm_available,
        "built with AVX512-BF16 (amx_gemm's dense copy on its dot products)");
  m.def("prefill_attention_amx_available", &prefill_attention_amx_available,
        "whether this build and CPU run prefill_attention_amx");
  m.def("prefill_attention_i16", &prefill_attention_i16,
        "prefill_attention with its two products on AVX512-VNNI's int16 dot products");
  m.def("prefill_attention_i16_available", &prefill_attention_i16_available,
        "built with AVX512-VNNI");
  m.def("write_kv_cache", &write_kv_cache, "this pass's K/V rows into their cache slots",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"), py::arg("key_scale") = py::none(),
        py::arg("value_scale") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("fused_add_rms_norm_", &fused_add_rms_norm_, "residual += x; x = RMSNorm(residual)");
  m.def("rotary_neox_", &rotary_neox_, "rotate-half RoPE of q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :n]) * x[:, n:]");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of a float32 [rows, n]");
  m.def("int4_gemm", &int4_gemm, "x @ W^T for int4 W (groups of 32), at most 4 rows");
  m.def("int8_gemm", &int8_gemm, "x @ W^T for int8 W (one scale per row), at most 4 rows");
  m.def("int4_gemm_q8", &int4_gemm_q8, "int4_gemm with activations in int8 parts (groups of 32)");
  m.def("int8_gemm_q8", &int8_gemm_q8, "int8_gemm with activations in int8 parts (groups of 32)");
  m.def("quant_linear", &quant_linear, "x @ W^T for keel's int4 / int8 weights, <= 4 rows");
  m.def("quant_gemm_available", &quant_gemm_available, "built with AVX2 + FMA");
  m.def("gemm_pack", &gemm_pack, "W [N, K] (float32 / bfloat16) in gemm's panels");
  m.def("gemm", &gemm, "x @ W^T (+ bias) in float32 over gemm_pack's panels",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"),
        pybind11::arg("bias") = pybind11::none());
  m.def("gemm_silu", &gemm_silu,
        "silu(gate) * up of gemm over a merged [gate; up] weight, in the GEMM's epilogue",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"),
        pybind11::arg("bias") = pybind11::none());
  m.def("gemm_available", &gemm_available, "gemm built (AVX2 + FMA)");
  m.def("built_for", &built_for, "the instruction sets this build was compiled for");
  m.def("fp16_gemm_pack", &fp16_gemm_pack,
        "W [N, K] (float32 / bfloat16) in fp16_gemm's float16 panels, and its largest |W|");
  m.def("fp16_gemm", &fp16_gemm,
        "x @ W^T (+ bias) on float16 FMAs, float32 in and out (silu_mul: W's rows a [gate; up] "
        "layer's interleaved by 16, the result silu(gate) * up [M, N / 2])",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("w_max"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("silu_mul") = false);
  m.def("fp16_gemm_available", &fp16_gemm_available, "built with AVX512-FP16");
  m.def("i16_gemm_pack", &i16_gemm_pack,
        "W [N, K] (float32 / bfloat16) in i16_gemm's int16 panels, and their per-block scales");
  m.def("i16_gemm", &i16_gemm,
        "x @ W^T (+ bias) on int16 dot products, float32 in and out (silu_mul as fp16_gemm's)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales"), pybind11::arg("n"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("silu_mul") = false);
  m.def("i16_gemm_argmax", &i16_gemm_argmax,
        "each row's argmax over columns [0, n_valid) of i16_gemm's output, the output not "
        "written", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales"),
        pybind11::arg("n"), pybind11::arg("n_valid"), pybind11::arg("bias") = pybind11::none());
  m.def("i16_gemm_available", &i16_gemm_available, "built with AVX512-VNNI");
  m.def("greedy_head_pack", &greedy_head_pack,
        "W [N, K] (float32 / bfloat16, K a multiple of 32) as greedy_head's int8 panels, their "
        "per-block scales, and the columns' norms for the bound");
  m.def("greedy_head", &greedy_head,
        "each row's argmax over columns [0, n_valid) of x @ W^T (float32, or bfloat16-rounded), "
        "screened on int8 dot products and computed exactly where the bound cannot rule a "
        "column out; (token ids, columns computed exactly per row, -1: all)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales"),
        pybind11::arg("norms"), pybind11::arg("weight"), pybind11::arg("n_valid"),
        pybind11::arg("round_bf16") = false, pybind11::arg("cap") = 256);
  m.def("greedy_head_available", &greedy_head_available, "built with AVX512-VNNI");
  m.def("gemm_prefetch_nta", &gemm_prefetch_nta,
        "whether i16_gemm's and bf16_dot_gemm's decode passes prefetch the next weights "
        "non-temporally (else into L2); set= changes it for this process", py::arg("set") = py::none());
  // The classes are module-local, so that two builds of these kernels (each its own module
  // name) load side by side in one process: benchmarks/kernel_ab.py times one against the
  // other there, alternating, where separate processes met different phases of a shared host.
  pybind11::class_<PlanLinear>(m, "PlanLinear", "one linear layer of a DecodePlan",
                               pybind11::module_local())
      .def(pybind11::init(&make_linear), pybind11::arg("q"), pybind11::arg("d"),
           pybind11::arg("m"), pybind11::arg("max_rows"), pybind11::arg("act_parts"),
           pybind11::arg("packed"), pybind11::arg("weight"), pybind11::arg("bias"),
           pybind11::arg("w8a8") = pybind11::none(), pybind11::arg("gemm_rows") = 0,
           pybind11::arg("float32_compute") = false, pybind11::arg("amx") = pybind11::none(),
           pybind11::arg("amx_rows") = 0, pybind11::arg("amx_n") = 0,
           pybind11::arg("amx_silu") = false, pybind11::arg("amx_bias") = pybind11::none(),
           pybind11::arg("fp16") = pybind11::none(), pybind11::arg("fp16_n") = 0,
           pybind11::arg("fp16_w_max") = 0.0,
           pybind11::arg("fp16_silu") = false, pybind11::arg("fp16_bias") = pybind11::none(),
           pybind11::arg("fp16_unorder") = pybind11::none(),
           pybind11::arg("i16_scales") = pybind11::none(),
           "(q, d, m, max_rows, act_parts, packed, weight, bias, w8a8=None, gemm_rows=0, "
           "float32_compute=False, amx=None, amx_rows=0, amx_n=0, amx_silu=False, "
           "amx_bias=None, fp16=None, fp16_n=0, fp16_w_max=0, fp16_silu=False, fp16_bias=None, "
           "fp16_unorder=None, i16_scales=None (then `fp16` holds i16_gemm's panels)): the "
           "quantized form (used "
           "up to max_rows rows; 0: none), "
           "the packed weight (oneDNN's, or keel's gemm_pack panels of a weight with gemm_rows "
           "output rows; a bfloat16 pass over it computed in float32 where float32_compute or "
           "gemm_rows) and the dense weight, or fbgemm's packed w8a8 weight; bfloat16 passes "
           "of up to amx_rows rows on amx_gemm over `amx` (amx_gemm_pack of an [amx_n, K] "
           "weight; amx_silu: a [gate; up] weight interleaved by 16 rows, with amx_bias, "
           "which only silu_mul takes); passes above max_rows on fp16_gemm over `fp16` "
           "(fp16_gemm_pack's of an [fp16_n, K] weight, largest |W| fp16_w_max; fp16_silu: "
           "rows interleaved by 16 as amx_silu's, with fp16_bias, and a plain pass's columns "
           "put back by fp16_unorder)");
  pybind11::class_<PassAttention>(m, "PassAttention",
                                  "the attention of a pass with prompt tokens (decode_layers.h)",
                                  pybind11::module_local())
      .def(pybind11::init(&make_pass_attention), pybind11::arg("token_rows"),
           pybind11::arg("token_seq_lens"), pybind11::arg("long_chunks") = pybind11::none(),
           pybind11::arg("short_tokens") = pybind11::none(),
           pybind11::arg("short_rows") = pybind11::none(),
           pybind11::arg("short_seq_lens") = pybind11::none(),
           pybind11::arg("long_kernel") = "prefill_attention",
           "(token_rows, token_seq_lens, long_chunks=None, short_tokens=None, "
           "short_rows=None, short_seq_lens=None, long_kernel=\"prefill_attention\")");
  pybind11::class_<DecodePlan>(m, "DecodePlan", "decoder layers of a pass in one call",
                               pybind11::module_local())
      .def(pybind11::init<>())
      .def("add_layer", &add_layer, "one Llama-family decoder layer's weights and cache")
      .def_property_readonly("num_layers", &DecodePlan::num_layers)
      .def("run", &DecodePlan::run, pybind11::arg("hidden"), pybind11::arg("residual"),
           pybind11::arg("positions"), pybind11::arg("block_table"), pybind11::arg("seq_lens"),
           pybind11::arg("slot_mapping"), pybind11::arg("attention") = pybind11::none(),
           pybind11::arg("output_rows") = pybind11::none(),
           "(hidden, residual) after every layer (only output_rows' where given)");
}
