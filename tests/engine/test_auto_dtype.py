"""dtype="auto": the checkpoint's dtype, except a float32 model on a CPU with AMX tiles, which
computes in bfloat16 (as vLLM's "auto" does for every float32 checkpoint)."""

from __future__ import annotations

import pytest
import torch

from keel import dtypes
from keel.config import ModelConfig


def test_float32_model_computes_in_bfloat16_only_where_the_cpu_has_amx(hf_model_dir,
                                                                      monkeypatch):
    folder = hf_model_dir("llama")  # saved in float32
    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    assert ModelConfig(folder, device="cpu").torch_dtype == torch.float32

    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: True)
    assert ModelConfig(folder, device="cpu").torch_dtype == torch.bfloat16
    # What the user asked for stays, and so do weights quantized by keel on request (their
    # kernels compute in float32).
    assert ModelConfig(folder, dtype="float32", device="cpu").torch_dtype == torch.float32
    assert ModelConfig(folder, device="cpu", quantization="int8").torch_dtype == torch.float32


def test_a_gguf_files_blocks_follow_the_dense_rules(monkeypatch):
    """The default .gguf (weights kept as its int4 / Q8_0 blocks) is a float32 checkpoint like
    any other: bfloat16 arithmetic and K/V on an AMX CPU (AMX GEMMs for passes of many rows),
    float32 arithmetic over bfloat16 K/V elsewhere; dtype="float32" keeps both float32."""
    from keel.config import CacheConfig

    def resolved(amx: bool, **kw) -> tuple[torch.dtype, torch.dtype]:
        monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: amx)
        mc = ModelConfig(None, device="cpu", **kw)
        assert mc.quantization_method == "gguf"
        return mc.torch_dtype, CacheConfig().resolve_kv_dtype(mc)

    assert resolved(True) == (torch.bfloat16, torch.bfloat16)
    assert resolved(False) == (torch.float32, torch.bfloat16)
    assert resolved(True, dtype="float32") == (torch.float32, torch.float32)
    assert resolved(False, dtype="float32") == (torch.float32, torch.float32)


