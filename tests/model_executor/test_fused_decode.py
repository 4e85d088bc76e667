"""The fused pass (keel/csrc/decode_layers.cpp, layers/fused_decode.py): all decoder layers of
a decode pass, or of a pass with prompt tokens, in one C++ call. It runs the Python layers' kernels with their
arguments, so the engine's output must be bit-identical with it on and off
(KEEL_FUSED_DECODE=0): the same tokens and the same log-probabilities, for every
Llama-family variant (GQA and llama3 RoPE, Qwen2's qkv bias, Qwen3's q/k norm, Mistral's
sliding window), for dense float32 and bfloat16, int8, int4 and w8a8 weights (int8 and int4
in bfloat16 too; bfloat16 layers on keel's AMX GEMM where the CPU has it); with quantized
weights, passes of 6 rows take the dense weights and passes of 3 the quantized kernels."""

from __future__ import annotations

import pytest
import torch

from keel import LLM, SamplingParams
from keel.model_executor import rows_per_pass
from keel.model_executor.layers import amx_choice
from keel.model_executor.layers import fused_decode as fused_mod
from keel.model_executor.layers.quantization import _keel_ops
from tests.hf_models import make_hf_model

pytestmark = pytest.mark.skipif(_keel_ops() is None,
                                reason="needs keel's quantized kernels (AVX2 + FMA CPU)")

def rows_up_to_4(model):
    for m in model.modules():
        if getattr(m, "quant", None) is not None:
            m.quant.max_rows = 4


PROMPTS = [[5, 17, 33, 9, 41, 2, 77, 100, 3, 8] * 3, [60, 61, 62], [1, 2, 3, 4, 5, 6, 7],
           [9, 8, 7], [100, 200, 300, 10, 20], [42] * 20]
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
SHORT = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)


def generate(folder: str, quantization: str | None, fused: bool, monkeypatch, prompts=PROMPTS,
             dtype: str = "float32", kv_cache_dtype: str = "auto", **engine_kwargs):
    """(token ids, per-token logprobs, passes: fused, Python, and fused with long chunks)."""
    monkeypatch.setenv("KEEL_FUSED_DECODE", "1" if fused else "0")
    calls = {"fused": 0, "python": 0, "long": 0}
    # The unwrapped call (a test that generates twice must not count through the first wrapper).
    real = getattr(fused_mod.FusedDecode.__call__, "real", fused_mod.FusedDecode.__call__)

    def counting(self, model, positions, hidden, residual, rows=None):
        out = real(self, model, positions, hidden, residual, rows)
        calls["fused" if out is not None else "python"] += 1
        meta = fused_mod.get_forward_context().attn_metadata
        calls["long"] += out is not None and meta.long_chunks is not None
        return out

    counting.real = real
    monkeypatch.setattr(fused_mod.FusedDecode, "__call__", counting)
    # The kernel for passes of up to 4 rows, the dense GEMM above: fixed here, where the
    # engine measures it per layer shape (too close to call on these tiny layers).
    monkeypatch.setattr(rows_per_pass, "choose_rows_per_pass", rows_up_to_4)
    llm = LLM(folder, quantization=quantization, kv_cache_memory_gib=0.0625, dtype=dtype,
              kv_cache_dtype=kv_cache_dtype, **engine_kwargs)
    sps = [LONG if i < 3 else SHORT for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs]
    del llm
    return tokens, logprobs, calls


