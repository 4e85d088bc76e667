"""keel's int16 dot-product GEMM (keel/csrc/i16_gemm.cpp, for CPUs with AVX512-VNNI and
neither AMX nor AVX512-FP16, where dtype="auto" runs a float32 model's GEMMs on it): the
packing is W's blocks of 128 values of k as int16 (round half to even of w * 11585 / amax, or
of a smaller step where the block's |int16| values would sum past 185,367) with their scales,
computed here in torch; the product is the blocks' exact int32 sums scaled and summed in
float32, against a float64 reference of those same int16 values, and much closer to the exact
product than bfloat16 arithmetic is; no int32 sum overflows at the largest values;
a NaN or an infinity in x makes its row's outputs NaN; silu in the epilogue gives
silu_and_mul's bits; passes of many rows go in blocks. Where the build has no AVX512-VNNI the op
says so and raises (the test checks that instead)."""

from __future__ import annotations

import pytest
import torch

from keel.cpu_ops import get_cpu_ops

Q = 11585.0  # the largest int16 magnitude a block is scaled to
BLOCK = 128  # values of k per scaled block
L1_MAX = 185367  # the largest sum of a W block's |int16| values: Q * L1_MAX < 2^31
L1_TARGET = L1_MAX - 256.0  # a W block past L1_MAX is scaled again to about this sum


@pytest.fixture(scope="module")
def ops():
    ops = get_cpu_ops()
    assert ops is not None, "the CPU kernels must build on this machine"
    assert ops.i16_gemm_available() == ("avx512_vnni" in ops.built_for())
    return ops


