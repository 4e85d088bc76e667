"""keel's fused CPU ops (keel/csrc/fused_ops.cpp) against the torch expressions they replace,
and the layers that use them against their own torch paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from keel import cpu_ops
from keel.model_executor.layers.layernorm import RMSNorm
from keel.model_executor.layers.rotary_embedding import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # float16: the kernels' generic path


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.get_cpu_ops()
    assert module is not None, "the CPU kernels must build on this machine"
    return module


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's precision at each value's magnitude."""
    eps = torch.finfo(a.dtype).eps
    a, b = a.float(), b.float()
    return ((a - b).abs() / (eps * b.abs().clamp_min(1e-3))).max().item()


def torch_rms_norm(x, w, eps):  # transformers' LlamaRMSNorm
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 40])  # 40: a tail after the 16-wide vectors
def test_rms_norm_and_fused_add(ops, dtype, n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, n, generator=g).to(dtype)
    res = torch.randn(37, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    assert ulps(ops.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5)) <= 4  # the variance sums in another order

    want_sum = x + res
    want = torch_rms_norm(want_sum, w, 1e-5)
    xi, ri = x.clone(), res.clone()
    ops.fused_add_rms_norm_(xi, ri, w, 1e-5)
    assert torch.equal(ri, want_sum)  # the add rounds exactly as torch's
    assert ulps(xi, want) <= 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_in_place_equals_torch_path(ops, monkeypatch, dtype, partial):
    """Strided q/k views of one fused qkv output, rotated in place: bit-identical to the torch
    expression (same roundings, no FMA), including partial rotary dims."""
    config = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": partial})
    head_dim, hq, hk = 64, 6, 2
    rope = RotaryEmbedding(config, head_dim, 512)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(23, (hq + 2 * hk) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 512, (23,), generator=g)

    monkeypatch.setattr("keel.model_executor.layers.rotary_embedding.cpu_ops_for",
                        lambda t: None)
    q, k, _ = qkv.clone().split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    want_q, want_k = rope(positions, q, k)
    monkeypatch.undo()

    buf = qkv.clone()
    q, k, v = buf.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the qkv buffer
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(v, qkv[:, (hq + hk) * head_dim:])  # v untouched


def test_rotary_rejects_positions_outside_the_cache(ops):
    cos = torch.ones(8, 64)
    q, k = torch.zeros(2, 64), torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="outside the RoPE cache"):
        ops.rotary_neox_(torch.tensor([3, 8]), q, k, cos, cos, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(ops, dtype):
    g = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(19, 2 * 1544, generator=g)).to(dtype)  # 1544: a tail of 8
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # saturated and zero lanes
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_and_mul(x)
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    else:  # one rounding of silu may land on the neighbouring 16-bit value
        rtol = 2 * torch.finfo(dtype).eps
        assert torch.allclose(got.float(), want.float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_layer_kernel_and_torch_paths_agree(monkeypatch, dtype):
    norm = RMSNorm(64, 1e-6, dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(64)).to(dtype)
    x, res = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    got_x, got_res = norm(x.clone(), res.clone())
    monkeypatch.setattr("keel.model_executor.layers.layernorm.cpu_ops_for", lambda t: None)
    want_x, want_res = norm(x, res)
    assert torch.equal(got_res, want_res)
    assert ulps(got_x, want_x) <= 4


def test_argmax_rows_equals_torch(ops):
    """keel's greedy argmax: the same index as torch's, with ties (the first), NaN (the first
    NaN), +-inf, a row of -inf, and widths that are not a multiple of 8."""
    x = torch.randn(11, 49157)
    x[1, 100] = float("nan")
    x[1, 50] = float("inf")
    x[2, 7] = x[2, 9] = x[2].max() + 1
    x[3, -1] = 1e9
    x[4] = -float("inf")
    x[5, 3] = x[5, 3 + 8] = float("nan")
    x[6] = 0.0
    x[7, 21] = x[7, 35] = x[7, 40_001] = 50.0  # equal maxima in lanes 5 and 3: the first index
    x[8, 4] = x[8, -1] = 50.0  # the tail past the last 16 ties the maximum
    x[9, -2] = 50.0  # the maximum only in the tail
    x[10, 16 * 3000 + 15] = 50.0  # in the last lane
    for t in (x, torch.randn(3, 5), torch.randn(4, 8), torch.randn(1, 1), torch.randn(2, 16),
              torch.randn(2, 17), -torch.arange(40.0).repeat(2, 1)):
        assert torch.equal(ops.argmax_rows(t), t.argmax(-1))
        # bfloat16 (a greedy step's LM head output): its float32 upcast's index, ties
        # included (rounding makes many)
        b = t.bfloat16()
        assert torch.equal(ops.argmax_rows(b), b.float().argmax(-1))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.argmax_rows(x.t())


def test_bfloat16_rounding_of_denormals_and_nan_is_torchs(ops):
    """A vector with a denormal or NaN lane rounds with integer operations (the one-instruction
    conversion reads denormals as zero and keeps NaN payloads): the add of fused_add_rms_norm_
    gives torch's bits there too, the lanes beside them included."""
    tiny = torch.finfo(torch.float32).tiny
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    res = torch.zeros(4, 64, dtype=torch.bfloat16)
    x[0, :16] = torch.tensor([tiny / 4, -tiny / 8, tiny * 0.75] + [1.5] * 13).bfloat16()
    x[1, 16:32] = float("nan")
    x[2] = torch.randn(64).bfloat16()  # normal lanes only: the one-instruction path
    x[3, 5] = tiny / 2
    res[:] = torch.randn(4, 64).bfloat16()
    res[0, :3] = 0
    res[3, 5] = 0
    want = x + res
    assert (want[0, :3] != 0).all() and want[0, :3].float().abs().max() < tiny  # denormals
    got_x, got_res = x.clone(), res.clone()
    ops.fused_add_rms_norm_(got_x, got_res, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(got_res[[0, 2, 3]], want[[0, 2, 3]])
    assert got_res[1, 16:32].isnan().all()
    assert torch.equal(got_res[1, :16], want[1, :16]) and torch.equal(got_res[1, 32:], want[1, 32:])