@pytest.mark.parametrize("arch,quantization,dtype", [
    ("llama", None, "float32"), ("qwen2", None, "float32"), ("qwen3", None, "float32"),
    ("mistral", None, "float32"), ("llama", "int8", "float32"), ("qwen2", "int8", "float32"),
    ("qwen3", "int8", "float32"), ("mistral", "int8", "float32"), ("qwen3", "int4", "float32"),
    ("mistral", "int4", "float32"), ("qwen2", "w8a8", "float32"), ("llama", "w8a8", "float32"),
    ("llama", None, "bfloat16"), ("qwen2", None, "bfloat16"), ("qwen3", None, "bfloat16"),
    ("qwen3", "int8", "bfloat16"), ("mistral", "int4", "bfloat16"),
])
def test_fused_decode_is_bit_identical(arch, quantization, dtype, hf_model_dir, monkeypatch):
    folder = hf_model_dir(arch)
    tok_on, lp_on, on = generate(folder, quantization, True, monkeypatch, dtype=dtype)
    tok_off, lp_off, off = generate(folder, quantization, False, monkeypatch, dtype=dtype)
    assert on["fused"] >= 39, on  # every decode pass (6 rows, then 3)
    assert off["fused"] == 0
    assert tok_on == tok_off
    assert lp_on == lp_off  # bit-identical, not merely close


@pytest.mark.parametrize("arch,quantization", [("llama", None), ("qwen3", None),
                                               ("mistral", None), ("mistral", "int4")])
def test_fused_decode_over_a_bfloat16_cache_is_bit_identical(arch, quantization, hf_model_dir,
                                                            monkeypatch):
    """float32 arithmetic over a bfloat16 KV cache (kv_cache_dtype="bfloat16", what
    dtype="auto" keeps on a CPU without AMX, for the default .gguf's int4 blocks too): the
    fused pass writes and reads the cache as the Python layers do."""
    folder = hf_model_dir(arch)
    kw = {"kv_cache_dtype": "bfloat16"}
    tok_on, lp_on, on = generate(folder, quantization, True, monkeypatch, **kw)
    tok_off, lp_off, off = generate(folder, quantization, False, monkeypatch, **kw)
    assert on["fused"] >= 39 and off["fused"] == 0
    assert tok_on == tok_off
    assert lp_on == lp_off
    # ... and the bfloat16 cache is not the float32 one: the log-probabilities moved.
    _, lp_f32, _ = generate(folder, quantization, True, monkeypatch, kv_cache_dtype="float32")
    assert lp_f32 != lp_on


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_over_an_int8_cache_is_bit_identical(dtype, hf_model_dir, monkeypatch):
    """kv_cache_dtype="int8": the fused pass quantizes this pass's K/V into the cache and reads
    them back with their scales as the Python layers do."""
    folder = hf_model_dir("qwen3")
    tok_on, lp_on, on = generate(folder, None, True, monkeypatch, dtype=dtype,
                                 kv_cache_dtype="int8")
    tok_off, lp_off, off = generate(folder, None, False, monkeypatch, dtype=dtype,
                                    kv_cache_dtype="int8")
    assert on["fused"] >= 39 and off["fused"] == 0
    assert tok_on == tok_off
    assert lp_on == lp_off


# Two prompts longer than CPU_KERNEL_MAX_QUERY_LEN (their chunks go to the prefill kernel),
# cut into chunks with context by a budget of 96 tokens a step, beside short prompts and
# decode rows.
MIXED = [[(11 * j + 5) % 200 + 1 for j in range(150)], [(7 * j + 3) % 180 + 2 for j in range(130)],
         [60, 61, 62], [1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 2]


def forced_long_kernel(ops, dtype, num_heads, num_kv_heads, head_dim):
    """keel's kernels for long chunks (the engine times them against SDPA, which may win on
    these tiny models): the AMX one where it applies."""
    if (dtype == torch.bfloat16 and head_dim % 32 == 0
            and ops.prefill_attention_amx_available()):
        return "prefill_attention_amx"
    return "prefill_attention"


@pytest.mark.parametrize("arch,dtype,kv_cache_dtype", [
    ("llama", "float32", "auto"), ("llama", "bfloat16", "auto"), ("qwen2", "bfloat16", "auto"),
    ("qwen3", "float32", "auto"), ("mistral", "float32", "auto"),
    ("llama", "float32", "bfloat16"),
])
def test_prompt_passes_are_fused_and_bit_identical(arch, dtype, kv_cache_dtype, hf_model_dir,
                                                   monkeypatch):
    """Passes with prompt tokens take the plan too (PassAttention: prompt tokens as rows of
    their own, long chunks on the prefill kernel over their gathered blocks, the last layer
    only for the sampled rows), bit-identical to the Python layers: GQA, Qwen2's bias,
    Qwen3's q/k norm, Mistral's sliding window, and a bfloat16 cache under float32."""
    from keel.attention.backends import chunk_kernels

    monkeypatch.setattr(chunk_kernels, "long_chunk_kernel", forced_long_kernel)
    folder = hf_model_dir(arch)
    kw = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=96)
    tok_on, lp_on, on = generate(folder, None, True, monkeypatch, MIXED, **kw)
    tok_off, lp_off, off = generate(folder, None, False, monkeypatch, MIXED, **kw)
    assert on["python"] == 0 and on["long"] >= 2, on  # every pass, long chunks included
    assert off["fused"] == 0
    assert tok_on == tok_off
    assert lp_on == lp_off


