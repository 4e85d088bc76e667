"""Weights kept quantized: each GGUF type's layer against the dequantized float32 computation
on the same weights, within the bound its format and keel's kernels imply; int8/int4 of HF
weights; odd shapes; the per-pass choice between the kernel and the dense weight.

The bounds, per output element (x the input row, W the float32 weights gguf dequantizes to):
- int4 from Q4_0 / Q4_1 / Q4_K (the file's own 4-bit values, no requantization): the kernels
  compute with bfloat16 inputs, scales and zeros, so each product carries at most ~3 roundings
  of 2^-8 relative to its group's largest weight: |err| <= 3 * 2^-8 * |x| . gmax(W) (+ float
  accumulation).
- int8 per row from Q8_0 / Q6_K, or from float weights: requantization adds |dW| <= s / 2
  with s = max_k |W[n, k]| / 127, on top of the bfloat16 roundings:
  |err| <= |x| . (s / 2 + 3 * 2^-8 |W|).
- int4 of float weights (min/max per group): |dW| <= (max - min) / 30 per group, plus the
  roundings above.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from keel.model_executor.gguf_quant import int4_groups
from keel.model_executor.layers.quantization import (
    ALL_ROWS,
    dequantize,
    pack_int4,
    pack_int8,
    quantize_int4,
    quantize_int8,
    quantized_linear,
)

EPS = 3 * 2.0**-8


def random_gguf(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A tensor's raw blocks: quantized by gguf where it has a quantizer, else random block
    bytes with sane fp16 scales (the K-quants)."""
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    if type_name == "Q4_K":
        blocks[:, 0:2] = np.float16(0.004).reshape(1).view(np.uint8)
        blocks[:, 2:4] = np.float16(0.002).reshape(1).view(np.uint8)
    else:  # Q6_K: d is the last two bytes
        blocks[:, -2:] = np.float16(0.0015).reshape(1).view(np.uint8)
    return blocks.reshape(n, -1)


