"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) with its weights kept quantized,
against the same file dequantized to float32: 16 chat prompts.

Every quantized layer is forced onto its kernel (as at batch 1, where the engine uses it),
so the whole forward pass is the quantized one, with keel's default activations (two int8
parts per group of 32, layers/quantization.py). Stated bound, measured with margin here:
the prompts' next-token logits differ by at most 2.0 (logits span ~35; measured 0.65: the
int4 weights are the file's own, the differences come from the activations' rounding and
the int8 LM head requantized from Q8_0), the top token agrees on at least 14 of 16 prompts
(measured 16), and greedy continuations of 32 tokens agree on average for at least half
their length before the first difference (measured 89%). With llama.cpp's one-part int8
activations (KEEL_QUANT_ACTIVATIONS=int8) this test fails: logits move by more than 2.0,
and the model no longer answers "Paris", as llama.cpp does not on the same file.
"""

from __future__ import annotations

import logging

import pytest
import torch

from keel import LLM, SamplingParams
from keel.config import ModelConfig
from keel.model_executor.direct import DirectRunner
from keel.model_executor.layers import amx_choice
from keel.model_executor.layers.quantization import ALL_ROWS, Int4Weight, Int8Weight
from keel.model_executor.loader import load_model

QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.",
    "Write a haiku about rain.", "What is 12 times 12?", "Who wrote Hamlet?",
    "Explain photosynthesis briefly.", "Give me a synonym for happy.",
    "What is the boiling point of water?", "Translate 'hello' into Spanish.",
    "List two planets.", "What does a CPU do?", "Why is the sky blue?",
    "How many legs does a spider have?", "What is the largest ocean?",
    "Define gravity in one sentence.", "Suggest a name for a cat.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from keel.config import resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    return [tok.apply_chat_template([{"role": "user", "content": q}],
                                    add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in QUESTIONS]


def run(model, prompts):
    runner = DirectRunner(model, max_reqs=len(prompts), max_len=256)
    logits = torch.stack([runner.step([i], [p], [0])[0] for i, p in enumerate(prompts)])
    tokens = DirectRunner(model, max_reqs=len(prompts), max_len=256).greedy(prompts, NEW_TOKENS)
    return logits, tokens


def test_quantized_default_model_against_dequantized(prompts, caplog):
    with caplog.at_level(logging.INFO, logger="keel.model_executor.quantize_model"):
        quant = load_model(ModelConfig(None, dtype="float32"))  # a .gguf: quantized by default
    weights = {id(m.quant): m.quant for m in quant.modules()
               if getattr(m, "quant", None) is not None}
    kinds = [type(w) for w in weights.values()]
    # 30 layers x (qkv, o, gate_up, down) from Q4_1; one int8 table (Q8_0) for the tied
    # embedding and LM head.
    assert kinds.count(Int4Weight) == 120 and kinds.count(Int8Weight) == 1
    assert "A token reads" in caplog.text and "120 x int4/g32 (GGUF Q4_1)" in caplog.text
    for m in quant.modules():
        if getattr(m, "quant", None) is not None:
            m.quant.max_rows = ALL_ROWS  # every pass on the kernels
    dense = load_model(ModelConfig(None, dtype="float32", quantization=None))
    assert not any(getattr(m, "quant", None) is not None for m in dense.modules())

    lq, tq = run(quant, prompts)
    ld, td = run(dense, prompts)
    assert (lq - ld).abs().max() <= 2.0
    assert (lq.argmax(-1) == ld.argmax(-1)).sum() >= 14
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NEW_TOKENS)
                  for x, y in zip(tq, td)]
    agreement = sum(first_diff) / (len(first_diff) * NEW_TOKENS)
    print(f"max logit difference {(lq - ld).abs().max():.2f}; token agreement before the "
          f"first difference: {agreement:.0%} {first_diff}")
    assert agreement >= 0.5


def test_quantized_default_model_answers():
    llm = LLM(max_num_seqs=1)  # one request: every decode pass on the kernels
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    llm.shutdown()
    assert llm.config.model_config.quantization_method == "gguf"
    assert "Paris" in out[0].outputs[0].text


def test_default_model_answers_where_auto_keeps_float32(monkeypatch):
    """On a CPU without AMX tiles, dtype="auto" leaves the default .gguf computing in float32
    over its int4 blocks, with its K/V in bfloat16 (keel/dtypes.py); on one with them it
    computes in bfloat16 (test_quantized_default_model_answers, on such a CPU)."""
    from keel import dtypes

    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    llm = LLM(max_num_seqs=1)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    llm.shutdown()
    assert llm.config.model_config.torch_dtype == torch.float32
    assert llm.config.cache_config.kv_torch_dtype == torch.bfloat16
    assert "Paris" in out[0].outputs[0].text


def test_a_layer_whose_kernel_wins_at_every_size_keeps_nothing_of_its_dense_copy(monkeypatch):
    """Where the quantized kernel times faster at every pass size, the load drops the layer's
    dense copy, and with it an int16 or float16 copy's scales and orders. A noisy minute once
    measured the [gate; up] layers so (the others not); their int16 copy's scales, left behind
    without its panels, stopped the fused decode pass's plan from being built and `keel
    generate` failed ("PlanLinear: i16_scales come with the int16 panels")."""
    from keel.model_executor import rows_per_pass
    from keel.model_executor.layers.linear import MergedColumnParallelLinear

    def measured(self, key):  # as that minute measured: the kernel up to 64 rows for gate/up
        return 64 if "3072x576" in key else 1

    monkeypatch.setattr(rows_per_pass._RowsCache, "get", measured)
    llm = LLM(max_num_seqs=4)  # dtype="auto": the dense copies on the GEMM chosen for this CPU
    convs = [[{"role": "user", "content": "What is the capital of France?"}]] * 3
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    model = llm.engine_core.model_executor.driver_worker.model_runner.model
    llm.shutdown()
    gate_up = [m for m in model.modules() if isinstance(m, MergedColumnParallelLinear)]
    assert gate_up and all(m.quant.max_rows == ALL_ROWS for m in gate_up)
    assert all(m.packed_weight is None and m.packed_by == "" and m.i16_scales is None
               and m.fp16_unorder is None for m in gate_up)
    assert all("Paris" in o.outputs[0].text for o in outs)


def test_gguf_weights_load_as_the_slower_way_made_them():
    """Two shortcuts of the load, each checked against the way it replaced: the int4 layers
    take the converted file's nibble pairs as they are (no unpacking to int32 and packing
    again), and the int8 LM head is read from the folder after the first load."""
    from safetensors import safe_open

    from keel.config import resolve_model_path
    from keel.model_executor.gguf_loader import HEAD_INT8_FILE, INT4_FILE
    from keel.model_executor.layers.quantization import pack_int4, quantize_int8
    from keel.model_executor.quantize_model import _read_int4, _sources

    folder = resolve_model_path(None)
    model = load_model(ModelConfig(None, dtype="float32"))
    checked = 0
    with safe_open(str(folder / INT4_FILE), framework="pt") as f:
        for name, m in model.named_modules():
            if isinstance(getattr(m, "quant", None), Int4Weight):
                parts = [_read_int4(f, s) for s in _sources(name, model.stacked_params_mapping)]
                before = pack_int4(*(torch.cat(x) for x in zip(*parts)), 32)
                assert m.quant.keel is not None and before.keel is not None
                assert all(torch.equal(a, b) for a, b in zip(m.quant.keel, before.keel)), name
                checked += 1
    assert checked == 120
    head = model.lm_head
    q, scale = quantize_int8(head.weight.data)
    assert (folder / HEAD_INT8_FILE).is_file()
    assert torch.equal(head.quant.q, q) and torch.equal(head.quant.scales_f32, scale)


def _head(rows: int, dtype=torch.float32):
    from keel.model_executor.layers.vocab_embedding import ParallelLMHead

    head = ParallelLMHead(rows, 64, dtype=dtype)
    head.weight.data.copy_(torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)))
    return head


def test_lm_head_int8_is_kept_and_checked(tmp_path, monkeypatch, caplog):
    from keel.model_executor import quantize_model as qm
    from keel.model_executor.gguf_loader import HEAD_INT8_FILE
    from keel.model_executor.layers.quantization import quantize_int8

    (tmp_path / "keel_gguf").mkdir()
    path = tmp_path / HEAD_INT8_FILE
    head = _head(1000)
    want = quantize_int8(head.weight.data)
    got = qm._gguf_head_int8(head, tmp_path)  # first load: quantized, then kept
    assert path.is_file() and all(torch.equal(a, b) for a, b in zip(got, want))

    real = qm.quantize_int8
    monkeypatch.setattr(qm, "quantize_int8", lambda w: pytest.fail("quantized again"))
    got = qm._gguf_head_int8(head, tmp_path)  # later loads: read back
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    monkeypatch.setattr(qm, "quantize_int8", real)

    other = _head(500)  # a file that does not fit this head is not used
    got = qm._gguf_head_int8(other, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(got, quantize_int8(other.weight.data)))

    path.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="keel.model_executor.quantize_model"):
        got = qm._gguf_head_int8(head, tmp_path)
    assert "Cannot read" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    path.unlink()
    bf16 = _head(1000, torch.bfloat16)  # not the float32 values the file would be made from
    got = qm._gguf_head_int8(bf16, tmp_path)
    assert not path.exists()
    assert all(torch.equal(a, b) for a, b in zip(got, quantize_int8(bf16.weight.data)))

    path.mkdir()  # a copy that can be neither read nor replaced: the head still loads
    got = qm._gguf_head_int8(head, tmp_path)
    assert path.is_dir() and [p.name for p in path.parent.iterdir()] == [path.name]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_rows_cache_is_replaced_whole(tmp_path, monkeypatch, caplog):
    """The per-CPU measurements of choose_rows_per_pass are written beside and renamed over
    the old file (no temporary file stays); a cache that cannot be written is logged."""
    from keel.model_executor.rows_per_pass import _RowsCache

    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    cache = _RowsCache()
    cache.put("layer 576x576", 8)
    cache.save()
    assert _RowsCache().get("layer 576x576") == 8
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["quantized_rows.json"]
    cache.path.unlink()
    cache.path.mkdir()  # cannot be replaced: the load goes on, measuring again next time
    cache.put("layer 576x576", 1)
    with caplog.at_level(logging.WARNING, logger="keel.model_executor.rows_per_pass"):
        cache.save()
    assert "Cannot save" in caplog.text
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["quantized_rows.json"]


def test_converted_folder_offers_its_blocks_to_the_amx_copies(prompts, monkeypatch):
    """The folder keel converted the default .gguf into, loaded dense in bfloat16 (as
    dtype="auto" does on an AMX CPU): where the AMX GEMM is chosen and the compressed copies
    measured faster, the Q4_1 layers' copies come from the file's int4 groups and the LM
    head's from its Q8_0 blocks. No layer becomes quantized: the greedy tokens are those of
    the bfloat16 copies, the logits too."""
    from keel.config import resolve_model_path
    from keel.cpu_ops import get_cpu_ops

    folder = str(resolve_model_path(None))
    monkeypatch.setattr(amx_choice, "_amx_bytes_left", 1 << 31)
    # Prompt chunks on oneDNN for both: the int4 copy leaves them there, and the bfloat16 copy
    # would otherwise take them on the AMX GEMM (amx_prompt_chosen), whose sums round in
    # another order (this file's first prompt then ties in bfloat16: 25.25 / 25.25 for tokens
    # 504 and 60 on oneDNN, 25.625 / 25.375 on the AMX GEMM, 25.33 / 25.24 in float32).
    monkeypatch.setattr(amx_choice, "_amx_prompt_faster", False)
    monkeypatch.setattr(amx_choice, "_amx_plain_prompt_faster", False)
    results = {}
    for faster in (True, False):
        monkeypatch.setattr(amx_choice, "_compressed_faster", {"int4": faster, "int8": faster})
        model = load_model(ModelConfig(folder, dtype="bfloat16", device="cpu"))
        qkv, head = model.model.layers[0].self_attn.qkv_proj, model.lm_head
        assert qkv.quant is None and head.quant is None and qkv.amx_int4 is None
        if amx_choice.amx_gemm_chosen():
            # (without AMX tiles, on AVX512-BF16's dots, the bfloat16 copies only)
            compressed = faster and get_cpu_ops().amx_gemm_available()
            assert qkv.amx_weight.dtype == (torch.uint8 if compressed else torch.bfloat16)
            # The head keeps a bfloat16 AMX copy where its int8 one is not taken (a greedy
            # step's argmax in its epilogue: ParallelLMHead.greedy_token_ids).
            assert head.amx_weight.dtype == (torch.int8 if compressed else torch.bfloat16)
        else:  # no AMX GEMM here: nothing is offered, and no copy is made
            assert qkv.amx_weight is None and head.amx_weight is None
        results[faster] = run(model, prompts[:4])
    # Every copy gives its bfloat16 copy's bits (test_amx_gemm.py), the head's int8 one too:
    # the same logits and tokens either way.
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1] == results[False][1]


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_rows_per_pass_times_the_mlp_as_it_runs(dtype, monkeypatch):
    """choose_rows_per_pass times a [gate; up] layer as the MLP runs it on each side: the
    quantized kernel's product then silu_and_mul, or the dense weight's gemm_silu (SiLU in
    the GEMM's epilogue) where the layer has one; not a plain dense pass, which on an
    interleaved copy (AMX, or fp16_gemm under "auto" without AMX) also puts the columns back
    in order."""
    from keel.cpu_ops import get_cpu_ops
    from keel.model_executor import rows_per_pass
    from keel.model_executor.layers.linear import MergedColumnParallelLinear
    from keel.model_executor.layers.packed_weights import cpu_gemm

    def dense_kept(model):  # (where the kernel won at every size, the load drops the copy)
        for m in model.modules():
            if getattr(m, "quant", None) is not None:
                m.quant.max_rows = 8

    monkeypatch.setattr(rows_per_pass, "choose_rows_per_pass", dense_kept)
    model = load_model(ModelConfig(None, dtype=dtype))
    layers = [m for m in model.modules() if isinstance(m, MergedColumnParallelLinear)
              and m.quant is not None and m.packed_weight is not None]
    assert layers, "the default model's [gate; up] layers are quantized, with a dense copy"
    m = layers[0]
    x = torch.randn(8, m.input_size, generator=torch.Generator().manual_seed(0))
    x = x.to(m.weight.dtype)
    m.quant.max_rows = 64  # 8 rows go to the kernel
    assert m.gemm_silu(x) is None
    fused = m.gemm_silu(x, dense_only=True)
    ops = get_cpu_ops()
    if fused is not None:  # the dense path the engine takes past max_rows
        plain = ops.silu_and_mul(cpu_gemm(m, x, None))
        torch.testing.assert_close(fused, plain)  # (bfloat16: the dtype's own tolerance)

    calls = {"dense": 0, "silu": 0}
    real_gemm, real_silu = rows_per_pass.cpu_gemm, ops.silu_and_mul

    def counted_gemm(*a):
        calls["dense"] += 1
        return real_gemm(*a)

    class Ops:  # silu_and_mul counted, the rest as it is
        def __getattr__(self, name):
            return getattr(ops, name)

        def silu_and_mul(self, y):
            calls["silu"] += 1
            return real_silu(y)

    monkeypatch.setattr(rows_per_pass, "cpu_gemm", counted_gemm)
    monkeypatch.setattr(rows_per_pass, "cpu_ops_for", lambda t: Ops())
    rows_per_pass._sweep(layers[:2], x, True)
    assert calls == {"dense": 0, "silu": 4}  # two sweeps (best of two) of two layers
    calls.update(dense=0, silu=0)
    rows_per_pass._sweep(layers[:2], x, False)
    expected = 0 if fused is not None else 4
    assert calls == {"dense": expected, "silu": expected}
