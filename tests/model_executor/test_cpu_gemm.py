"""keel's float32 GEMM (keel/csrc/gemm.cpp) against a float64 reference: row counts that
fill 6-row tiles and leave remainders, blocks of rows, an N that is not a multiple of the
16-column panel, a K that is not a multiple of 8, bias, bfloat16 weights (widened exactly),
strided inputs, the same bits on any number of threads, and the errors for arguments it
cannot take."""

from __future__ import annotations

import pytest
import torch

from keel.cpu_ops import get_cpu_ops


@pytest.fixture(scope="module")
def ops():
    ops = get_cpu_ops()
    assert ops is not None, "keel's CPU kernels did not build"
    # Every CPU these tests run on has AVX2 + FMA; elsewhere layers/linear.py keeps oneDNN.
    assert ops.gemm_available()
    return ops


SHAPES = [  # (M, N, K)
    (1, 16, 8), (5, 100, 40), (6, 48, 64), (13, 33, 577), (64, 960, 576), (200, 40, 576),
    (50, 20, 2048),  # rows in several L2 blocks (48 rows a block at K = 2048)
]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_is_x_times_w_transposed(ops, m, n, k, dtype, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = ops.gemm_pack(w)
    assert packed.dtype == dtype and packed.shape == ((n + 15) // 16, k, 16)
    got = ops.gemm(x, packed, n, b)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # float32 accumulation over k in order: error grows like sqrt(k) eps |x||w|.
    assert (got.double() - want).abs().max().item() < 2e-6 * k


def test_gemm_takes_strided_rows(ops):
    x = torch.randn(12, 2 * 96)[:, ::2]  # every other column: not contiguous
    w = torch.randn(40, 96)
    got = ops.gemm(x, ops.gemm_pack(w), 40)
    assert torch.allclose(got, x @ w.T, atol=1e-4)


def test_gemm_gives_the_same_bits_on_any_number_of_threads(ops):
    # The threads claim runs of (block, panel) items as they go (csrc/claims.h): which thread
    # computes an output must not change its value. 700 rows are 5 blocks at K = 576, 1,000
    # columns 63 panels (the last one partial).
    g = torch.Generator().manual_seed(7)
    x, w, b = (torch.randn(700, 576, generator=g), torch.randn(1000, 576, generator=g),
               torch.randn(1000, generator=g))
    packed = ops.gemm_pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.gemm(x, packed, 1000, b)
        torch.set_num_threads(max(2, threads))
        many = [ops.gemm(x, packed, 1000, b) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(one, m) for m in many)
    want = x.double() @ w.double().T + b.double()
    assert (one.double() - want).abs().max().item() < 2e-6 * 576


def test_gemm_with_no_rows(ops):
    assert ops.gemm(torch.empty(0, 32), ops.gemm_pack(torch.randn(8, 32)), 8).shape == (0, 8)


def test_bad_arguments_say_what_to_change(ops):
    packed = ops.gemm_pack(torch.randn(20, 32))
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ops.gemm(torch.randn(3, 32, dtype=torch.float64), packed, 20)
    with pytest.raises(RuntimeError, match="gemm_pack's .* for N = 40"):
        ops.gemm(torch.randn(3, 32), packed, 40)
    with pytest.raises(RuntimeError, match="K = x.size"):
        ops.gemm(torch.randn(3, 31), packed, 20)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        ops.gemm(torch.randn(3, 32), packed, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.gemm_pack(torch.randn(4, 4, dtype=torch.float16))


@pytest.mark.parametrize("m,inter,k", [(1, 16, 8), (13, 48, 577), (64, 1536, 576),
                                        (700, 96, 576), (50, 32, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_silu_is_silu_and_mul_of_the_gemm_bit_for_bit(ops, m, inter, k, dtype, bias):
    # The activation in the GEMM's epilogue (a [gate; up] weight of 2 * inter rows) gives the
    # bits of the two-step path it replaces, on one thread and on two.
    g = torch.Generator().manual_seed(m + inter)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(2 * inter, k, generator=g).to(dtype)
    b = torch.randn(2 * inter, generator=g) if bias else None
    packed = ops.gemm_pack(w)
    want = ops.silu_and_mul(ops.gemm(x, packed, 2 * inter, b))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.gemm_silu(x, packed, 2 * inter, b)
        torch.set_num_threads(max(2, threads))
        two = ops.gemm_silu(x, packed, 2 * inter, b)
    finally:
        torch.set_num_threads(threads)
    assert one.shape == (m, inter)
    assert torch.equal(one, want) and torch.equal(two, want)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    ref = torch.nn.functional.silu(ref[:, :inter]) * ref[:, inter:]
    assert (one.double() - ref).abs().max().item() < 1e-5 * k * (1 + ref.abs().max().item())


def test_gemm_silu_needs_halves_of_whole_panels(ops):
    packed = ops.gemm_pack(torch.randn(40, 32))
    with pytest.raises(RuntimeError, match="twice a multiple of 16"):
        ops.gemm_silu(torch.randn(3, 32), packed, 40)
