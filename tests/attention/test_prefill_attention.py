"""keel's causal prefill kernel (keel/csrc/prefill_attention.cpp) against a dense reference:
the attention of one prompt chunk over every key it sees, as `_split_attention` calls it."""

from __future__ import annotations

import pytest
import torch

from keel.cpu_ops import get_cpu_ops
from tests.attention.test_paged_attention import dense_reference


@pytest.fixture(scope="module")
def ops():
    ops = get_cpu_ops()
    assert ops is not None, "the CPU kernels must build on this machine"
    return ops


def qkv_views(L, S, heads, kv_heads, head_dim, dtype, seed=0):
    """q [L, H, D], k/v [S, Hkv, D] as strided views of one fused projection, the way the
    model's layers hand them over (the last L keys are the chunk's own)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(S, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[S - L :, :q_size].view(L, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(S, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(S, kv_heads, head_dim)
    return q, k, v


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2),
                                        (torch.float16, 4e-3)])
@pytest.mark.parametrize("L, S, heads, kv_heads, head_dim, window", [
    (1, 1, 9, 3, 64, 0),  # one token
    (70, 70, 9, 3, 64, 0),  # a whole prompt, rows not a multiple of the 16-row block
    (600, 600, 9, 3, 64, 0),  # the long workload's size
    (37, 165, 9, 3, 64, 0),  # a chunk after context, keys across several 64-key blocks
    (130, 130, 8, 2, 128, 0),
    (65, 100, 4, 2, 80, 0),  # head size 80: a multiple of 16 only
    (200, 500, 9, 3, 64, 64),  # sliding window: early key blocks skipped
    (129, 129, 4, 4, 48, 17),
    (50, 50, 16, 1, 32, 0),  # 16 query heads per KV head
])
def test_matches_dense_attention(ops, L, S, heads, kv_heads, head_dim, window, dtype, tol):
    q, k, v = qkv_views(L, S, heads, kv_heads, head_dim, dtype)
    out = torch.full((L, heads * head_dim), float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    ops.prefill_attention(q, k, v, out, scale, window)
    ref = dense_reference([q], [k], [v], [L], scale, window or None)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() < tol


def test_writes_only_its_rows(ops):
    """`out` is a slice of the pass's output: the rows around it stay as they were."""
    q, k, v = qkv_views(40, 40, 9, 3, 64, torch.float32)
    full = torch.zeros(60, 9 * 64)
    ops.prefill_attention(q, k, v, full[10:50], 0.125, 0)
    assert full[:10].eq(0).all() and full[50:].eq(0).all()
    ref = dense_reference([q], [k], [v], [40], 0.125, None)
    assert (full[10:50] - ref).abs().max().item() < 2e-6


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v, o: (q, k[:, :2], v, o), "shapes"),  # key and value differ
    (lambda q, k, v, o: (q, k[:10], v[:10], o), "at least its own keys"),
    (lambda q, k, v, o: (q.double(), k.double(), v.double(), o.double()), "only"),
    (lambda q, k, v, o: (q, k, v, o[:, :100]), "out must be"),
    (lambda q, k, v, o: (q[..., :48], k[..., :48], v[..., :48], o[:, :432]), "dense"),
])
def test_bad_arguments_raise(ops, bad, message):
    q, k, v = qkv_views(20, 20, 9, 3, 64, torch.float32)
    out = torch.empty(20, 9 * 64)
    with pytest.raises(RuntimeError, match=message):
        ops.prefill_attention(*bad(q, k, v, out), 0.125, 0)


# keel/csrc/prefill_attention_amx.cpp: the same attention for bfloat16 on AMX tiles. Where the
# build or CPU has no tiles, the op says so and raises (each test checks that instead).
def run_where_available(ops, name: str, missing: str, *args) -> bool:
    """keel's op `name` on args, where `name`_available() says this build and CPU run it; else
    False, after checking that the op raises an error matching `missing`."""
    op = getattr(ops, name)
    if not getattr(ops, f"{name}_available")():
        with pytest.raises(RuntimeError, match=missing):
            op(*args)
        return False
    op(*args)
    return True