def test_amx_check_reads_this_cpu(monkeypatch):
    monkeypatch.delenv("KEEL_AMX", raising=False)
    dtypes.cpu_has_amx_bfloat16.cache_clear()
    assert dtypes.cpu_has_amx_bfloat16() == (
        torch.cpu._is_amx_tile_supported() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_keel_amx_0_runs_as_on_a_cpu_without_tiles(hf_model_dir):
    """KEEL_AMX=0 (vs_vllm.py --no-amx): no AMX in dtype="auto" and none of keel's AMX
    kernels, whatever this CPU has. In a fresh process: both answers are cached per process."""
    import os
    import subprocess
    import sys

    folder = hf_model_dir("llama")  # saved in float32: "auto" computes in bfloat16 on AMX only
    code = (
        "import torch\n"
        "from keel import dtypes\n"
        "from keel.config import ModelConfig\n"
        "from keel.cpu_ops import get_cpu_ops\n"
        "assert not dtypes.cpu_has_amx_bfloat16()\n"
        f"assert ModelConfig({str(folder)!r}, device='cpu').torch_dtype == torch.float32\n"
        "ops = get_cpu_ops()\n"
        "assert ops is None or not ops.prefill_attention_amx_available()\n"
        "assert ops is None or not ops.amx_gemm_available()\n"
        "print('ok')\n")
    env = {**os.environ, "KEEL_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _kv_dtype(folder, monkeypatch, amx: bool, **kw) -> torch.dtype:
    from keel.config import CacheConfig

    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: amx)
    cache_dtype = kw.pop("kv_cache_dtype", "auto")
    return CacheConfig(cache_dtype=cache_dtype).resolve_kv_dtype(
        ModelConfig(folder, device="cpu", **kw))


def test_auto_keeps_a_float32_models_kv_cache_in_bfloat16_on_cpus_without_amx(
        hf_model_dir, monkeypatch):
    """dtype="auto" where the CPU computes a float32 model in float32: float32 arithmetic over
    a bfloat16 KV cache (half the bytes a decode step reads). An explicit dtype, weights kept
    quantized, and an embedding model keep the cache in the compute dtype; with AMX the
    model computes in bfloat16 and so does its cache."""
    folder = hf_model_dir("llama")  # saved in float32
    assert _kv_dtype(folder, monkeypatch, amx=False) == torch.bfloat16
    assert _kv_dtype(folder, monkeypatch, amx=True) == torch.bfloat16
    assert _kv_dtype(folder, monkeypatch, amx=False, dtype="float32") == torch.float32
    assert _kv_dtype(folder, monkeypatch, amx=False, quantization="int8") == torch.float32
    assert _kv_dtype(folder, monkeypatch, amx=False, runner="pooling") == torch.float32
    # Asked for by name.
    assert _kv_dtype(folder, monkeypatch, amx=False, kv_cache_dtype="float32") == torch.float32
    assert _kv_dtype(folder, monkeypatch, amx=False, dtype="float32",
                     kv_cache_dtype="bfloat16") == torch.bfloat16
    assert _kv_dtype(folder, monkeypatch, amx=False, dtype="bfloat16",
                     kv_cache_dtype="bfloat16") == torch.bfloat16


def test_bad_kv_cache_dtype_names_the_choices(hf_model_dir, monkeypatch):
    folder = hf_model_dir("llama")
    with pytest.raises(ValueError, match="use auto, float32, bfloat16 or int8"):
        _kv_dtype(folder, monkeypatch, amx=False, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="the cache may be the compute dtype, or bfloat16"):
        _kv_dtype(folder, monkeypatch, amx=False, dtype="bfloat16", kv_cache_dtype="float32")
    # int8 under float32 or bfloat16 arithmetic only
    assert _kv_dtype(folder, monkeypatch, amx=False, dtype="float32",
                     kv_cache_dtype="int8") == torch.int8
    assert _kv_dtype(folder, monkeypatch, amx=False, dtype="bfloat16",
                     kv_cache_dtype="int8") == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' under dtype float16"):
        dtypes.kv_cache_dtype("int8", torch.float16, torch.float16)  # (float16 on CUDA)


def test_engine_allocates_the_resolved_kv_cache_dtype(hf_model_dir, monkeypatch):
    """The worker sizes and allocates the cache in kv_cache_dtype: the same budget holds
    twice the blocks in bfloat16, and the engine's greedy tokens over it stay close to float32
    (the rounding of K/V moves log-probabilities by little)."""
    from keel import LLM, SamplingParams

    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    folder = hf_model_dir("llama")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5, 17, 33, 9, 41, 2, 77]}]
    runs = {}
    for kv in ("auto", "float32"):
        llm = LLM(folder, kv_cache_memory_gib=0.0625, max_model_len=256, max_num_seqs=1024,
                  kv_cache_dtype=kv, block_size=16)  # (16 named: blocks the same size)
        runner = llm.engine_core.model_executor.driver_worker.model_runner
        out = llm.generate(prompts, sp, use_tqdm=False)[0].outputs[0]
        runs[kv] = (runner.kv_caches[0].dtype, runner.kv_caches[0].shape[1],
                    [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
        del llm
    assert runs["auto"][0] == torch.bfloat16 and runs["float32"][0] == torch.float32
    assert runs["auto"][1] in (2 * runs["float32"][1], 2 * runs["float32"][1] + 1)
    assert max(abs(a - b) for a, b in zip(runs["auto"][2], runs["float32"][2])) < 0.05


def test_checkpoint_dtype_reads_the_config_and_keeps_float16_off_the_cpu():
    """keel/dtypes.py alone: "auto" is config.json's dtype (`dtype` or the older
    `torch_dtype`, float32 when absent), float16 computed in bfloat16 on a CPU; a name is
    taken as given."""
    from types import SimpleNamespace

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert dtypes.checkpoint_dtype("auto", SimpleNamespace(), cpu) == torch.float32
    assert dtypes.checkpoint_dtype("auto", SimpleNamespace(torch_dtype="bfloat16"),
                                   cpu) == torch.bfloat16
    assert dtypes.checkpoint_dtype("auto", SimpleNamespace(dtype="float16"), cpu) == torch.bfloat16
    assert dtypes.checkpoint_dtype("auto", SimpleNamespace(dtype="float16"), cuda) == torch.float16
    assert dtypes.checkpoint_dtype("half", SimpleNamespace(dtype="float32"), cpu) == torch.float16
    with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
        dtypes.checkpoint_dtype("int8", SimpleNamespace(), cpu)


def test_an_int8_kv_cache_in_the_engine(hf_model_dir, monkeypatch):
    """kv_cache_dtype="int8": the worker sizes the cache with its scales (D + 4 bytes a row of
    D values against float32's 4 D: 3.76x the blocks at the default model's D = 64, 3.56x at
    this one's 32), binds each layer's
    scales beside its cache, and greedy decoding over it stays close to float32's (each K/V
    value within half a step of 1/127 of its row's largest)."""
    from keel import LLM, SamplingParams
    from keel.attention.layer import attention_layers

    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    folder = hf_model_dir("llama")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5, 17, 33, 9, 41, 2, 77]},
               {"prompt_token_ids": [8, 1, 4] * 9}]
    runs = {}
    for kv in ("int8", "float32"):
        llm = LLM(folder, dtype="float32", kv_cache_memory_gib=0.0625, max_model_len=256,
                  max_num_seqs=1024, kv_cache_dtype=kv)
        runner = llm.engine_core.model_executor.driver_worker.model_runner
        layer = attention_layers(runner.model)[0]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        head = layer.head_size
        runs[kv] = (runner.kv_caches[0].dtype, runner.kv_caches[0].shape[1], layer.kv_scale,
                    [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                     o.outputs[0].token_ids)] for o in outs],
                    [list(o.outputs[0].token_ids) for o in outs])
        del llm
    dt, blocks, scale, lps, toks = runs["int8"]
    assert dt == torch.int8 and runs["float32"][2] is None
    assert scale.shape == (2, blocks, *runs["int8"][2].shape[2:]) and scale.dtype == torch.float32
    assert scale.abs().sum() > 0  # the writes filled them
    assert abs(blocks / runs["float32"][1] - 4 * head / (head + 4)) < 0.01
    # While the greedy tokens agree (this tiny random model's are near ties: they part after
    # a few steps), the log-probabilities differ by the quantization's little.
    diffs = []
    for (la, ta), (lb, tb) in zip(zip(lps, toks), zip(runs["float32"][3], runs["float32"][4])):
        same = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
        assert same >= 3, (ta, tb)
        diffs += [abs(a - b) for a, b in zip(la[:same], lb[:same])]
    assert 0 < max(diffs) < 0.15, diffs


