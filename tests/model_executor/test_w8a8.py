"""`quantization="w8a8"`: int8 weights per row and int8 activations per token (fbgemm), against
float32 within the stated bound; the per-token scaling keeps a small row as accurate as a large
one; a model keeps no dense copy of its linear layers, leaves its LM head dense and generates
(test_fused_decode.py shows its fused decode passes bit-identical to the Python layers)."""

from __future__ import annotations

import pytest
import torch

from keel.model_executor.layers.quantization import (
    W8A8Weight,
    dequantize,
    pack_w8a8,
    quantize_int8,
    quantized_linear,
)


def w8a8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - x W^T| per output: weights within max|W_n| / 254, each input within max|x_t| / 127
    (7-bit activations), their product, and float32 rounding."""
    _, s_w = quantize_int8(w)
    s_x = x.abs().amax(1, keepdim=True) / 127
    k = w.shape[1]
    return (x.abs() @ (s_w[:, None] / 2).expand_as(w).t() + s_x * w.abs().sum(1)
            + k * s_x * s_w / 2 + 1e-5 * (x.abs() @ w.abs().t()) + 1e-6)


def test_w8a8_within_its_bound_per_token():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 200, generator=g)
    w[:, 7] *= 20  # an outlier input channel
    x = torch.randn(37, 200, generator=g)
    x[3] *= 1e-3  # a row 1000x smaller than the others
    x[5, 11] = 300.0  # an outlier activation in one row
    bias = torch.randn(96, generator=g)
    layer = pack_w8a8(w)
    assert isinstance(layer, W8A8Weight) and layer.out_features == 96
    ref = x @ w.t()
    out = quantized_linear(x, layer, bias) - bias
    err = (out - ref).abs()
    assert (err <= w8a8_bound(x, w)).all()
    # One scale per token: the small row's error is as small, relative to it, as the others'
    # (one scale for the whole pass would have left it ~1000x less accurate).
    rel = err.amax(1) / ref.abs().amax(1)
    assert rel[3] < 5 * rel.median()
    q, s = quantize_int8(w)
    assert torch.allclose(dequantize(layer), q.float() * s[:, None])
    assert quantized_linear(x.bfloat16(), layer).dtype == torch.bfloat16


def test_w8a8_model_generates_without_dense_weights(hf_model_dir):
    from keel import LLM, SamplingParams
    from keel.model_executor.layers.linear import LinearBase
    from keel.model_executor.layers.vocab_embedding import ParallelLMHead

    folder = hf_model_dir("qwen3")
    dense = LLM(folder, dtype="float32", kv_cache_memory_gib=0.0625)
    quant = LLM(folder, dtype="float32", quantization="w8a8", kv_cache_memory_gib=0.0625)
    model = quant.engine_core.model_executor.driver_worker.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.quant, W8A8Weight) and not m.has_dense()
                           for m in linears)
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    assert all(getattr(h, "quant", None) is None for h in heads)  # the LM head stays dense
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 40, 77, 9 + i]} for i in range(6)]
    ref = dense.generate(prompts, params, use_tqdm=False)
    out = quant.generate(prompts, params, use_tqdm=False)
    assert model.model.fused_decode.plan  # decode passes ran in one C++ call
    # The first token mostly agrees with float32's, and its logprob is close where it does.
    same = 0
    for r, o in zip(ref, out):
        assert len(o.outputs[0].token_ids) == 12
        tok = r.outputs[0].token_ids[0]
        if o.outputs[0].token_ids[0] == tok:
            same += 1
            lp_r = r.outputs[0].logprobs[0][tok].logprob
            lp_o = o.outputs[0].logprobs[0][tok].logprob
            assert abs(lp_r - lp_o) < 0.5
    assert same >= 4
    dense.shutdown()
    quant.shutdown()


def test_w8a8_without_fbgemm_says_what_to_use(monkeypatch):
    from keel.model_executor.layers import quantization

    monkeypatch.setattr(quantization, "w8a8_available", lambda: False)
    with pytest.raises(NotImplementedError, match="int8"):
        quantization.pack_w8a8(torch.randn(8, 32))