def test_auto_on_int16_products_is_fused_and_bit_identical(hf_model_dir, monkeypatch):
    """dtype="auto" on a CPU without AMX, its GEMMs on i16_gemm or fp16_gemm (chosen here
    without timing): every attention layer runs its long prompt chunks on
    prefill_attention_i16 where the build has AVX512-VNNI (else on the float32 kernel), in the
    fused pass and the Python layers alike, with the same tokens and log-probabilities."""
    from keel import dtypes
    from keel.cpu_ops import get_cpu_ops
    from keel.model_executor.layers import gemm_choice

    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    monkeypatch.setattr(gemm_choice, "_fp16_gemm_faster", True)
    monkeypatch.delenv("KEEL_I16_ATTENTION", raising=False)
    ops = get_cpu_ops()
    int16 = gemm_choice.low_precision_kind() is not None and ops.prefill_attention_i16_available()
    chosen, kernels = [], []
    real_chosen = gemm_choice.int16_attention_chosen
    real_kernel = fused_mod.FusedDecode._choose_long_kernel
    monkeypatch.setattr(gemm_choice, "int16_attention_chosen",
                        lambda: chosen.append(real_chosen()) or chosen[-1])
    monkeypatch.setattr(fused_mod.FusedDecode, "_choose_long_kernel",
                        lambda self: kernels.append(real_kernel(self)) or kernels[-1])
    folder = hf_model_dir("llama")
    kw = dict(dtype="auto", max_num_batched_tokens=96)
    tok_on, lp_on, on = generate(folder, None, True, monkeypatch, MIXED, **kw)
    tok_off, lp_off, off = generate(folder, None, False, monkeypatch, MIXED, **kw)
    assert on["python"] == 0 and on["long"] >= 2, on
    assert off["fused"] == 0
    assert chosen and set(chosen) == {int16}, chosen  # every layer, both engines
    assert kernels == ["prefill_attention_i16" if int16 else "prefill_attention"]
    assert tok_on == tok_off
    assert lp_on == lp_off


def test_not_taken_where_it_does_not_apply(hf_model_dir, monkeypatch):
    """Passes with long chunks over an int8 cache (whose gathered rows the Python layers
    dequantize) or where SDPA runs the long chunks take the Python layers; the other passes
    stay fused."""
    from keel.attention.backends import chunk_kernels

    folder = hf_model_dir("qwen3")
    _, _, calls = generate(folder, None, True, monkeypatch, MIXED, kv_cache_dtype="int8",
                           max_num_batched_tokens=96)
    assert calls["python"] >= 2 and calls["long"] == 0 and calls["fused"] >= 39, calls
    monkeypatch.setattr(chunk_kernels, "long_chunk_kernel", lambda *a: None)  # SDPA
    _, _, calls = generate(folder, None, True, monkeypatch, MIXED, max_num_batched_tokens=96)
    assert calls["python"] >= 2 and calls["long"] == 0 and calls["fused"] >= 39, calls