def quantize(v: torch.Tensor, weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of v [R, K] (float32) in blocks of 128: the int16 values [R, K] and each block's
    scale [R, blocks], as the kernel computes them (float32 products, ties to even). A weight's
    block whose |int16| values sum past L1_MAX takes the step floor(Q * L1_TARGET / sum)."""
    r, k = v.shape
    blocks = (k + BLOCK - 1) // BLOCK
    padded = torch.zeros(r, blocks * BLOCK)
    padded[:, :k] = v
    b = padded.view(r, blocks, BLOCK)
    amax = b.abs().amax(-1)
    kq = torch.full_like(amax, Q)

    def steps(kq):
        inv = torch.where(amax > 0, kq / amax, torch.zeros(()))
        return torch.maximum(torch.minimum(torch.round(b * inv[..., None]), kq[..., None]),
                             -kq[..., None])

    q = steps(kq)
    if weight:
        l1 = q.abs().sum(-1, dtype=torch.float64)  # exact: integers below 2^53
        over = l1 > L1_MAX
        kq = torch.where(over, torch.floor(Q * L1_TARGET / l1).float(), kq)
        q = steps(kq)
    return q.view(r, -1)[:, :k].to(torch.int16), torch.where(amax > 0, amax / kq, amax)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The float64 product of the int16 blocks, scaled: what the kernel sums in float32."""
    qx, sx = quantize(x)
    qw, sw = quantize(w, weight=True)
    k = x.shape[1]
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for blk in range(sx.shape[1]):
        cols = slice(blk * BLOCK, min(k, (blk + 1) * BLOCK))
        exact = qx[:, cols].double() @ qw[:, cols].double().t()
        out += exact * sx[:, blk, None].double() * sw[None, :, blk].double()
    return out if b is None else out + b.double()


@pytest.mark.parametrize("k", [300, 301])  # an odd number of pairs; an odd k's last pair
def test_packing_is_the_blocks_int16_values(ops, k):
    g = torch.Generator().manual_seed(1)
    n = 40  # a partial panel, and k a partial block
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] = 0.0  # a column of zeros: scale 0, values 0
    w[5, :BLOCK] = torch.where(torch.rand(BLOCK, generator=g) < 0.5, -0.3, 0.3)  # past L1_MAX
    packed, scales = ops.i16_gemm_pack(w)
    assert packed.dtype == torch.int16 and tuple(packed.shape) == (3, (k + 1) // 2, 32)
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (3, 3, 16)
    q, s = quantize(w, weight=True)
    for j in range(n):
        p, lane = divmod(j, 16)
        col = packed[p, :, 2 * lane : 2 * lane + 2].reshape(-1)
        assert torch.equal(col[:k], q[j]), j
        assert (col[k:] == 0).all(), j  # the pad of an odd k's last pair
        assert torch.equal(scales[p, :, lane], s[j]), j
    assert (packed[2, :, 16:] == 0).all() and (scales[2, :, 8:] == 0).all()  # padding columns
    assert packed.abs().max().item() == Q  # (a block of few values keeps the largest step)
    # Column 5's first block, all at its largest |value|, took the smaller step.
    col5 = packed[0, : BLOCK // 2, 10:12].reshape(-1).abs()
    assert (col5 == 1446).all()  # floor(11585 * 185111 / (128 * 11585))
    for p in range(3):  # no block's |int16| values sum past L1_MAX
        for blk in range(0, (k + 1) // 2, BLOCK // 2):
            assert packed[p, blk : blk + BLOCK // 2].view(-1, 16, 2).abs().sum((0, 2)).max() <= L1_MAX


@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (5, 960, 576), (10, 576, 576), (23, 40, 33),
                                     (64, 3072, 576), (64, 576, 1536), (130, 112, 300),
                                     (7, 16, 1), (300, 112, 300), (260, 3072, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_reference(ops, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)
    x[0, 0] = 30.0  # an outlier: it costs only its own block's precision
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if with_bias else None
    packed, scales = ops.i16_gemm_pack(w)
    if not ops.i16_gemm_available():
        with pytest.raises(RuntimeError, match="AVX512-VNNI"):
            ops.i16_gemm(x, packed, scales, n, b)
        return
    out = ops.i16_gemm(x, packed, scales, n, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    ref = reference(x, w, b)
    # Only float32's rounding of the blocks' scaled sums apart from the int16 reference.
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    err = (out.double() - exact).abs()
    bf16 = x.bfloat16().float() @ w.bfloat16().float().t() + (b if b is not None else 0)
    bf16_err = (bf16.double() - exact).abs()
    if k > 1:  # (K = 1: both exact up to float32)
        assert err.mean().item() < 0.25 * bf16_err.mean().item(), (err.mean(), bf16_err.mean())
        assert err.max().item() < 0.5 * bf16_err.max().item(), (err.max(), bf16_err.max())


def test_no_int32_sum_overflows(ops):
    """A W block whose |int16| values sum to L1_MAX exactly, against x's largest values of
    either sign, reaches the largest sum a block can: 11585 * 185,367 = 2,147,476,695 < 2^31.
    A block with every value at its largest (whose sum at 11585 would be 128 * 11585^2 ~ 2^34)
    is packed with a smaller step instead, and gives its exact product too."""
    if not ops.i16_gemm_available():
        return
    k = 3 * BLOCK
    # Per block: 16 values at the block's largest, one of 7 steps, the rest 0.
    w = torch.zeros(16, k)
    for b0 in range(0, k, BLOCK):
        w[:, b0 : b0 + 16] = 1.0
        w[:, b0 + 16] = 7 / Q
    packed, scales = ops.i16_gemm_pack(w)
    assert packed[0, : BLOCK // 2, 0:2].abs().sum().item() == L1_MAX  # not scaled again
    x = torch.stack([torch.ones(k), -torch.ones(k) * 1e6])
    out = ops.i16_gemm(x, packed, scales, 16)
    exact = reference(x, w, None)
    assert torch.allclose(out.double(), exact, rtol=1e-6)
    assert torch.allclose(out[0], torch.full((16,), 3 * (16 + 7 / Q)), rtol=1e-6)
    k = 4 * BLOCK
    x = torch.stack([torch.ones(k), -torch.ones(k) * 1e6, torch.full((k,), 3e-30)])
    w = torch.ones(32, k)
    packed, scales = ops.i16_gemm_pack(w)
    out = ops.i16_gemm(x, packed, scales, 32)
    # (the scales 1 / 5792 are not exact in float32: within float32's rounding of them)
    assert torch.allclose(out[0], torch.full((32,), float(k)), rtol=1e-6)
    assert torch.allclose(out[1], torch.full((32,), -1e6 * k), rtol=1e-6)
    assert torch.allclose(out[2], torch.full((32,), 3e-30 * k), rtol=1e-5)


def test_non_finite_x_gives_nan_rows(ops):
    if not ops.i16_gemm_available():
        return
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 130, generator=g)
    x[1, 70] = float("nan")
    x[2, 3] = float("inf")
    w = torch.randn(24, 130, generator=g)
    packed, scales = ops.i16_gemm_pack(w)
    out = ops.i16_gemm(x, packed, scales, 24)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[3]).all()
    with pytest.raises(RuntimeError, match="not finite"):
        ops.i16_gemm_pack(torch.full((16, 8), float("inf")))


def test_arguments_are_checked(ops):
    w = torch.randn(32, 64)
    packed, scales = ops.i16_gemm_pack(w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.i16_gemm_pack(w.half())
    if not ops.i16_gemm_available():
        return
    with pytest.raises(RuntimeError, match=r"packed must be i16_gemm_pack's"):
        ops.i16_gemm(torch.randn(4, 62), packed, scales, 32)
    with pytest.raises(RuntimeError, match=r"scales must be"):
        ops.i16_gemm(torch.randn(4, 64), packed, scales[:, :0], 32)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ops.i16_gemm(torch.randn(4, 64).bfloat16(), packed, scales, 32)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.i16_gemm(torch.randn(4, 64), packed, scales, 32, torch.randn(31))
    assert ops.i16_gemm(torch.randn(0, 64), packed, scales, 32).shape == (0, 32)
    # K = 0: no block of k; the product is the bias alone
    empty_packed, empty_scales = ops.i16_gemm_pack(torch.randn(32, 0))
    bias = torch.randn(32)
    for m in (3, 300):
        assert torch.equal(ops.i16_gemm(torch.randn(m, 0), empty_packed, empty_scales, 32, bias),
                           bias.expand(m, 32))


@pytest.mark.parametrize("m", [1, 9, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_mul_in_the_epilogue(ops, m, with_bias):
    """silu_mul over a [gate; up] weight interleaved by 16 (gemm_choice.silu_pair_order, bias
    alike): silu(gate) * up of the plain GEMM's columns put back in order, bit for bit."""
    from keel.model_executor.layers.gemm_choice import silu_pair_order

    if not ops.i16_gemm_available():
        return
    g = torch.Generator().manual_seed(m)
    inter, k = 96, 200
    x = torch.randn(m, k, generator=g)
    w = torch.randn(2 * inter, k, generator=g) * 0.05
    b = torch.randn(2 * inter, generator=g) if with_bias else None
    order = silu_pair_order(2 * inter)
    packed, scales = ops.i16_gemm_pack(w[order])
    bo = None if b is None else b[order].contiguous()
    fused = ops.i16_gemm(x, packed, scales, 2 * inter, bo, True)
    plain = ops.i16_gemm(x, packed, scales, 2 * inter, bo).index_select(1, torch.argsort(order))
    assert fused.shape == (m, inter)
    assert torch.equal(fused, ops.silu_and_mul(plain))
    with pytest.raises(RuntimeError, match="whole pairs"):
        ops.i16_gemm(x, *ops.i16_gemm_pack(w[:48]), 48, None, True)


def test_rows_past_a_block_and_a_reused_buffer(ops):
    """Passes of many rows (blocks of 256) give each row what a pass of that row alone gives;
    a smaller call with an odd K after a larger one reads nothing of the last call's rows."""
    if not ops.i16_gemm_available():
        return
    g = torch.Generator().manual_seed(3)
    w = torch.randn(80, 577, generator=g) * 0.05
    packed, scales = ops.i16_gemm_pack(w)
    x = torch.randn(1000, 577, generator=g)
    big = ops.i16_gemm(x, packed, scales, 80)
    for r in (0, 255, 256, 511, 999):
        assert torch.equal(big[r], ops.i16_gemm(x[r : r + 1].clone(), packed, scales, 80)[0])
    # K = 577's last pair has 0 as its second value, not the previous call's column 577.
    stale = torch.full((1000, 578), 7.0)
    ops.i16_gemm(stale, *ops.i16_gemm_pack(torch.ones(80, 578)), 80)
    out = ops.i16_gemm(x[:4].clone(), packed, scales, 80)
    assert torch.equal(out, big[:4])


@pytest.mark.parametrize("m,n,n_valid", [(1, 16, 16), (7, 100, 90), (64, 1000, 1000),
                                         (300, 520, 517)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_argmax_is_torchs_argmax_of_the_output(ops, m, n, n_valid, with_bias):
    """i16_gemm_argmax (greedy sampling in the LM head): each row's index of its largest value
    among columns [0, n_valid) of i16_gemm's output, as torch.argmax gives it, in pairs of panels
    (a decode pass) and groups of 4 (300 rows)."""
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, 130, generator=g)
    w = torch.randn(n, 130, generator=g) * 0.05
    b = torch.randn(n, generator=g) if with_bias else None
    packed, scales = ops.i16_gemm_pack(w)
    if not ops.i16_gemm_available():
        with pytest.raises(RuntimeError, match="needs AVX512-VNNI"):
            ops.i16_gemm_argmax(x, packed, scales, n, n_valid, b)
        return
    want = ops.i16_gemm(x, packed, scales, n, b)[:, :n_valid].argmax(-1)
    assert torch.equal(ops.i16_gemm_argmax(x, packed, scales, n, n_valid, b), want)


def test_argmax_ties_nans_and_arguments(ops):
    """Equal values give the first column, whichever thread saw it; a NaN row gives its first
    NaN, as torch.argmax; n_valid out of (0, N] is refused."""
    if not ops.i16_gemm_available():
        return
    g = torch.Generator().manual_seed(11)
    w = torch.randn(40, 64, generator=g)
    w = torch.cat([w, w, w, w])  # columns c, c + 40, c + 80 and c + 120 are equal
    x = torch.randn(70, 64, generator=g)
    x[5, 3] = float("nan")
    packed, scales = ops.i16_gemm_pack(w)
    out = ops.i16_gemm(x, packed, scales, 160)
    got = ops.i16_gemm_argmax(x, packed, scales, 160, 160)
    assert torch.equal(got, out.argmax(-1))
    assert got[5] == 0 and (got < 40).all()
    assert torch.equal(ops.i16_gemm_argmax(x, packed, scales, 160, 70),
                       out[:, :70].argmax(-1))
    for bad in (0, 161):
        with pytest.raises(RuntimeError, match="0 < n_valid <= N"):
            ops.i16_gemm_argmax(x, packed, scales, 160, bad)
    assert ops.i16_gemm_argmax(x[:0], packed, scales, 160, 160).shape == (0,)


def test_non_temporal_weight_prefetch_gives_the_same_bits(ops):
    """A decode pass prefetches the next weights with the non-temporal hint on AMD and into L2
    elsewhere (KEEL_GEMM_PREFETCH_NTA unset; i16_gemm.cpp says why); a prefetch moves no data
    the arithmetic sees, so plain, SiLU and argmax passes give the same bits either way, at
    decode sizes (one block of rows, the hint's) and past them."""
    import os

    from keel.model_executor.layers.gemm_choice import silu_pair_order

    default = ops.gemm_prefetch_nta()
    if os.environ.get("KEEL_GEMM_PREFETCH_NTA") is None:
        with open("/proc/cpuinfo") as f:
            assert default == ("AuthenticAMD" in f.read())
    if not ops.i16_gemm_available():
        return
    g = torch.Generator().manual_seed(11)
    w = torch.randn(192, 320, generator=g) * 0.05
    packed, scales = ops.i16_gemm_pack(w)
    silu = ops.i16_gemm_pack(w[silu_pair_order(192)])
    outs = {}
    try:
        for nta in (False, True):
            assert ops.gemm_prefetch_nta(nta) is nta
            for m in (9, 64, 300):
                x = torch.randn(m, 320, generator=torch.Generator().manual_seed(m))
                outs[nta, m] = (ops.i16_gemm(x, packed, scales, 192),
                                ops.i16_gemm(x, *silu, 192, None, True),
                                ops.i16_gemm_argmax(x, packed, scales, 192, 190))
    finally:
        ops.gemm_prefetch_nta(default)
    for m in (9, 64, 300):
        for off, on in zip(outs[False, m], outs[True, m]):
            assert torch.equal(off, on)