def test_auto_lets_float16_gemms_run_only_for_a_float32_model_without_amx(hf_model_dir,
                                                                          monkeypatch):
    """ModelConfig.float16_gemms (the loader packs inside gemm_choice.float16_gemms): the same
    models as the bfloat16 K/V rule, and only where "auto" keeps float32 arithmetic."""
    folder = hf_model_dir("llama")  # saved in float32

    def allowed(amx: bool, **kw) -> bool:
        monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: amx)
        return ModelConfig(folder, device="cpu", **kw).float16_gemms

    assert allowed(False)
    assert not allowed(True)  # bfloat16 arithmetic there
    assert not allowed(False, dtype="float32")
    assert not allowed(False, dtype="bfloat16")
    assert not allowed(False, quantization="int8")
    assert not allowed(False, runner="pooling")


def test_float16_gemms_stay_close_to_transformers(hf_model_dir, monkeypatch):
    """dtype="auto" on a CPU with AVX512-FP16 and no AMX (its fp16_gemm chosen here without
    timing it): every linear layer and the LM head on float16 FMAs, over the bfloat16 K/V
    "auto" keeps. Its prompt log-probabilities against transformers' float32 are within
    0.12, and closer than keel's dtype="bfloat16" (bfloat16 arithmetic and K/V); greedy tokens
    agree with float32's until this tiny random model's first near tie. Where the build has no
    AVX512-FP16, "auto" runs i16_gemm where it has AVX512-VNNI, else float32, and the same
    bounds hold."""
    from keel import LLM, SamplingParams
    from keel.model_executor.layers import gemm_choice
    from tests.hf_models import hf_reference

    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    monkeypatch.setattr(gemm_choice, "_fp16_gemm_faster", True)
    folder = hf_model_dir("llama")
    hf = hf_reference(folder)
    prompts = [[5, 17, 33, 9, 41, 2, 77] * 3, [(13 * j + 7) % 250 + 1 for j in range(90)]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    errors, packed_by = {}, {}
    for dtype in ("auto", "bfloat16"):
        llm = LLM(folder, dtype=dtype, kv_cache_memory_gib=0.0625, max_model_len=256)
        model = llm.engine_core.model_executor.driver_worker.model_runner.model
        packed_by[dtype] = {m.packed_by for m in model.modules() if getattr(m, "packed_by", "")}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        err = 0.0
        for p, o in zip(prompts, outs):
            with torch.no_grad():
                ref = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
            for i, (lps, t) in enumerate(zip(o.prompt_logprobs[1:], p[1:])):
                err = max(err, abs(lps[t].logprob - ref[i, t].item()))
        errors[dtype] = err
        del llm
    low = gemm_choice.low_precision_kind()  # fp16, else i16, else None
    assert packed_by["auto"] == ({low} if low else packed_by["auto"] - {"fp16", "i16"})
    assert errors["auto"] < 0.12, errors
    assert errors["auto"] < 0.5 * errors["bfloat16"], errors
