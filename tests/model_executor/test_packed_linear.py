"""Packed weights on the CPU (layers/gemm_choice.py chooses, layers/packed_weights.py packs):
which GEMM packs them (keel's or oneDNN's), what packing keeps and releases, that packed
layers compute what F.linear computes, and the switch that turns it off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keel.config import ModelConfig
from keel.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from keel.model_executor.layers.vocab_embedding import ParallelLMHead
from keel.model_executor.loader import load_model

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture
def gemm_mode(monkeypatch):
    """Sets KEEL_CPU_GEMM for the test."""
    def set_mode(mode: str) -> None:
        monkeypatch.setenv("KEEL_CPU_GEMM", mode)
    return set_mode


@pytest.mark.parametrize("mode", ["keel", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layers_compute_f_linear(gemm_mode, mode, dtype, bias):
    from keel.model_executor.layers import gemm_choice as linear

    gemm_mode(mode)
    g = torch.Generator().manual_seed(0)
    layers = [
        QKVParallelLinear(64, 16, 4, 2, bias=bias, dtype=dtype),
        MergedColumnParallelLinear(64, [96, 96], bias=bias, dtype=dtype),
        RowParallelLinear(96, 64, bias=bias, dtype=dtype),
    ]
    for layer in layers:
        layer.weight.data = (0.1 * torch.randn(layer.weight.shape, generator=g)).to(dtype)
        if bias:
            layer.bias.data = torch.randn(layer.bias.shape, generator=g).to(dtype)
        dense_w = layer.weight.detach().clone()
        x = torch.randn(7, layer.input_size, generator=g).to(dtype)
        want = F.linear(x.float(), dense_w.float(), None if not bias else layer.bias.float())

        # Every weight packs: on keel's GEMM in its own dtype, or on oneDNN's (bfloat16 natively
        # where the CPU has bf16 dot products and they measured faster, else as its upcast).
        layer.process_weights_after_loading()
        assert layer.packed_weight is not None
        assert layer.weight.numel() == 0, "the dense copy is released"
        assert layer.packed_rows == layer.output_size
        in_float32 = dtype == torch.bfloat16 and linear.bf16_gemm_in_float32(dense_w)
        if mode == "keel" and (dtype == torch.float32 or in_float32):
            assert layer.packed_by == "keel" and layer.packed_weight.dtype == dtype
        else:
            assert layer.packed_by == ("onednn-upcast" if in_float32 else "onednn")
        got = layer(x)
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want).abs().max().item() < TOL[dtype] * want.abs().max().item()


@pytest.mark.parametrize("mode", ["keel", "onednn"])
def test_lm_head_keeps_a_tied_weight(gemm_mode, mode):
    gemm_mode(mode)
    emb_weight = torch.randn(50, 16)
    tied, untied = ParallelLMHead(50, 16), ParallelLMHead(50, 16)
    tied.weight.data.copy_(emb_weight)
    untied.weight.data.copy_(emb_weight)
    tied.tied = True
    x = torch.randn(3, 16)
    for head in (tied, untied):
        head.process_weights_after_loading()
        assert head.packed_weight is not None and head.packed_by == mode
        assert torch.allclose(head.compute_logits(x), x @ emb_weight.T, atol=1e-5)
    assert tied.weight.shape == (50, 16)  # the embedding still looks rows up in it
    assert untied.weight.numel() == 0


def test_switch_off_keeps_dense_weights(gemm_mode):
    gemm_mode("torch")
    layer = RowParallelLinear(32, 8)
    layer.weight.data = torch.randn(8, 32)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None and layer.weight.shape == (8, 32)
    x = torch.randn(2, 32)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_a_bad_mode_names_the_variable(gemm_mode):
    gemm_mode("fast")
    layer = RowParallelLinear(32, 8)
    with pytest.raises(ValueError, match="KEEL_CPU_GEMM='fast'.*auto, keel, onednn, torch"):
        layer.process_weights_after_loading()


def test_loader_packs_every_linear(hf_model_dir):
    model = load_model(ModelConfig(hf_model_dir("llama"), dtype="float32"))
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert model.lm_head.packed_weight is not None


@pytest.mark.parametrize("mode", ["keel", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_in_float32_is_the_rounded_float32_gemm(monkeypatch, gemm_mode, mode, bias):
    """Forced on (any CPU): a bfloat16 layer returns the float32 GEMM of the upcast input and
    weight rounded once to bfloat16 (keel's GEMM keeps the weight in bfloat16, oneDNN's packs
    its exact float32 upcast); the LM head too."""
    from keel.model_executor.layers import gemm_choice as linear

    gemm_mode(mode)
    monkeypatch.setattr(linear, "bf16_gemm_in_float32", lambda w: w.dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    layer = RowParallelLinear(96, 64, bias=bias, dtype=torch.bfloat16)
    layer.weight.data = (0.1 * torch.randn(64, 96, generator=g)).to(torch.bfloat16)
    if bias:
        layer.bias.data = torch.randn(64, generator=g).to(torch.bfloat16)
    w = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    packed_by = "keel" if mode == "keel" else "onednn-upcast"
    assert layer.packed_by == packed_by and layer.weight.numel() == 0
    assert layer.packed_weight.dtype == (torch.bfloat16 if mode == "keel" else torch.float32)
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), w.float(), None if not bias else layer.bias.float())
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-3)
    head = ParallelLMHead(50, 96, dtype=torch.bfloat16)
    head.weight.data = (0.1 * torch.randn(50, 96, generator=g)).to(torch.bfloat16)
    hw = head.weight.detach().clone()
    head.process_weights_after_loading()
    assert head.packed_by == packed_by
    logits = head.compute_logits(x)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, (x.float() @ hw.float().T).to(torch.bfloat16).float(),
                          rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("onednn_faster_by", [1.1, 2.0])
def test_keel_gemm_choice(monkeypatch, onednn_faster_by):
    """auto: keel's GEMM on an AVX2 CPU without measuring; elsewhere measured once per
    process at a decode shape, keel's kept unless oneDNN's is faster by more than
    OWN_KERNEL_MARGIN (the hot measurement understates keel's lead from memory)."""
    from keel.model_executor.layers import gemm_choice as linear

    calls, made = [], []  # timings taken; timers made (each makes and packs a weight)

    def fake_timer(dtype, kernel="onednn", *args):
        made.append(kernel)

        def time():
            calls.append(kernel)
            return {"keel": onednn_faster_by, "onednn": 1.0}[kernel]
        return time

    monkeypatch.delenv("KEEL_CPU_GEMM", raising=False)
    monkeypatch.setattr(linear, "_gemm_timer", fake_timer)
    monkeypatch.setattr(linear, "_keel_gemm_faster", None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert linear.keel_gemm_chosen() and not calls
    monkeypatch.setattr(linear, "_keel_gemm_faster", None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    keel = onednn_faster_by < linear.OWN_KERNEL_MARGIN
    assert linear.keel_gemm_chosen() == keel and linear.keel_gemm_chosen() == keel
    assert sorted(calls) == ["keel"] * 5 + ["onednn"] * 5  # measured once, 5 rounds in turn
    assert sorted(made) == ["keel", "onednn"]  # each side's weight made and packed once
    layer = RowParallelLinear(32, 8)
    layer.weight.data = torch.randn(8, 32)
    layer.process_weights_after_loading()
    assert layer.packed_by == ("keel" if keel else "onednn")


def test_bf16_choice_is_measured_where_the_cpu_has_bf16(monkeypatch):
    """With native bfloat16 GEMMs the choice is a measurement, taken once per process: the
    slower precision loses."""
    from keel.model_executor.layers import amx_choice
    from keel.model_executor.layers import gemm_choice as linear

    calls = []

    def fake_timer(dtype, *args):
        return lambda: calls.append(dtype) or (2.0 if dtype == torch.bfloat16 else 1.0)

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True,
                        raising=False)
    monkeypatch.setattr(linear, "_gemm_timer", fake_timer)
    monkeypatch.setattr(linear, "_bf16_slower_than_fp32", None)
    # (keel's GEMM on AVX512-BF16's dots, the other side of the choice, is test_amx_gemm.py's)
    monkeypatch.setattr(amx_choice, "_dots_beat_float32", False)
    w = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert linear.bf16_gemm_in_float32(w) and linear.bf16_gemm_in_float32(w)
    assert len(calls) == 6  # measured once: 3 rounds, each precision in turn
    assert not linear.bf16_gemm_in_float32(torch.zeros(4, 4))  # float32 weights: never