def test_plan_follows_a_rebound_kv_cache(hf_model_dir, monkeypatch):
    """A model whose KV cache is bound again (a new runner) gets a new plan over the new
    cache, and matches the Python layers on it."""
    from keel.config import ModelConfig
    from keel.model_executor.direct import DirectRunner
    from keel.model_executor.loader import load_model

    monkeypatch.setattr(rows_per_pass, "choose_rows_per_pass", rows_up_to_4)
    model = load_model(ModelConfig(hf_model_dir("qwen3"), quantization="int8",
                                   dtype="float32"))
    prompts = [[3, 4, 5, 6], [9, 10]]
    first = DirectRunner(model, max_reqs=2, max_len=64).greedy(prompts, 12)
    plan = model.model.fused_decode.plan
    assert plan
    second = DirectRunner(model, max_reqs=2, max_len=64).greedy(prompts, 12)
    assert model.model.fused_decode.plan is not plan
    model.model.fused_decode.plan = False  # the Python layers from here on
    python = DirectRunner(model, max_reqs=2, max_len=64).greedy(prompts, 12)
    assert first == second == python
    assert torch.is_tensor(model.model.layers[0].self_attn.attn.kv_cache)


@pytest.mark.parametrize("silu_on_amx,plain_on_amx", [(False, False), (True, True),
                                                       (True, False)])
def test_bit_identical_past_64_rows(silu_on_amx, plain_on_amx, tmp_path, monkeypatch):
    """Decode passes of more than 64 rows (70 requests) in bfloat16: the fused pass takes the
    GEMM that the Python layers take for that many rows (keel's AMX GEMM where it is chosen
    for prompt-sized passes of the layer's kind, [gate; up] with SiLU or plain, else oneDNN),
    so the output stays bit-identical."""
    from keel.cpu_ops import get_cpu_ops
    from keel.model_executor.layers import gemm_choice

    ops = get_cpu_ops()
    if ops is not None and ops.amx_gemm_dense_available():
        monkeypatch.setattr(gemm_choice, "_keel_ops", ops)
        monkeypatch.setattr(amx_choice, "_amx_gemm_faster", True)
    monkeypatch.setattr(amx_choice, "_amx_prompt_faster", silu_on_amx)
    monkeypatch.setattr(amx_choice, "_amx_long_faster", silu_on_amx)
    monkeypatch.setattr(amx_choice, "_amx_plain_prompt_faster", plain_on_amx)
    monkeypatch.setattr(amx_choice, "_amx_plain_long_faster", plain_on_amx)
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(4 + i % 9)] for i in range(70)]
    # (an intermediate size whose [gate; up] can be interleaved by 16 for the SiLU epilogue)
    folder = str(make_hf_model("llama", tmp_path, intermediate_size=192))
    # The rows each planned layer gives the AMX GEMM (on these tiny layers the two GEMMs may
    # well sum alike, so the bits alone would not tell which ran).
    amx_rows = []
    real_plan = fused_mod._plan_linear

    class Recording:  # keel's ops, PlanLinear's amx_rows noted
        def __init__(self, ops_):
            self.ops = ops_

        def __getattr__(self, name):
            return getattr(self.ops, name)

        def PlanLinear(self, *args, **kwargs):
            if kwargs.get("amx") is not None:
                amx_rows.append((kwargs["amx_silu"], kwargs["amx_rows"]))
            return self.ops.PlanLinear(*args, **kwargs)

    def planned(ops_, linear, dtype):
        return real_plan(Recording(ops_), linear, dtype)

    monkeypatch.setattr(fused_mod, "_plan_linear", planned)
    tok_on, lp_on, on = generate(folder, None, True, monkeypatch, prompts, "bfloat16")
    tok_off, lp_off, off = generate(folder, None, False, monkeypatch, prompts, "bfloat16")
    assert on["fused"] >= 39 and off["fused"] == 0, (on, off)
    assert tok_on == tok_off
    assert lp_on == lp_off
    if amx_choice._amx_gemm_faster:  # AMX copies were made: every pass or up to 64 rows
        rows = {True: 1 << 62 if silu_on_amx else 64, False: 1 << 62 if plain_on_amx else 64}
        assert set(amx_rows) == {(silu, rows[silu]) for silu in (True, False)}, amx_rows