def group_max(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    n, k = w.shape
    return w.abs().reshape(n, k // group, group).amax(-1).repeat_interleave(group, dim=1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_gguf_layer_against_dequantized_float32(type_name, rows):
    n, k = 100, 512  # N not a multiple of 64
    data = random_gguf(type_name, n, k)
    w = torch.from_numpy(gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType,
                                                              type_name)).reshape(n, k).copy())
    groups = int4_groups(data, type_name, (n, k))
    if groups is not None:
        q, scale, zero = (torch.from_numpy(np.ascontiguousarray(a)) for a in groups)
        layer = pack_int4(q.to(torch.int32), scale, zero, 32)
        per_weight = EPS * group_max(w)
    else:
        qi, s = quantize_int8(w)
        layer = pack_int8(qi, s)
        per_weight = s[:, None] / 2 + EPS * w.abs()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = quantized_linear(x, layer)
    ref = x @ w.t()
    bound = x.abs() @ per_weight.t() + 1e-4
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got - ref).abs() <= bound).all(), (got - ref).abs().max()
    # The bound is not vacuous: the error is far below the output's own size.
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("n,k,group", [(100, 96, 64), (64, 200, 32), (33, 128, 128)])
def test_int4_of_float_weights_odd_shapes(n, k, group):
    """K not a multiple of the group (96 with groups of 64; 200 with 32) is padded with zero
    columns; N not a multiple of 64."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    k_pad = -(-k // group) * group
    q, scale, zero = quantize_int4(torch.nn.functional.pad(w, (0, k_pad - k)), group)
    layer = pack_int4(q[:, :k], scale, zero, group)
    wq = dequantize(layer)
    assert wq.shape == (n, k)
    spread = (scale * 15).repeat_interleave(group, dim=1)[:, :k]  # max - min of the group
    assert ((wq - w).abs() <= spread / 30 + EPS * group_max(
        torch.nn.functional.pad(w, (0, k_pad - k)), group)[:, :k] + 1e-6).all()
    x = torch.randn(5, k)
    bound = x.abs() @ (spread / 30 + EPS * w.abs() + EPS * spread).t() + 1e-4
    assert ((quantized_linear(x, layer) - x @ w.t()).abs() <= bound).all()


def test_int8_of_float_weights_and_bias():
    w = torch.randn(70, 96)
    bias = torch.randn(70)
    q, s = quantize_int8(w)
    layer = pack_int8(q, s)
    x = torch.randn(3, 96)
    bound = x.abs() @ (s[:, None] / 2 + EPS * w.abs()).t() + 1e-4
    assert ((quantized_linear(x, layer, bias) - (x @ w.t() + bias)).abs() <= bound).all()
    assert quantized_linear(x.bfloat16(), layer).dtype == torch.bfloat16


def test_each_pass_goes_where_max_rows_says(monkeypatch, hf_model_dir):
    """A layer with both forms takes the kernel up to max_rows rows and the dense GEMM above;
    a layer whose dense weight was released always takes the kernel."""
    from keel.model_executor.layers import linear as linear_mod
    from keel.model_executor.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(64, 96, dtype=torch.float32)
    torch.nn.init.normal_(layer.weight)
    layer.quant = pack_int8(*quantize_int8(layer.weight.data))
    layer.process_weights_after_loading()  # packs the dense weight too
    layer.quant.max_rows = 8
    calls = []
    real = linear_mod.quantized_linear
    monkeypatch.setattr(linear_mod, "quantized_linear",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for rows in (1, 8, 9, 64):
        layer(torch.randn(rows, 64))
    assert calls == [1, 8]
    layer.packed_weight, layer.quant.max_rows = None, ALL_ROWS
    layer(torch.randn(64, 64))
    assert calls == [1, 8, 64]


def test_quantization_option_errors(hf_model_dir):
    from keel.config import ModelConfig

    folder = hf_model_dir("llama")
    with pytest.raises(ValueError, match="needs a .gguf"):
        ModelConfig(folder, quantization="gguf")
    with pytest.raises(ValueError, match="Unknown quantization"):
        ModelConfig(folder, quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size"):
        ModelConfig(folder, quantization="int8", quantization_group_size=64)
    assert ModelConfig(folder).quantization_method is None  # a HF folder stays dense
    assert ModelConfig(folder, quantization="int4").quantization_method == "int4"


def activation_error(x: torch.Tensor, parts: int, deinterleave: bool) -> torch.Tensor:
    """The most each input of x may move when keel's kernels take it in `parts` int8 parts per
    group of 32 (s = amax / 127 of the group; s / 2 for one part, s / 508 for two)."""
    if parts == 0:
        return torch.zeros_like(x)
    rows, k = x.shape
    s = x.abs().reshape(rows, k // 32, 32).amax(-1) / 127
    return (s / (2 if parts == 1 else 508)).repeat_interleave(32, dim=1)


@pytest.mark.parametrize("k", [544, 576])
@pytest.mark.parametrize("parts", [0, 1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_keel_kernels_against_torch_kernels(rows, parts, k, monkeypatch):
    """keel's kernels (csrc/quant_gemm.cpp; with int8 activations quant_gemm_q8.cpp, whose
    AVX512-VNNI form takes groups in pairs: K = 544 leaves an odd last group, 576 none) against
    the float32 computation on the same
    weights, with float32 activations (parts 0: to float accumulation) and with activations
    in one or two int8 parts per group of 32 (within what their rounding can move: the
    bound is sum_k |W[n, k]| err[k], err from activation_error), and torch's kernels (the
    fallback) as a second oracle within its bfloat16 bound. 9 rows: split in calls of 4."""
    from keel.model_executor.layers import quantization as qmod

    assert qmod._keel_ops() is not None, "keel's CPU kernels should build on this machine"
    n = 200  # K a multiple of 32, not of 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    q, scale, zero = quantize_int4(w, 32)
    q8, s8 = quantize_int8(w)
    keel4, keel8 = pack_int4(q, scale, zero, 32), pack_int8(q8, s8)
    assert keel4.keel is not None and keel4.packed is None and keel8.scales_f32 is not None
    monkeypatch.setattr(qmod, "_keel_ops", lambda: None)
    torch4, torch8 = pack_int4(q, scale, zero, 32), pack_int8(q8, s8)
    assert torch4.keel is None and torch8.scales_f32 is None
    monkeypatch.undo()
    x = torch.randn(rows, k)
    x[:, 7] = 30.0  # an outlier channel, as LLM activations have
    w4 = ((q.reshape(n, -1, 32) - 8) * scale[..., None] + zero[..., None]).reshape(n, k)
    w8 = q8.float() * s8[:, None]
    for keel_w, torch_w, wf in ((keel4, torch4, w4), (keel8, torch8, w8)):
        ref = x @ wf.t()
        got = quantized_linear(x, keel_w, activation_parts=parts)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        err = (got - ref).abs()
        float_part = 1e-4 * (x.abs() @ wf.abs().t()).max()
        assert (err <= activation_error(x, parts, True) @ wf.abs().t() + float_part).all()
        if parts == 1 and keel_w is keel4:  # the bound is not vacuous: one part does round
            assert err.max() > 10 * float_part
        bound = x.abs() @ (EPS * (group_max(w) + wf.abs())).t() + 1e-4
        assert ((quantized_linear(x, torch_w) - ref).abs() <= bound).all()


def test_activation_parts_option(monkeypatch):
    from keel.model_executor.layers.quantization import activation_parts_from_env

    assert activation_parts_from_env() == 2  # int16 by default
    monkeypatch.setenv("KEEL_QUANT_ACTIVATIONS", "int8")
    assert activation_parts_from_env() == 1
    monkeypatch.setenv("KEEL_QUANT_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="KEEL_QUANT_ACTIVATIONS='int4': use one of int16"):
        activation_parts_from_env()
