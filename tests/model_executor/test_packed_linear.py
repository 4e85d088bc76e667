"""oneDNN-packed weights on the CPU (layers/linear.py): what packing keeps and releases, that
packed layers compute what F.linear computes, and the switch that turns it off."""

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layers_compute_f_linear(dtype, bias):
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

        # float32 always packs; bfloat16 only where this CPU has native bf16 (else F.linear).
        should_pack = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        layer.process_weights_after_loading()
        assert (layer.packed_weight is not None) == should_pack
        if should_pack:
            assert layer.weight.numel() == 0, "the dense copy is released"
        got = layer(x)
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want).abs().max().item() < TOL[dtype] * want.abs().max().item()


def test_lm_head_keeps_a_tied_weight():
    emb_weight = torch.randn(50, 16)
    tied, untied = ParallelLMHead(50, 16), ParallelLMHead(50, 16)
    tied.weight.data.copy_(emb_weight)
    untied.weight.data.copy_(emb_weight)
    tied.tied = True
    x = torch.randn(3, 16)
    for head in (tied, untied):
        head.process_weights_after_loading()
        assert head.packed_weight is not None
        assert torch.allclose(head.compute_logits(x), x @ emb_weight.T, atol=1e-5)
    assert tied.weight.shape == (50, 16)  # the embedding still looks rows up in it
    assert untied.weight.numel() == 0


def test_switch_off_keeps_dense_weights(monkeypatch):
    monkeypatch.setenv("KEEL_ONEDNN_GEMM", "0")
    layer = RowParallelLinear(32, 8)
    layer.weight.data = torch.randn(8, 32)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None and layer.weight.shape == (8, 32)
    x = torch.randn(2, 32)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_loader_packs_every_linear(hf_model_dir):
    model = load_model(ModelConfig(hf_model_dir("llama"), dtype="float32"))
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert model.lm_head.packed_weight is not None
