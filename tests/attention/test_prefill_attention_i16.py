"""keel's causal prefill kernel on int16 dot products (keel/csrc/prefill_attention_i16.cpp),
dtype="auto"'s where its GEMMs run on i16_gemm: against a dense float64 reference, against its
own quantization scheme computed in torch, at the int32 limits of both products, and against
the float32 kernel over a bfloat16 K/V (the error `auto` accepts in its cache). Where the build
has no AVX512-VNNI, the op says so and raises (each test checks that instead)."""

from __future__ import annotations

import math

import pytest
import torch

from keel.cpu_ops import get_cpu_ops
from tests.attention.test_paged_attention import dense_reference
from tests.attention.test_prefill_attention import qkv_views

K_P, K_V = 16383, 2048  # a weight of 1; V's largest |value| of a dimension in a block


@pytest.fixture(scope="module")
def ops():
    ops = get_cpu_ops()
    assert ops is not None, "the CPU kernels must build on this machine"
    return ops


def run_i16(ops, *args) -> bool:
    """The int16 op on args; False (after checking its error) where the build has no VNNI."""
    if not ops.prefill_attention_i16_available():
        with pytest.raises(RuntimeError, match="needs AVX512-VNNI"):
            ops.prefill_attention_i16(*args)
        return False
    ops.prefill_attention_i16(*args)
    return True


