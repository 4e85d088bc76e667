"""keel's AMX GEMM for float32 passes over weights whose values are all bfloat16
(keel/csrc/amx_gemm.cpp amx_gemm_f32: x split into three bfloat16 parts, float32 sums): float32
accuracy against a float64 reference, the layer copy made only for such weights, and a
bfloat16 checkpoint run in float32 giving transformers' greedy tokens. Where the build or CPU
has no AMX tiles the op raises and no layer keeps a copy (each test checks that instead)."""

from __future__ import annotations

import pytest
import torch

from keel.cpu_ops import get_cpu_ops
from keel.model_executor.layers import amx_choice
from keel.model_executor.layers.gemm_choice import silu_pair_order
from keel.model_executor.layers.linear import ColumnParallelLinear
from keel.model_executor.layers.packed_weights import cpu_gemm, pack_for_cpu_gemm


@pytest.fixture(scope="module")
def ops():
    ops = get_cpu_ops()
    assert ops is not None, "the CPU kernels must build on this machine"
    return ops


@pytest.mark.parametrize("m, n, k, silu", [
    (1, 48, 64, False), (5, 960, 576, False), (37, 3072, 576, True), (64, 576, 1536, False),
    (300, 112, 96, False), (523, 960, 576, False), (17, 64, 32, True), (130, 3072, 576, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference_to_float32_rounding(ops, m, n, k, silu, bias):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    order = silu_pair_order(n) if silu else torch.arange(n)
    packed = ops.amx_gemm_pack(w[order].contiguous())
    if not ops.amx_gemm_available():
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            ops.amx_gemm_f32(x, packed, n, b, silu)
        return
    out = ops.amx_gemm_f32(x, packed, n, None if b is None else b[order].contiguous(), silu)
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    if silu:
        want = torch.nn.functional.silu(want[:, :n // 2]) * want[:, n // 2:]
    assert out.dtype == torch.float32 and out.shape == want.shape
    # x's three bfloat16 parts carry its 24 bits: float32's error (measured 1e-7 to 5e-7 of
    # the largest output, as torch's float32 GEMM), where x in one bfloat16 part is ~2e-3.
    assert (out.double() - want).abs().max() <= 2e-6 * want.abs().max()


def test_arguments_are_checked(ops):
    packed = ops.amx_gemm_pack(torch.zeros(64, 64, dtype=torch.bfloat16))
    if not ops.amx_gemm_available():
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            ops.amx_gemm_f32(torch.zeros(4, 64), packed, 64)
        return
    with pytest.raises(RuntimeError, match="float32 x"):
        ops.amx_gemm_f32(torch.zeros(4, 64, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(RuntimeError, match="another shape"):
        ops.amx_gemm_f32(torch.zeros(4, 64), packed, 32)
    with pytest.raises(RuntimeError, match="float32 bias"):
        ops.amx_gemm_f32(torch.zeros(4, 64), packed, 64, torch.zeros(64, dtype=torch.bfloat16))


@pytest.mark.parametrize("values", ["bfloat16", "float32"])
def test_layer_copy_only_for_bfloat16_values(ops, monkeypatch, values):
    monkeypatch.setenv("KEEL_AMX_F32", "1")
    monkeypatch.setattr(amx_choice, "_amx_f32_faster", None)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g) * 0.05
    if values == "bfloat16":
        w = w.bfloat16().float()
    layer = ColumnParallelLinear(64, 96, bias=True, dtype=torch.float32)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(96, generator=g))
    pack_for_cpu_gemm(layer)
    takes = values == "bfloat16" and ops.amx_gemm_available()
    assert layer.amx_f32 is takes and (layer.amx_weight is not None) is takes
    x = torch.randn(7, 64, generator=g)
    out = cpu_gemm(layer, x, layer.bias)
    want = x.double() @ w.double().t() + layer.bias.double()
    assert out.dtype == torch.float32
    assert (out.double() - want).abs().max() <= 2e-6 * want.abs().max()


def test_bad_choice_value_is_refused(monkeypatch):
    monkeypatch.setenv("KEEL_AMX_F32", "yes")
    monkeypatch.setattr(amx_choice, "_amx_f32_faster", None)
    with pytest.raises(ValueError, match="KEEL_AMX_F32"):
        amx_choice.amx_f32_chosen()


def test_bfloat16_checkpoint_in_float32_gives_transformers_tokens(ops, tmp_path, monkeypatch):
    """A bfloat16 folder run with dtype="float32": its layers and LM head keep tile copies
    (where the CPU has AMX) and greedy tokens equal transformers' in float32, through prompt chunks (SDPA
    and the paged kernel) and the fused decode pass."""
    import transformers

    from keel import LLM, SamplingParams
    from tests.engine.test_llm_e2e import random_prompt
    from tests.hf_models import hf_reference, make_hf_model
    from tests.model_executor.test_models import hf_greedy

    monkeypatch.setenv("KEEL_AMX_F32", "1")
    monkeypatch.setattr(amx_choice, "_amx_f32_faster", None)
    folder = make_hf_model("llama", tmp_path / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(folder)
    prompts = [random_prompt(n, seed=90 + n) for n in (7, 300, 40)]
    hf = hf_reference(folder)
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=256)
    runner = llm.engine_core.model_executor.driver_worker.model_runner
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.amx_f32 is ops.amx_gemm_available()
    assert getattr(runner.model.lm_head, "amx_f32", False) is ops.amx_gemm_available()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_tensor_parallel_ranks_keep_their_shards_copies(ops, tmp_path, monkeypatch):
    """With tensor parallelism each worker's shard of a bfloat16 folder run in float32 keeps
    its own tile copy (where the CPU has AMX), and greedy tokens equal transformers'."""
    import transformers

    from keel import LLM, SamplingParams
    from tests.engine.test_llm_e2e import random_prompt
    from tests.executor.test_multiproc import assert_gone, worker_pids
    from tests.hf_models import hf_reference, make_hf_model
    from tests.model_executor.test_models import hf_greedy

    monkeypatch.setenv("KEEL_AMX_F32", "1")  # the workers inherit it
    folder = make_hf_model("llama", tmp_path / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(folder)
    prompts = [random_prompt(n, seed=110 + n) for n in (6, 90)]
    hf = hf_reference(folder)
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2)
    try:
        copies = llm.engine_core.model_executor.collective_rpc(
            lambda worker: worker.model_runner.model.model.layers[0].self_attn.qkv_proj.amx_f32)
        assert copies == [ops.amx_gemm_available()] * 2
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        pids = worker_pids(llm)
        llm.close()
        assert_gone(pids)