def run_amx(ops, *args) -> bool:
    """The AMX op on args; False (after checking its error) where there are no tiles."""
    return run_where_available(ops, "prefill_attention_amx", "no AMX-BF16 tiles", *args)

AMX_CASES = [
    (1, 1, 9, 3, 64, 0),
    (70, 70, 9, 3, 64, 0),  # rows not a multiple of the 16-row tile, keys not of 32
    (600, 600, 9, 3, 64, 0),
    (37, 165, 9, 3, 64, 0),  # a chunk after context
    (130, 130, 8, 2, 128, 0),  # head size 128: the output accumulated outside the tiles
    (40, 300, 6, 2, 96, 0),
    (200, 500, 9, 3, 64, 64),  # sliding window: early key blocks skipped
    (129, 129, 4, 4, 32, 17),
    (50, 50, 16, 1, 64, 0),  # 16 query heads per KV head
    (33, 33, 24, 1, 64, 0),  # more than 16 (the AVX kernel's limit)
]


@pytest.mark.parametrize("L, S, heads, kv_heads, head_dim, window", AMX_CASES)
def test_amx_matches_dense_attention(ops, L, S, heads, kv_heads, head_dim, window):
    q, k, v = qkv_views(L, S, heads, kv_heads, head_dim, torch.bfloat16)
    out = torch.full((L, heads * head_dim), float("nan"), dtype=torch.bfloat16)
    scale = head_dim**-0.5
    if not run_amx(ops, q, k, v, out, scale, window):
        return
    ref = dense_reference([q], [k], [v], [L], scale, window or None)
    assert torch.isfinite(out).all()
    # P is rounded to bfloat16 before P V (as torch's flash attention in bfloat16 does).
    assert (out.float() - ref).abs().max().item() < 3e-2


def test_amx_rescales_a_growing_maximum(ops):
    """Scores that grow along the keys raise each row's maximum many times past the kernel's
    lazy margin: the sums kept so far are scaled down each time, and nothing overflows."""
    L, S, D = 64, 256, 64
    q = torch.ones(L, 2, D, dtype=torch.bfloat16)
    ramp = torch.linspace(0, 6, S)[:, None, None]  # score of key j grows with j (x 8 scaled)
    k = (ramp * torch.ones(S, 1, D)).bfloat16()
    v = torch.randn(S, 1, D).bfloat16()
    out = torch.empty(L, 2 * D, dtype=torch.bfloat16)
    if not run_amx(ops, q, k, v, out, D**-0.5, 0):
        return
    ref = dense_reference([q], [k], [v], [L], D**-0.5, None)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() < 3e-2


def test_amx_writes_only_its_rows(ops):
    q, k, v = qkv_views(40, 40, 9, 3, 64, torch.bfloat16)
    full = torch.zeros(60, 9 * 64, dtype=torch.bfloat16)
    if not run_amx(ops, q, k, v, full[10:50], 0.125, 0):
        return
    assert full[:10].eq(0).all() and full[50:].eq(0).all()


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v, o: (q.float(), k.float(), v.float(), o.float()), "bfloat16 only"),
    (lambda q, k, v, o: (q[..., :48], k[..., :48], v[..., :48], o[:, :432]), "dense"),
    (lambda q, k, v, o: (q, k[:10], v[:10], o), "at least its own keys"),
])
def test_amx_bad_arguments_raise(ops, bad, message):
    q, k, v = qkv_views(20, 20, 9, 3, 64, torch.bfloat16)
    out = torch.empty(20, 9 * 64, dtype=torch.bfloat16)
    if not ops.prefill_attention_amx_available():
        message = "no AMX-BF16 tiles"
    with pytest.raises(RuntimeError, match=message):
        ops.prefill_attention_amx(*bad(q, k, v, out), 0.125, 0)
