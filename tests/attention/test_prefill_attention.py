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