def k_qk(head_dim: int) -> int:
    """A query's or key's largest |int16|: head_dim products of its square fit an int32."""
    q = math.isqrt((2**31 - 1) // head_dim)
    while q * q * head_dim > 2**31 - 1:
        q -= 1
    return q


CASES = [
    (1, 1, 9, 3, 64, 0),  # one token
    (70, 70, 9, 3, 64, 0),  # rows not a multiple of the 16-row block
    (600, 600, 9, 3, 64, 0),  # the long workload's size
    (37, 165, 9, 3, 64, 0),  # a chunk after context, keys across several 64-key blocks
    (130, 130, 8, 2, 128, 0),
    (65, 100, 4, 2, 80, 0),  # head size 80: a 16-dimension values tile after a 32 one
    (200, 500, 9, 3, 64, 64),  # sliding window: blocks before it skipped or masked
    (129, 129, 4, 4, 48, 17),
    (50, 50, 16, 1, 32, 0),  # 16 query heads per KV head
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("L, S, heads, kv_heads, head_dim, window", CASES)
def test_matches_dense_attention(ops, L, S, heads, kv_heads, head_dim, window, dtype, tol):
    q, k, v = qkv_views(L, S, heads, kv_heads, head_dim, dtype)
    out = torch.full((L, heads * head_dim), float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    if not run_i16(ops, q, k, v, out, scale, window):
        return
    ref = dense_reference([q], [k], [v], [L], scale, window or None)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("L, S, heads, kv_heads, head_dim", [
    (600, 600, 9, 3, 64), (130, 130, 8, 2, 128), (37, 165, 9, 3, 64)])
def test_closer_than_a_bfloat16_cache(ops, L, S, heads, kv_heads, head_dim):
    """Its mean error is below a third of the float32 kernel's over K and V rounded to
    bfloat16, as dtype="auto" keeps them in its cache (measured: ~1/5)."""
    q, k, v = qkv_views(L, S, heads, kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    out = torch.empty(L, heads * head_dim)
    if not run_i16(ops, q, k, v, out, scale, 0):
        return
    ref = dense_reference([q], [k], [v], [L], scale, None)
    kb, vb = (t.bfloat16().float() for t in (k, v))
    bf16 = torch.empty(L, heads * head_dim)
    ops.prefill_attention(q, kb, vb, bf16, scale, 0)
    err, err_bf16 = (out - ref).abs().mean().item(), (bf16 - ref).abs().mean().item()
    assert 0 < err < err_bf16 / 3, (err, err_bf16)


def scheme(q, k, v, scale):
    """The kernel's arithmetic in float64, for S <= 64 keys (one block: each weight is
    relative to its row's largest score): query and key vectors as int16 at k_qk, weights as
    int16 steps of 1 / K_P, V per dimension at K_V, exact integer sums."""
    L, H, D = q.shape
    S, Hkv, _ = k.shape
    kq = k_qk(D)

    def quant(x, top):  # per vector (last dim), as the kernel: x * (top / amax), half to even
        amax = x.abs().amax(-1, keepdim=True)
        return torch.round(x * (top / amax)), amax / top

    qi, sq = quant(q.float() * scale, kq)
    ki, sk = quant(k.float(), kq)
    vmax = v.float().abs().amax(0, keepdim=True)  # [1, Hkv, D]: the block's
    vi = torch.round(v.float() * (K_V / vmax))
    out = torch.empty(L, H, D, dtype=torch.float64)
    causal = torch.arange(S)[None, :] <= torch.arange(S - L, S)[:, None]
    for h in range(H):
        g = h // (H // Hkv)
        s = (qi[:, h].double() @ ki[:, g].double().T) * (sq[:, h].double() * sk[:, g].double().T)
        s = s.masked_fill(~causal, -math.inf)
        p = torch.round(torch.exp(s - s.amax(1, keepdim=True)) * K_P)
        out[:, h] = (p @ vi[:, g].double()) * (vmax[0, g].double() / K_V) / p.sum(1, keepdim=True)
    return out.reshape(L, H * D)


@pytest.mark.parametrize("L, S, heads, kv_heads, head_dim", [
    (50, 50, 9, 3, 64), (20, 60, 4, 2, 128), (64, 64, 2, 1, 48)])
def test_follows_its_quantization_scheme(ops, L, S, heads, kv_heads, head_dim):
    """Within one block of keys the kernel computes `scheme` up to float32 rounding, which
    can move a weight by one step (1 / K_P of the row's largest): within that of it, and
    10x closer to it than to the exact attention."""
    q, k, v = qkv_views(L, S, heads, kv_heads, head_dim, torch.float32, seed=3)
    scale = head_dim**-0.5
    out = torch.empty(L, heads * head_dim)
    if not run_i16(ops, q, k, v, out, scale, 0):
        return
    ref = dense_reference([q], [k], [v], [L], scale, None).double()
    to_scheme = (out.double() - scheme(q, k, v, scale)).abs().max().item()
    to_exact = (out.double() - ref).abs().max().item()
    assert to_scheme < 1.5 * v.abs().max().item() / K_P, to_scheme
    assert to_scheme < to_exact / 10, (to_scheme, to_exact)


@pytest.mark.parametrize("head_dim", [32, 48, 64, 80, 128])
def test_scores_at_the_int32_limit(ops, head_dim):
    """Queries and keys whose every value is their largest: each score sums head_dim products
    of k_qk^2, the most an int32 holds for that head size; keys of both signs and a sliding
    mix of them give scores of +-4, which the exact attention weighs as the kernel must."""
    L = S = 40
    q = torch.ones(L, 1, head_dim)
    k = torch.ones(S, 1, head_dim) * torch.where(torch.arange(S) % 3 == 0, -1.0, 1.0)[:, None, None]
    v = torch.randn(S, 1, head_dim, generator=torch.Generator().manual_seed(1))
    out = torch.empty(L, head_dim)
    scale = 4.0 / head_dim
    if not run_i16(ops, q, k, v, out, scale, 0):
        return
    kq = k_qk(head_dim)
    assert kq**2 * head_dim <= 2**31 - 1 < (kq + 1) ** 2 * head_dim
    ref = dense_reference([q], [k], [v], [L], scale, None)
    assert (out - ref).abs().max().item() < 2e-3


def test_values_at_the_int32_limit(ops):
    """A zero query weighs its keys alike, so the last row's 64 weights are all K_P; V rows
    all at their dimension's largest |value|: a block's sums reach 64 * K_P * K_V, just under
    2^31, and the output is V's row exactly (to float32)."""
    assert 64 * K_P * K_V <= 2**31 - 1 < 64 * K_P * (K_V + 1)
    L = S = 64
    q = torch.zeros(L, 1, 64)
    k = torch.randn(S, 1, 64, generator=torch.Generator().manual_seed(2))
    row = torch.where(torch.arange(64) % 2 == 0, 1000.0, -1000.0)
    v = row.expand(S, 1, 64).contiguous()
    out = torch.empty(L, 64)
    if not run_i16(ops, q, k, v, out, 0.125, 0):
        return
    assert torch.allclose(out, row.expand(L, 64), rtol=1e-6, atol=0)


def test_writes_only_its_rows(ops):
    q, k, v = qkv_views(40, 40, 9, 3, 64, torch.float32)
    full = torch.zeros(60, 9 * 64)
    if not run_i16(ops, q, k, v, full[10:50], 0.125, 0):
        return
    assert full[:10].eq(0).all() and full[50:].eq(0).all()
    ref = dense_reference([q], [k], [v], [40], 0.125, None)
    assert (full[10:50] - ref).abs().max().item() < 2e-3


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v, o: (q, k[:, :2], v, o), "shapes"),
    (lambda q, k, v, o: (q, k[:10], v[:10], o), "at least its own keys"),
    (lambda q, k, v, o: (q.half(), k.half(), v.half(), o.half()), "float32 or bfloat16 only"),
    (lambda q, k, v, o: (q, k, v, o[:, :100]), "out must be"),
    (lambda q, k, v, o: (q[..., :48], k[..., :48], v[..., :48], o[:, :432]), "dense"),
])
def test_bad_arguments_raise(ops, bad, message):
    q, k, v = qkv_views(20, 20, 9, 3, 64, torch.float32)
    out = torch.empty(20, 9 * 64)
    if not ops.prefill_attention_i16_available():
        message = "needs AVX512-VNNI"
    with pytest.raises(RuntimeError, match=message):
        ops.prefill_attention_i16(*bad(q, k, v, out), 0.125, 0)