def test_pass_attention_refuses_bad_arguments():
    """PassAttention names what is wrong instead of reading past a tensor."""
    from keel.cpu_ops import get_cpu_ops

    ops = get_cpu_ops()
    rows, lens = torch.zeros(4, dtype=torch.int32), torch.ones(4, dtype=torch.int64)
    ops.PassAttention(rows, lens, torch.zeros(1, 4, dtype=torch.int64))  # well-formed
    with pytest.raises(RuntimeError, match="token_rows int32 and token_seq_lens int64"):
        ops.PassAttention(rows.long(), lens)
    with pytest.raises(RuntimeError, match=r"long_chunks int64 \[n, 4\]"):
        ops.PassAttention(rows, lens, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="go together"):
        ops.PassAttention(rows, lens, torch.zeros(1, 4, dtype=torch.int64),
                          short_tokens=torch.arange(2))
    with pytest.raises(RuntimeError, match="with long_chunks"):
        ops.PassAttention(rows, lens, None, torch.arange(2), rows[:2], lens[:2])


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {"intermediate_size": 128}),
                                            ("qwen3", {}), ("mistral", {})])
def test_float16_gemms_are_fused_and_bit_identical(arch, overrides, tmp_path, monkeypatch):
    """dtype="auto" for a float32 model on a CPU without AMX runs its GEMMs on fp16_gemm where
    the build has AVX512-FP16 (chosen here without timing it): the plan takes those layers
    (a [gate; up] layer whose widths are multiples of 16 with silu in the epilogue, Qwen2's
    biases, the LM head outside it) and stays bit-identical to the Python layers, for decode
    passes and passes with long chunks. An interleaved [gate; up] layer's plain pass gives its
    columns in order. Without AVX512-FP16 nothing is packed for it."""
    from keel import dtypes
    from keel.attention.backends import chunk_kernels
    from keel.config import ModelConfig
    from keel.cpu_ops import get_cpu_ops
    from keel.model_executor.layers import gemm_choice, packed_weights
    from keel.model_executor.loader import load_model
    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    monkeypatch.setattr(gemm_choice, "_fp16_gemm_faster", True)
    monkeypatch.setattr(chunk_kernels, "long_chunk_kernel", forced_long_kernel)
    packed = []
    real_pack = packed_weights._fp16_pack

    def counting_pack(module, w, kind):
        ok = real_pack(module, w, kind)
        packed.append((ok, module.fp16_silu))
        return ok

    monkeypatch.setattr(packed_weights, "_fp16_pack", counting_pack)
    folder = str(make_hf_model(arch, tmp_path, **overrides))
    kw = dict(dtype="auto", max_num_batched_tokens=96)
    tok_on, lp_on, on = generate(folder, None, True, monkeypatch, MIXED, **kw)
    tok_off, lp_off, off = generate(folder, None, False, monkeypatch, MIXED, **kw)
    ops = get_cpu_ops()
    low = gemm_choice.low_precision_kind()  # fp16, else i16, else None
    available = low is not None
    config = ModelConfig(folder, dtype="auto")
    n_layers, inter = config.hf_config.num_hidden_layers, config.hf_config.intermediate_size
    assert config.float16_gemms
    assert len(packed) == (2 * (4 * n_layers + 1) if available else 0), packed  # + LM head
    assert all(ok for ok, _ in packed)
    assert sum(silu for _, silu in packed) == (2 * n_layers if available and inter % 16 == 0
                                               else 0)
    assert on["python"] == 0 and on["long"] >= 2 and on["fused"] >= 39, on
    assert off["fused"] == 0
    assert tok_on == tok_off
    assert lp_on == lp_off
    gate_up = load_model(config).model.layers[0].mlp.gate_up_proj
    assert gate_up.packed_by == (low or gate_up.packed_by)
    assert (gate_up.packed_by in ("fp16", "i16")) == available
    x = torch.randn(5, config.hf_config.hidden_size)
    plain = gate_up(x)
    assert plain.shape == (5, 2 * inter)
    fused = gate_up.gemm_silu(x)
    if fused is not None:
        assert torch.equal(fused, ops.silu_and_mul(plain))
