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
from tests.attention.test_prefill_attention import qkv_views, run_where_available

K_Q = 11585  # a query vector's largest |int16|
L1_MAX = (2**31 - 1) // K_Q  # the largest sum of a key's |int16| values (185,367)
K_V = 32767  # V's largest |int16| of a dimension in a block
P_SUM, P_MAX = 65535, 32767  # the most a row's int16 weights of a block sum to; a weight of 1


@pytest.fixture(scope="module")
def ops():
    ops = get_cpu_ops()
    assert ops is not None, "the CPU kernels must build on this machine"
    return ops


def run_i16(ops, *args) -> bool:
    """The int16 op on args; False (after checking its error) where the build has no VNNI."""
    return run_where_available(ops, "prefill_attention_i16", "needs AVX512-VNNI", *args)


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
    relative to its row's largest score): query vectors as int16 at K_Q, keys at the finest
    step up to K_Q whose |int16| values sum to at most L1_MAX, V per dimension at K_V, each
    row's weights as int16 steps of 1 / kw (their sum at most P_SUM), exact integer sums, over
    the float weights' sum."""
    L, H, D = q.shape
    S, Hkv, _ = k.shape
    qs = q.float() * scale
    qa = qs.abs().amax(-1, keepdim=True)
    qi, sq = torch.round(qs * (K_Q / qa)), qa / K_Q
    kf = k.float()
    step = torch.minimum(K_Q / kf.abs().amax(-1, keepdim=True),
                         (L1_MAX - D // 2 - 1) / kf.abs().sum(-1, keepdim=True))
    ki, sk = torch.round(kf * step), 1 / step
    vmax = v.float().abs().amax(0, keepdim=True)  # [1, Hkv, D]: the block's
    vi = torch.round(v.float() * (K_V / vmax))
    out = torch.empty(L, H, D, dtype=torch.float64)
    causal = torch.arange(S)[None, :] <= torch.arange(S - L, S)[:, None]
    for h in range(H):
        g = h // (H // Hkv)
        s = (qi[:, h].double() @ ki[:, g].double().T) * (sq[:, h].double() * sk[:, g].double().T)
        p = torch.exp(s.masked_fill(~causal, -math.inf) - s.masked_fill(~causal, -math.inf)
                      .amax(1, keepdim=True))
        kw = torch.clamp(torch.floor((P_SUM - 64) / p.sum(1, keepdim=True)), max=P_MAX)
        pi = torch.round(p * kw)
        out[:, h] = ((pi @ vi[:, g].double()) * (vmax[0, g].double() / K_V) / kw
                     / p.sum(1, keepdim=True))
    return out.reshape(L, H * D)


@pytest.mark.parametrize("L, S, heads, kv_heads, head_dim", [
    (50, 50, 9, 3, 64), (20, 60, 4, 2, 128), (64, 64, 2, 1, 48)])
def test_follows_its_quantization_scheme(ops, L, S, heads, kv_heads, head_dim):
    """Within one block of keys the kernel computes `scheme` up to float32 rounding, which
    can move a weight by one step (at most 1 / 1,023 of the block's sum): within that of it,
    and on average 10x closer to it than to the exact attention."""
    q, k, v = qkv_views(L, S, heads, kv_heads, head_dim, torch.float32, seed=3)
    scale = head_dim**-0.5
    out = torch.empty(L, heads * head_dim)
    if not run_i16(ops, q, k, v, out, scale, 0):
        return
    ref = dense_reference([q], [k], [v], [L], scale, None).double()
    to_scheme = (out.double() - scheme(q, k, v, scale)).abs()
    to_exact = (out.double() - ref).abs()
    assert to_scheme.max().item() < 1.5 * v.abs().max().item() / 1023, to_scheme.max()
    assert to_scheme.mean().item() < to_exact.mean().item() / 10, (to_scheme.mean(),
                                                                   to_exact.mean())


@pytest.mark.parametrize("head_dim", [32, 48, 64, 80, 128])
def test_scores_at_the_int32_limit(ops, head_dim):
    """Queries and keys whose every value is their largest: the query at K_Q, each key at
    the step whose |int16| values sum to L1_MAX - head_dim / 2 - 1, so that each score's int32
    sum comes within 2 head_dim K_Q of 2^31; keys of both signs give scores of +-4, which the
    exact attention weighs as the kernel must."""
    L = S = 40
    q = torch.ones(L, 1, head_dim)
    k = torch.ones(S, 1, head_dim) * torch.where(torch.arange(S) % 3 == 0, -1.0, 1.0)[:, None, None]
    v = torch.randn(S, 1, head_dim, generator=torch.Generator().manual_seed(1))
    out = torch.empty(L, head_dim)
    scale = 4.0 / head_dim
    if not run_i16(ops, q, k, v, out, scale, 0):
        return
    key_int = (L1_MAX - head_dim // 2 - 1) // head_dim  # each of the key's values
    assert 2**31 - 1 - 2 * head_dim * K_Q < K_Q * key_int * head_dim <= 2**31 - 1
    ref = dense_reference([q], [k], [v], [L], scale, None)
    assert (out - ref).abs().max().item() < 1e-3


def test_values_at_the_int32_limit(ops):
    """A zero query weighs its keys alike: the last row's 64 weights of 1 sum to 64, so each
    is 65,471 // 64 = 1,022 steps, and with V's rows all at their dimension's largest |value|
    (K_V) the block's int32 sums reach 64 x 1,022 x K_V, near P_SUM x K_V < 2^31; the output
    is V's row exactly (to float32). The first row's one weight is P_MAX steps."""
    assert P_SUM * K_V <= 2**31 - 1
    L = S = 64
    q = torch.zeros(L, 1, 64)
    k = torch.randn(S, 1, 64, generator=torch.Generator().manual_seed(2))
    row = torch.where(torch.arange(64) % 2 == 0, 1000.0, -1000.0)
    v = row.expand(S, 1, 64).contiguous()
    out = torch.empty(L, 64)
    if not run_i16(ops, q, k, v, out, 0.125, 0):
        return
    assert torch.allclose(out, row.expand(L, 64), rtol=1e-6, atol=0)


def test_concentrated_and_spread_weights(ops):
    """Heads whose weights sit on few keys and heads whose weights spread over every key
    (each block's step chosen from its sum): mean and largest errors both below a third of
    the float32 kernel's over a bfloat16 K/V."""
    L = S = 300
    g = torch.Generator().manual_seed(4)
    q = torch.randn(L, 2, 64, generator=g)
    q[:, 1] *= 0.01  # head 1: near-uniform weights
    k = torch.randn(S, 1, 64, generator=g) * 3  # head 0: sharp weights
    v = torch.randn(S, 1, 64, generator=g)
    out = torch.empty(L, 128)
    if not run_i16(ops, q, k, v, out, 0.125, 0):
        return
    ref = dense_reference([q], [k], [v], [L], 0.125, None)
    bf16 = torch.empty(L, 128)
    ops.prefill_attention(q, k.bfloat16().float(), v.bfloat16().float(), bf16, 0.125, 0)
    for head in (slice(0, 64), slice(64, 128)):
        err, err_bf16 = (out - ref)[:, head].abs(), (bf16 - ref)[:, head].abs()
        assert err.mean() < err_bf16.mean() / 3, (err.mean(), err_bf16.mean())
        assert err.max() < err_bf16.max() / 3, (err.max(), err_bf16.max())


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


def test_the_choice_follows_auto_and_the_switch(ops, monkeypatch):
    """gemm_choice.int16_attention_chosen: only where dtype="auto" put the GEMMs on int16 or
    float16 (fp16_gemm_chosen), unless KEEL_I16_ATTENTION forces it; never without VNNI; a
    bad value names the choices."""
    from keel.model_executor.layers import gemm_choice

    vnni = ops.prefill_attention_i16_available()
    monkeypatch.delenv("KEEL_I16_ATTENTION", raising=False)
    monkeypatch.setattr(gemm_choice, "fp16_gemm_chosen", lambda: None)
    assert gemm_choice.int16_attention_chosen() is False  # dtype="float32", or AMX's bfloat16
    monkeypatch.setattr(gemm_choice, "fp16_gemm_chosen", lambda: "i16")
    assert gemm_choice.int16_attention_chosen() is vnni
    monkeypatch.setenv("KEEL_I16_ATTENTION", "0")
    assert gemm_choice.int16_attention_chosen() is False
    monkeypatch.setattr(gemm_choice, "fp16_gemm_chosen", lambda: None)
    monkeypatch.setenv("KEEL_I16_ATTENTION", "1")
    assert gemm_choice.int16_attention_chosen() is vnni
    monkeypatch.setenv("KEEL_I16_ATTENTION", "yes")
    with pytest.raises(ValueError, match="KEEL_I16_ATTENTION"):
        gemm_choice.int16_attention_chosen()


def test_a_nan_reaches_the_outputs_it_would_in_float32(ops):
    """A NaN or an infinity is not quantized away. In a query or a key it makes NaN exactly
    the outputs that the float32 kernel makes NaN (the rows that see it). In a value, every
    output the float32 kernel makes NaN is NaN, and so is the value's dimension in every row
    over its block of 64 keys (its scale is NaN); the other dimensions stay finite."""
    L, D = 40, 64
    q, k, v = (t.contiguous() for t in qkv_views(L, L, 4, 2, D, torch.float32, seed=5))
    q[7, 2, 10] = float("nan")  # row 7, head 2 (group 1)
    k[5, 0, 3] = float("nan")  # key 5 of group 0: rows 5.. of heads 0 and 1
    v[20, 1, 9] = float("inf")  # value 20 of group 1, dim 9
    out, f32 = torch.empty(L, 4 * D), torch.empty(L, 4 * D)
    if not run_i16(ops, q, k, v, out, D**-0.5, 0):
        return
    ops.prefill_attention(q, k, v, f32, D**-0.5, 0)
    nan, nan_f32 = out.view(L, 4, D).isnan(), f32.view(L, 4, D).isnan()
    assert torch.equal(nan[:, :2], nan_f32[:, :2])  # group 0: the key's NaN alone
    assert nan[7, 2].all() and nan[5:, :2].all() and not nan[:5, :2].any()
    assert (nan | ~nan_f32).all()  # every output float32 makes NaN is NaN here too
    assert nan[:, 2:, 9].all()  # the infinite value's dimension, its block's every row
    others = torch.ones(D, dtype=torch.bool)
    others[9] = False
    assert not nan[:7, 2:][..., others].any() and not nan[8:, 2:][..., others].any()


def test_bfloat16_chunks_take_it_without_amx_tiles(ops, monkeypatch):
    """A bfloat16 model's long chunks run on int16 dot products wherever the build has
    AVX512-VNNI and the CPU no AMX tiles, its GEMMs on whatever they are
    (chunk_kernels.bfloat16_chunks_on_int16); KEEL_I16_ATTENTION=0 keeps the float32 kernel;
    float32 chunks only where the layer says so (dtype="auto"'s int16 GEMMs); with AMX tiles,
    the tiles' choice as before. The same kernel's output in both engines' paths."""
    from keel import dtypes
    from keel.attention.backends import chunk_kernels

    vnni = ops.prefill_attention_i16_available()
    name = chunk_kernels.chunk_kernel_name
    monkeypatch.delenv("KEEL_I16_ATTENTION", raising=False)
    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    i16 = "prefill_attention_i16" if vnni else "prefill_attention"
    assert name(ops, torch.bfloat16, 9, 3, 64) == i16
    assert name(ops, torch.float32, 9, 3, 64) == "prefill_attention"
    assert name(ops, torch.float32, 9, 3, 64, int16=True) == i16
    assert name(ops, torch.bfloat16, 9, 3, 40) is None  # a head size no kernel takes: SDPA
    monkeypatch.setenv("KEEL_I16_ATTENTION", "0")
    assert name(ops, torch.bfloat16, 9, 3, 64) == "prefill_attention"
    monkeypatch.setenv("KEEL_I16_ATTENTION", "maybe")
    with pytest.raises(ValueError, match="KEEL_I16_ATTENTION"):
        name(ops, torch.bfloat16, 9, 3, 64)
    monkeypatch.delenv("KEEL_I16_ATTENTION")
    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: True)
    monkeypatch.setattr(chunk_kernels, "long_chunk_kernel", lambda *a: "prefill_attention_amx")
    assert name(ops, torch.bfloat16, 9, 3, 64) == "prefill_attention_amx"
