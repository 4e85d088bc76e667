"""keel's float16-FMA GEMM (keel/csrc/fp16_gemm.cpp, for CPUs with AVX512-FP16 and no AMX,
where dtype="auto" runs a float32 model's GEMMs on it): against a float64 reference, closer
than bfloat16 arithmetic is, on decode and prompt shapes with partial tiles, odd K and N; no
float16 sum overflows, however large x is; silu in the epilogue gives silu_and_mul's bits;
passes of many rows go in blocks and give each row's own result; the packing and the arguments
are checked. Where the build has no AVX512-FP16 the
op says so and raises (the test checks that instead)."""

from __future__ import annotations

import pytest
import torch

from keel.cpu_ops import get_cpu_ops


@pytest.fixture(scope="module")
def ops():
    ops = get_cpu_ops()
    assert ops is not None, "the CPU kernels must build on this machine"
    assert ops.fp16_gemm_available() == ("avx512_fp16" in ops.built_for())
    return ops


def bf16_arithmetic(x, w, b):
    """What bfloat16 arithmetic gives: inputs rounded to bfloat16, float32 sums."""
    out = x.bfloat16().float() @ w.bfloat16().float().t()
    return out if b is None else out + b


@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (5, 960, 576), (10, 576, 576), (23, 40, 33),
                                     (64, 3072, 576), (64, 576, 1536), (130, 112, 300),
                                     (7, 16, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_reference(ops, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g) if with_bias else None
    packed, w_max = ops.fp16_gemm_pack(w)
    assert packed.dtype == torch.float16 and tuple(packed.shape) == ((n + 15) // 16,
                                                                      (k + 1) // 2, 32)
    assert w_max == w.float().abs().max().item()
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    if not ops.fp16_gemm_available():
        with pytest.raises(RuntimeError, match="AVX512-FP16"):
            ops.fp16_gemm(x, packed, n, w_max, b)
        return
    out = ops.fp16_gemm(x, packed, n, w_max, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    err = (out.double() - ref).abs()
    bf16_err = (bf16_arithmetic(x, w.float(), b).double() - ref).abs()
    scale = ref.abs().max().item()
    # Within float16's rounding of x and of sums of <= 128 products: on average closer than
    # bfloat16 arithmetic (0.7x here: x keeps 11 bits, not 8), at worst about as close.
    assert err.max().item() <= 4e-3 * scale + 1e-6, (err.max().item(), scale)
    if k > 1:
        assert err.mean().item() < 0.85 * bf16_err.mean().item(), (err.mean(), bf16_err.mean())
        assert err.max().item() < 1.25 * bf16_err.max().item(), (err.max(), bf16_err.max())


def test_no_float16_sum_overflows(ops):
    """Rows of very different sizes (1e-3 to 1e6, far past float16's 65504), a zero row and a
    float32 weight: each row's power-of-two scale keeps every float16 sum finite."""
    g = torch.Generator().manual_seed(0)
    k, n = 1536, 96
    x = torch.randn(6, k, generator=g) * torch.tensor([1e-3, 1.0, 3e2, 1e4, 1e6, 0.0])[:, None]
    x[3, 7] = 6e5  # one outlier in a row
    w = torch.randn(n, k, generator=g) * 2.0
    packed, w_max = ops.fp16_gemm_pack(w)
    if not ops.fp16_gemm_available():
        with pytest.raises(RuntimeError, match="AVX512-FP16"):
            ops.fp16_gemm(x, packed, n, w_max)
        return
    out = ops.fp16_gemm(x, packed, n, w_max)
    assert torch.isfinite(out).all()
    ref = x.double() @ w.half().double().t()
    for r in range(6):
        scale = ref[r].abs().max().item()
        err = (out[r].double() - ref[r]).abs().max().item()
        assert err <= 4e-3 * scale + 1e-30, (r, err, scale)
    assert (out[5] == 0).all()


def test_arguments_are_checked(ops):
    w = torch.randn(32, 64)
    packed, w_max = ops.fp16_gemm_pack(w)
    with pytest.raises(RuntimeError, match="float16 cannot hold"):
        ops.fp16_gemm_pack(torch.full((16, 8), 1e5))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.fp16_gemm_pack(w.half())
    if not ops.fp16_gemm_available():
        return
    with pytest.raises(RuntimeError, match=r"packed must be fp16_gemm_pack's"):
        ops.fp16_gemm(torch.randn(4, 62), packed, 32, w_max)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ops.fp16_gemm(torch.randn(4, 64).bfloat16(), packed, 32, w_max)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.fp16_gemm(torch.randn(4, 64), packed, 32, w_max, torch.randn(31))
    assert ops.fp16_gemm(torch.randn(0, 64), packed, 32, w_max).shape == (0, 32)


@pytest.mark.parametrize("m", [1, 9, 64, 300, 700])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_mul_in_the_epilogue(ops, m, with_bias):
    """silu_mul over a [gate; up] weight interleaved by 16 (gemm_choice.silu_pair_order, bias
    alike): silu(gate) * up of the plain GEMM's columns put back in order, bit for bit (the
    same sums, then silu_and_mul's silu16); passes past one block of 256 rows too."""
    from keel.model_executor.layers.gemm_choice import silu_pair_order

    if not ops.fp16_gemm_available():
        return
    g = torch.Generator().manual_seed(m)
    inter, k = 96, 200
    x = torch.randn(m, k, generator=g)
    w = torch.randn(2 * inter, k, generator=g) * 0.05
    b = torch.randn(2 * inter, generator=g) if with_bias else None
    order = silu_pair_order(2 * inter)
    packed, w_max = ops.fp16_gemm_pack(w[order])
    bo = None if b is None else b[order].contiguous()
    fused = ops.fp16_gemm(x, packed, 2 * inter, w_max, bo, True)
    plain = ops.fp16_gemm(x, packed, 2 * inter, w_max, bo).index_select(1, torch.argsort(order))
    assert fused.shape == (m, inter)
    assert torch.equal(fused, ops.silu_and_mul(plain))
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    ref = torch.nn.functional.silu(ref[:, :inter]) * ref[:, inter:]
    assert (fused.double() - ref).abs().max().item() <= 4e-3 * ref.abs().max().item()
    with pytest.raises(RuntimeError, match="whole pairs"):
        ops.fp16_gemm(x, ops.fp16_gemm_pack(w[:48])[0], 48, w_max, None, True)


def test_rows_past_a_block_and_a_reused_buffer(ops):
    """Passes of many rows (blocks of 256) give each row what a pass of that row alone gives;
    the float16 copy of x is kept from one call to the next, and a smaller call with an odd K
    after a larger one reads nothing of the last call's rows."""
    if not ops.fp16_gemm_available():
        return
    g = torch.Generator().manual_seed(3)
    w = torch.randn(80, 577, generator=g) * 0.05
    packed, w_max = ops.fp16_gemm_pack(w)
    x = torch.randn(1000, 577, generator=g)
    big = ops.fp16_gemm(x, packed, 80, w_max)
    for r in (0, 255, 256, 511, 999):
        assert torch.equal(big[r], ops.fp16_gemm(x[r : r + 1].clone(), packed, 80, w_max)[0])
    assert torch.equal(big[300:310], ops.fp16_gemm(x[300:310].clone(), packed, 80, w_max))
    # K = 577 fills the last pair's second lane with 0, not with the previous call's value:
    # that call leaves inf there (its column 577), which times the weight's zero lane would
    # make every output NaN.
    stale = torch.full((1000, 578), 7.0)
    stale[:, 577] = float("inf")
    ops.fp16_gemm(stale, ops.fp16_gemm_pack(torch.ones(80, 578))[0], 80, 1.0)
    out = ops.fp16_gemm(x[:4].clone(), packed, 80, w_max)
    assert torch.isfinite(out).all()
    ref = x[:4].double() @ w.half().double().t()
    assert (out.double() - ref).abs().max() < 5e-3
