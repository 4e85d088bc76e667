"""The paged attention paths against a plain dense reference: the portable torch path (gather +
SDPA), and keel's compiled CPU kernel, which takes decode rows and short prompt chunks."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from keel import dtypes
from keel.attention.backends import chunk_kernels, torch_paged
from keel.attention.backends.torch_paged import (
    build_attention_metadata,
    paged_attention,
    quantize_rows,
)
from keel.cpu_ops import get_cpu_ops


def dense_reference(q_seqs, k_seqs, v_seqs, q_lens, scale, window):
    """Per request: causal attention of its last q_len queries over its whole context."""
    outs = []
    for q, k, v, ql in zip(q_seqs, k_seqs, v_seqs, q_lens):
        s = k.shape[0]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
        qpos = torch.arange(s - ql, s)[:, None]
        kpos = torch.arange(s)[None]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        att = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", att, v.float()).reshape(ql, -1))
    return torch.cat(outs)


def run_case(seq_lens, q_lens, heads, kv_heads, head_dim, dtype, window, block_size=4,
             fill=0.0, cache_dtype=None):
    """(output, reference). `cache_dtype`: the cache's dtype where it differs from the
    queries' (bfloat16 under float32, or int8 with its scales); the reference then sees the
    K/V as the cache keeps them, rounded (int8: quantized and scaled back)."""
    g = torch.Generator().manual_seed(0)
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 3
    # Slots no request has written hold `fill` (a real cache's hold whatever was there; an
    # int8 cache's unwritten rows hold 77 and their scales `fill`).
    int8 = cache_dtype == torch.int8
    cache = torch.full((2, num_blocks, kv_heads, block_size, head_dim), 77 if int8 else fill,
                       dtype=cache_dtype or dtype)
    kv_scale = torch.full((2, num_blocks, kv_heads, block_size), fill) if int8 else None
    # Scatter the blocks (shuffled) so the block table matters.
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(math.ceil(s / block_size) for s in seq_lens)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    q_seqs, k_seqs, v_seqs, slots, new_k, new_v = [], [], [], [], [], []
    for r, (s, ql) in enumerate(zip(seq_lens, q_lens)):
        nb = math.ceil(s / block_size)
        blocks = [perm.pop() for _ in range(nb)]
        block_table[r, :nb] = torch.tensor(blocks)
        k = torch.randn(s, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(s, kv_heads, head_dim, generator=g).to(dtype)
        q_seqs.append(torch.randn(ql, heads, head_dim, generator=g).to(dtype))
        k_seqs.append(k)
        v_seqs.append(v)
        for p in range(s):
            slot = blocks[p // block_size] * block_size + p % block_size
            if p < s - ql:  # context already in the cache
                block, offset = divmod(slot, block_size)  # head-major blocks
                if int8:
                    (cache[0, block, :, offset], kv_scale[0, block, :, offset]) = quantize_rows(k[p])
                    (cache[1, block, :, offset], kv_scale[1, block, :, offset]) = quantize_rows(v[p])
                    continue
                cache[0, block, :, offset] = k[p]
                cache[1, block, :, offset] = v[p]
            else:  # written by this pass
                slots.append(slot)
                new_k.append(k[p])
                new_v.append(v[p])
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = build_attention_metadata(qsl, torch.tensor(seq_lens), block_table,
                                    torch.tensor(slots), block_size)
    scale = head_dim**-0.5
    out = paged_attention(torch.cat(q_seqs), torch.stack(new_k), torch.stack(new_v), cache,
                          meta, scale, window, kv_scale)
    assert out.dtype == dtype
    if int8:  # what the cache keeps: each row quantized and scaled back, in float32
        def kept(x):
            q, s = quantize_rows(x)
            return q.float() * s[..., None]
        k_seqs, v_seqs = [kept(k) for k in k_seqs], [kept(v) for v in v_seqs]
    elif cache_dtype is not None:
        k_seqs = [k.to(cache_dtype) for k in k_seqs]
        v_seqs = [v.to(cache_dtype) for v in v_seqs]
    ref = dense_reference(q_seqs, k_seqs, v_seqs, q_lens, scale, window)
    return out.float(), ref


def use_kernel_or_torch(monkeypatch, use_kernel: bool) -> None:
    if use_kernel:
        assert get_cpu_ops() is not None, "the CPU kernels must build on this machine"
    else:
        monkeypatch.setattr(torch_paged, "get_cpu_ops", lambda: None)


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 32), (4, 4, 48), (9, 3, 64)])
def test_mixed_batch(monkeypatch, use_kernel, heads, kv_heads, head_dim, dtype, tol, window):
    """Whole prompts, a chunk continuing a prompt, and decode rows in one pass."""
    use_kernel_or_torch(monkeypatch, use_kernel)
    out, ref = run_case([9, 17, 4, 30], [9, 6, 1, 1], heads, kv_heads, head_dim, dtype, window)
    assert (out - ref).abs().max().item() < tol


@pytest.mark.parametrize("prefill_kernel", [True, False])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("amx", [False, True])
def test_long_chunks_go_one_by_one(monkeypatch, prefill_kernel, window, dtype, tol, head_dim,
                                   amx):
    """Past CPU_KERNEL_MAX_QUERY_LEN queries, a request's chunk goes alone to keel's prefill
    kernel (or SDPA: KEEL_PREFILL_ATTENTION=0, or a head size it does not take) - a whole
    prompt, and a chunk after context - while the other requests' tokens stay on the per-row
    kernel, which never sees a long chunk's token."""
    monkeypatch.setattr(torch_paged, "CPU_KERNEL_MAX_QUERY_LEN", 8)
    monkeypatch.setattr(chunk_kernels, "PREFILL_KERNEL", prefill_kernel)
    # Where the CPU has AMX, bfloat16 chunks go to whichever of keel's kernels and SDPA
    # measures faster (test_long_chunk_kernel_by_measuring); here the prefill kernel is
    # taken, or (amx, where this CPU has the tiles) the AMX kernel for bfloat16.
    real = get_cpu_ops()
    amx = amx and dtype == torch.bfloat16 and real.prefill_attention_amx_available()
    name = "prefill_attention_amx" if amx else "prefill_attention"
    monkeypatch.setattr(chunk_kernels, "long_chunk_kernel", lambda *a: name)
    seen, chunks = [], []

    class Kernel:
        write_kv_cache = staticmethod(real.write_kv_cache)

        def paged_attention(self, query, *args):
            seen.append(query.shape[0])
            return real.paged_attention(query, *args)

        def prefill_attention(self, query, key, *args):
            chunks.append((query.shape[0], key.shape[0]))
            return real.prefill_attention(query, key, *args)

        def prefill_attention_amx(self, query, key, *args):
            chunks.append((query.shape[0], key.shape[0]))
            return real.prefill_attention_amx(query, key, *args)

        # (a bfloat16 chunk without AMX tiles, where the build has AVX512-VNNI:
        # chunk_kernels.bfloat16_chunks_on_int16)
        def prefill_attention_i16_available(self):
            return real.prefill_attention_i16_available()

        def prefill_attention_i16(self, query, key, *args):
            chunks.append((query.shape[0], key.shape[0]))
            return real.prefill_attention_i16(query, key, *args)

    monkeypatch.setattr(torch_paged, "get_cpu_ops", Kernel)
    # Request 0: a 9-token prompt; 1: 6 queries (kernel); 2, 3: decodes; 4: a 12-query chunk
    # after 18 tokens of context.
    out, ref = run_case([9, 17, 4, 30, 30], [9, 6, 1, 1, 12], 9, 3, head_dim, dtype, window)
    assert (out - ref).abs().max().item() < tol
    assert seen and all(n == 6 + 1 + 1 for n in seen)  # only the short requests' tokens
    # Each long chunk once per call, with every key it sees (head size 40: SDPA).
    expect = [(9, 9), (12, 30)] if prefill_kernel and head_dim == 64 else []
    assert chunks == expect


def test_long_chunk_kernel_by_measuring(monkeypatch):
    """float32, or a CPU without AMX: keel's prefill kernel, unmeasured. bfloat16 on a CPU
    with AMX: the faster of keel's kernel (the AMX one where it is built and the head size
    is a multiple of 32) and SDPA, timed once per shape."""

    class Kernel:
        def __init__(self, seconds: float, amx: bool = False) -> None:
            self.seconds, self.calls, self.amx = seconds, [], amx

        def prefill_attention_amx_available(self) -> bool:
            return self.amx

        def _run(self, name):
            self.calls.append(name)
            time.sleep(self.seconds)

        def prefill_attention(self, *args) -> None:
            self._run("prefill_attention")

        def prefill_attention_amx(self, *args) -> None:
            self._run("prefill_attention_amx")

    monkeypatch.setattr(chunk_kernels, "_long_chunk_kernels", {})
    slow, fast = Kernel(0.05), Kernel(0.0)
    pick = chunk_kernels.long_chunk_kernel
    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    assert pick(slow, torch.bfloat16, 9, 3, 64) == "prefill_attention"
    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: True)
    assert pick(slow, torch.float32, 9, 3, 64) == "prefill_attention"
    assert slow.calls == []
    assert pick(slow, torch.bfloat16, 9, 3, 64) is None  # SDPA
    assert pick(fast, torch.bfloat16, 8, 2, 64) == "prefill_attention"
    calls = len(slow.calls)
    assert pick(slow, torch.bfloat16, 9, 3, 64) is None
    assert len(slow.calls) == calls > 0  # measured once per shape
    amx = Kernel(0.0, amx=True)
    assert pick(amx, torch.bfloat16, 6, 2, 64) == "prefill_attention_amx"
    assert pick(amx, torch.bfloat16, 6, 2, 80) == "prefill_attention"  # 80 % 32 != 0
    assert pick(amx, torch.float16, 6, 2, 128) == "prefill_attention"  # bfloat16 only
    assert set(amx.calls) == {"prefill_attention_amx", "prefill_attention"}


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("window", [None, 7, 45])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim",
                         [(8, 2, 40), (9, 3, 64), (4, 1, 128), (16, 1, 32)])
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_decode_rows(monkeypatch, use_kernel, window, dtype, tol, heads, kv_heads, head_dim,
                     block_size):
    """Head sizes 32, 64 and 128 with blocks of 8 or 16 take the kernel's chunked
    online-softmax path (`decode_row16` on a CPU with AVX-512, `decode_row` elsewhere, or
    `decode_row_bf16` for bfloat16 where its dot products were measured faster: contexts across
    several chunks, windows starting mid-block, odd first and last keys, groups of 1-16 query
    heads), head size 40 or blocks of 4 its plain loop."""
    use_kernel_or_torch(monkeypatch, use_kernel)
    seq_lens = [1, 13, 40, 64, 5, 150, 97]
    out, ref = run_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, dtype, window,
                        block_size)
    assert (out - ref).abs().max().item() < tol


@pytest.mark.parametrize("bf16_dot", ["0", "1"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (16, 1, 32, 8), (4, 1, 128, 16), (14, 2, 96, 8),
                          (6, 2, 64, 24)])
def test_both_bfloat16_decode_kernels(monkeypatch, bf16_dot, window, heads, kv_heads, head_dim,
                                      block_size):
    """A bfloat16 decode row takes `decode_row_bf16` (bfloat16 dot products) or `decode_row16`
    (float32 FMAs), as measured once per process; KEEL_ATTN_BF16_DOT=0|1 forces either (where
    the CPU builds it: without AVX512-BF16 both settings run the same kernel). Each against the
    reference, NaN in the slots no row may read. Blocks of 24 keys (not a power of two: the
    engine never makes them, the op takes them) make a chunk that is not whole 16-key groups,
    which overran the dot-product kernel's scores before its buffers were rounded up to 16."""
    assert get_cpu_ops() is not None
    monkeypatch.setenv("KEEL_ATTN_BF16_DOT", bf16_dot)
    seq_lens = [1, 13, 40, 64, 5, 150, 97]
    out, ref = run_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim,
                        torch.bfloat16, window, block_size, fill=float("nan"))
    assert not out.isnan().any()
    assert (out - ref).abs().max().item() < 3e-2


def test_the_bfloat16_kernel_switch_takes_effect(monkeypatch):
    """Where the CPU has AVX512-BF16 (the kernels are built for the CPU that runs them), the
    two bfloat16 kernels give different bits (the dot-product path rounds a row's weights to
    bfloat16), so KEEL_ATTN_BF16_DOT really switches kernels; elsewhere the same kernel runs
    either way."""
    assert get_cpu_ops() is not None
    with open("/proc/cpuinfo") as f:
        has_bf16_dot = "avx512_bf16" in f.read().split()
    outs = []
    for choice in ("0", "1"):
        monkeypatch.setenv("KEEL_ATTN_BF16_DOT", choice)
        out, _ = run_case([40, 150, 97], [1, 1, 1], 9, 3, 64, torch.bfloat16, None, 16)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) != has_bf16_dot


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 50])
def test_blocks_of_16_and_32_give_a_bfloat16_cache_the_same_bits(query_dtype, window):
    """On the CPU a bfloat16 cache gets blocks of 32 tokens (config.default_block_size). Its
    decode rows go 32 keys a chunk either way (two blocks of 16 or one of 32), so the same
    keys in blocks of either size give the same bits: the default changes no output."""
    ops = get_cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, d, per = 8, 9, 3, 64, 20
    lens = torch.randint(20, 16 * per, (rows,), generator=g)
    q = torch.randn(rows, heads, d, generator=g).to(query_dtype)
    cache16 = [torch.randn(rows * per, kv_heads, 16, d, generator=g).to(torch.bfloat16)
               for _ in range(2)]
    # Block j of 32 holds blocks 2j and 2j + 1 of 16, head by head.
    cache32 = [c.view(rows * per // 2, 2, kv_heads, 16, d).transpose(1, 2)
               .reshape(rows * per // 2, kv_heads, 32, d).contiguous() for c in cache16]
    table16 = torch.arange(rows * per, dtype=torch.int32).view(rows, per)
    table32 = torch.arange(rows * per // 2, dtype=torch.int32).view(rows, per // 2)
    out16 = ops.paged_attention(q, *cache16, table16, lens, None, d ** -0.5, window)
    out32 = ops.paged_attention(q, *cache32, table32, lens, None, d ** -0.5, window)
    assert torch.equal(out16, out32)
    # (and close to the same attention over the keys in float32)
    ref = ops.paged_attention(q.float(), *(c.float() for c in cache16), table16, lens, None,
                              d ** -0.5, window)
    assert (out32.float() - ref).abs().max().item() < 3e-2


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, None),
                                                 (torch.float32, torch.bfloat16),
                                                 (torch.float32, torch.int8),
                                                 (torch.float32, None)])
def test_prefetch_into_l2_or_l1_gives_the_same_bits(dtype, cache_dtype):
    """Decode attention prefetches a 16-bit or int8 cache's next chunk into L2 on AMD and into
    L1 elsewhere (KEEL_ATTN_PREFETCH_L2 unset; paged_attention_common.h says why); a prefetch
    moves no data the arithmetic sees, so either gives the same bits, with a window too, and
    NaN in the slots no row may read stays unread."""
    ops = get_cpu_ops()
    assert ops is not None
    default = ops.attention_prefetch_into_l2()
    if os.environ.get("KEEL_ATTN_PREFETCH_L2") is None:
        with open("/proc/cpuinfo") as f:
            amd = "AuthenticAMD" in f.read()
        assert default == amd
    outs = []
    try:
        for into_l2 in (False, True):
            assert ops.attention_prefetch_into_l2(into_l2) == into_l2
            for window in (None, 9):
                seq_lens = [1, 13, 40, 64, 5, 150, 97, 300]
                out, _ = run_case(seq_lens, [1] * len(seq_lens), 9, 3, 64, dtype, window, 16,
                                  fill=0.0 if cache_dtype == torch.int8 else float("nan"),
                                  cache_dtype=cache_dtype)
                assert not out.isnan().any()
                outs.append(out)
    finally:
        ops.attention_prefetch_into_l2(default)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 33])
def test_decode_many_rows(dtype, tol, window):
    """Rows enough for whole-row items (every KV head of a row in one pass), with contexts of
    different lengths, claimed by the threads in runs of rows."""
    assert get_cpu_ops() is not None
    seq_lens = [3 + 37 * i % 211 for i in range(24)]
    out, ref = run_case(seq_lens, [1] * len(seq_lens), 9, 3, 64, dtype, window, 16)
    assert (out - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_decode_rows_never_read_unwritten_slots(dtype, head_dim):
    """Slots past a row's context (and before its window) may hold NaN: the kernel's
    weights there are 0, and a 0 times NaN would still spoil the row, so it must not multiply
    by them at all (bfloat16 computes values two keys at a time)."""
    assert get_cpu_ops() is not None
    seq_lens = [1, 13, 40, 7, 150, 97]
    for window in (None, 9):
        out, ref = run_case(seq_lens, [1] * len(seq_lens), 6, 2, head_dim, dtype, window, 16,
                            fill=float("nan"))
        assert not out.isnan().any()
        assert (out - ref).abs().max().item() < (1e-5 if dtype == torch.float32 else 3e-2)


# Several query tokens of one request in a pass (a speculative step's drafts, a short prompt
# chunk): 1-20 tokens a request, so that groups of 16 split, over contexts across many blocks.
GROUP_SEQ_LENS = [40, 150, 97, 33, 260, 21, 5]
GROUP_Q_LENS = [5, 5, 1, 20, 3, 17, 5]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype, cache_dtype, tol",
                         [(torch.float32, None, 1e-5), (torch.bfloat16, None, 3e-2),
                          (torch.float32, torch.bfloat16, 1e-5), (torch.float32, torch.int8, 1e-5),
                          (torch.bfloat16, torch.int8, 3e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (6, 2, 32, 8), (4, 4, 96, 16)])
def test_tokens_of_a_request_read_its_keys_together(window, dtype, cache_dtype, tol, heads,
                                                    kv_heads, head_dim, block_size):
    """The kernel takes up to 16 consecutive query tokens of one request as one item, reading
    each key and value once for all of them, each token's scores outside its own keys (past
    its position, before its window) weighted 0: against the reference, NaN in the slots no
    token may read."""
    assert get_cpu_ops() is not None
    out, ref = run_case(GROUP_SEQ_LENS, GROUP_Q_LENS, heads, kv_heads, head_dim, dtype, window,
                        block_size, fill=float("nan"), cache_dtype=cache_dtype)
    assert not out.isnan().any()
    assert (out - ref).abs().max().item() < tol


@pytest.mark.parametrize("window", [0, 7, 40])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32),
                                                (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.bfloat16)])
def test_grouped_tokens_give_each_tokens_own_bits(window, dtype, cache_dtype):
    """A token read in a group gives the same bits as the token alone (one row per call), so
    a speculative step's verified tokens are those the steps one token at a time would have
    computed. On AVX-512 a group's query vectors (3 heads times its tokens) go 16 to a
    register where a group of 16 lanes gets 12 or more of them, the rest one dims-in-lanes
    vector at a time: 4 tokens are 12 vectors, 5 are 15, 6 are 16 + 2, 9 are 16 + 11, 16 are
    three groups of 16."""
    ops = get_cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    blocks = 96
    k_cache, v_cache = (torch.randn(blocks, kv_heads, bs, dim, generator=g).to(cache_dtype)
                        for _ in range(2))
    table = torch.randperm(blocks, generator=g).to(torch.int32).view(6, 16)
    # Request 0: 5 tokens ending at key 200; 1: one; 2: 19 (a group of 16, then 3); 3: 2;
    # 4: 6; 5: 9 and 4 (two groups of one request, split by another's token).
    rows = torch.tensor([0] * 5 + [1] + [2] * 19 + [3] * 2 + [4] * 6 + [5] * 9 + [3] + [5] * 4,
                        dtype=torch.int32)
    lens = torch.cat([torch.arange(196, 201), torch.tensor([77]), torch.arange(100, 119),
                      torch.arange(9, 11), torch.arange(30, 36), torch.arange(240, 249),
                      torch.tensor([11]), torch.arange(249, 253)])
    q = torch.randn(len(rows), heads, dim, generator=g).to(dtype)
    together = ops.paged_attention(q, k_cache, v_cache, table, lens, rows, 0.125, window)
    for t in range(len(rows)):
        alone = ops.paged_attention(q[t : t + 1], k_cache, v_cache, table, lens[t : t + 1],
                                    rows[t : t + 1], 0.125, window)
        assert torch.equal(together[t], alone[0]), t


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (16, 1, 32, 8), (4, 1, 128, 16), (8, 2, 40, 4)])
def test_float32_queries_over_a_bfloat16_cache(monkeypatch, use_kernel, window, heads, kv_heads,
                                               head_dim, block_size):
    """kv_cache_dtype="bfloat16" under float32: this pass's K/V are rounded into the cache and
    every row reads them back widened, the arithmetic in float32, so the result is float32
    attention over the rounded K/V (the kernel's split path for head sizes of 32, 64, 128 with
    blocks of 8 or 16; its plain loop for 40 or blocks of 4; the torch path)."""
    use_kernel_or_torch(monkeypatch, use_kernel)
    seq_lens = [1, 13, 40, 64, 5, 150, 97]
    out, ref = run_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim,
                        torch.float32, window, block_size, cache_dtype=torch.bfloat16)
    assert (out - ref).abs().max().item() < 1e-5
    out, ref = run_case([9, 17, 4, 30], [9, 6, 1, 1], heads, kv_heads, head_dim,
                        torch.float32, window, block_size, cache_dtype=torch.bfloat16)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("prefill_kernel", [True, False])
def test_long_chunks_over_a_bfloat16_cache(monkeypatch, prefill_kernel):
    """A long chunk after context reads its context from a bfloat16 cache, widened to its
    float32 queries (keel's prefill kernel or SDPA); a whole long prompt attends to its own
    float32 K/V, which differ from the cached ones by their rounding."""
    monkeypatch.setattr(torch_paged, "CPU_KERNEL_MAX_QUERY_LEN", 8)
    monkeypatch.setattr(chunk_kernels, "PREFILL_KERNEL", prefill_kernel)
    out, ref = run_case([9, 17, 4, 30, 30], [9, 6, 1, 1, 12], 9, 3, 64, torch.float32, None,
                        16, cache_dtype=torch.bfloat16)
    assert (out - ref).abs().max().item() < 2e-2
    # The chunk after context (the last 12 rows) read exactly the rounded keys.
    assert (out[-12:] - ref[-12:]).abs().max().item() < 1e-5


def test_kernel_writes_float32_rows_into_a_bfloat16_cache():
    """The compiled K/V write rounds float32 rows into a bfloat16 cache as torch's
    .to(torch.bfloat16) does (to nearest even), and refuses other mixes."""
    ops = get_cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(5)
    cache = torch.zeros(2, 6, 3, 4, 64, dtype=torch.bfloat16)
    kv = torch.randn(10, 2 * 3 * 64, generator=g) * 3  # strided rows of one [T, k | v] buffer
    # Denormal lanes (rounded into bfloat16 denormals, not read as zero as the one-instruction
    # conversion reads them) in some vectors of 8, beside normal ones.
    kv[2, 3] = torch.finfo(torch.float32).tiny / 3
    kv[7, 200:203] = -torch.finfo(torch.float32).tiny * 0.7
    key, value = kv[:, :192].view(10, 3, 64), kv[:, 192:].view(10, 3, 64)
    slots = torch.randperm(24, generator=g)[:10]
    want = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        want[0, slot // 4, :, slot % 4] = key[t].to(torch.bfloat16)
        want[1, slot // 4, :, slot % 4] = value[t].to(torch.bfloat16)
    assert (want != 0).any() and want.float().abs().min() == 0
    ops.write_kv_cache(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, want)
    assert cache[0, slots[2] // 4, 0, slots[2] % 4, 3] != 0  # the denormal kept
    with pytest.raises(RuntimeError, match="BFloat16 rows into a Float cache"):
        ops.write_kv_cache(key.bfloat16(), value.bfloat16(), cache[0].float(),
                           cache[1].float(), slots)
    with pytest.raises(RuntimeError, match="Float KV cache under a BFloat16 query"):
        ops.paged_attention(torch.randn(2, 9, 64).bfloat16(), cache[0].float(), cache[1].float(),
                            torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 4]), None,
                            0.125, 0)


def test_kernel_build_failure_falls_back(monkeypatch, tmp_path):
    """No compiler (or any build error): get_cpu_ops() says so and returns None, so every
    layer takes its torch path; KEEL_CPU_KERNEL=0 turns the kernels off."""
    import torch.utils.cpp_extension as cpp_ext

    from keel import cpu_ops

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no finished build there
    monkeypatch.setattr(cpu_ops, "_tried", False)
    monkeypatch.setattr(cpu_ops, "_module", None)
    monkeypatch.setattr(cpp_ext, "load", broken)
    assert cpu_ops.get_cpu_ops() is None
    monkeypatch.setattr(cpu_ops, "_tried", False)
    monkeypatch.setenv("KEEL_CPU_KERNEL", "0")
    assert cpu_ops.get_cpu_ops() is None


def test_kernels_import_their_finished_build(monkeypatch):
    """A later start imports the finished build directly, without the JIT builder's rebuild
    check (setuptools and ninja, ~0.3 s of every start)."""
    import torch.utils.cpp_extension as cpp_ext

    from keel import cpu_ops

    assert cpu_ops.get_cpu_ops() is not None  # built here, or imported

    def no_build(*args, **kwargs):
        raise AssertionError("the finished build should have been imported, not built again")

    monkeypatch.setattr(cpu_ops, "_tried", False)
    monkeypatch.setattr(cpu_ops, "_module", None)
    monkeypatch.setattr(cpp_ext, "load", no_build)
    ops = cpu_ops.get_cpu_ops()
    assert ops is not None and hasattr(ops, "paged_attention")


def test_the_build_target_is_chosen_by_keel_cpu_march(monkeypatch, caplog):
    """`KEEL_CPU_MARCH` replaces `-march=native` (and so names another build folder); a value
    the compiler could not take is refused with the variable named, and keel keeps torch ops;
    the build in use says what it was compiled for."""
    from keel import cpu_ops

    monkeypatch.delenv("KEEL_CPU_MARCH", raising=False)
    assert "-march=native" in cpu_ops._cflags()
    monkeypatch.setenv("KEEL_CPU_MARCH", "x86-64-v3")
    flags = cpu_ops._cflags()
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    assert [f for f in flags if not f.startswith("-march")] == \
        [f for f in cpu_ops._CFLAGS if not f.startswith("-march")]
    monkeypatch.setenv("KEEL_CPU_MARCH", "v3; rm -rf /")
    with pytest.raises(ValueError, match="KEEL_CPU_MARCH"):
        cpu_ops._cflags()
    monkeypatch.setattr(cpu_ops, "_tried", False)
    monkeypatch.setattr(cpu_ops, "_module", None)
    with caplog.at_level("WARNING", logger="keel.cpu_ops"):
        assert cpu_ops.get_cpu_ops() is None
    assert "KEEL_CPU_MARCH" in caplog.text
    monkeypatch.delenv("KEEL_CPU_MARCH")
    monkeypatch.setattr(cpu_ops, "_tried", False)
    ops = cpu_ops.get_cpu_ops()  # this CPU's own build, already made by the tests before
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    assert "avx2" in ops.built_for()
    assert ("avx512f" in ops.built_for()) == ("avx512f" in flags)
    assert ops.amx_gemm_available() <= ("amx_tile" in ops.built_for())


def test_unfinished_or_broken_build_is_not_imported(tmp_path):
    """A build folder without the finished marker is left to the JIT builder, and one whose
    library does not import loses its marker (so it is built again)."""
    from keel import cpu_ops

    name = "keel_cpu_ops_test"
    (tmp_path / f"{name}.so").write_bytes(b"not a shared library")
    assert cpu_ops._import_built(name, tmp_path) is None  # no marker: not finished
    cpu_ops._mark_built(tmp_path, name)
    assert (tmp_path / cpu_ops._DONE).is_file()
    assert cpu_ops._import_built(name, tmp_path) is None  # does not import
    assert not (tmp_path / cpu_ops._DONE).exists()


@pytest.mark.parametrize("head_size,dtype", [(8, torch.float32), (16, torch.float32),
                                             (64, torch.bfloat16), (64, torch.float32)])
def test_kernel_kv_write_matches_torch_and_checks_slots(head_size, dtype, monkeypatch):
    """The compiled K/V write puts strided rows where the torch path does (head-major blocks:
    slot s, head h at [s // block_size, h, s % block_size]), and refuses a slot outside the
    cache instead of writing past it, for rows shorter and longer than a cache line."""
    ops = get_cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(3)
    d = head_size
    cache = torch.zeros(2, 12, 3, 4, d, dtype=dtype)  # 12 blocks of 4 slots, 3 KV heads
    T = 40  # more rows than one thread's share (16): the rows are written on both threads
    kv = torch.randn(T, 2 * 3 * d, generator=g).to(dtype)  # one [T, k | v] buffer: strided
    key, value = kv[:, :3 * d].view(T, 3, d), kv[:, 3 * d:].view(T, 3, d)
    slots = torch.randperm(48, generator=g)[:T]
    want = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        want[0, slot // 4, :, slot % 4] = key[t]
        want[1, slot // 4, :, slot % 4] = value[t]
    torch_cache = cache.clone()
    monkeypatch.setattr(torch_paged, "get_cpu_ops", lambda: None)
    torch_paged.write_kv_cache(key, value, torch_cache, slots)
    assert torch.equal(torch_cache, want)
    ops.write_kv_cache(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv_cache(key[:5], value[:5], cache[0], cache[1], torch.tensor([0, 1, 2, 3, 48]))


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (16, 1, 32, 8), (4, 1, 128, 16), (8, 2, 40, 4)])
def test_an_int8_cache(monkeypatch, use_kernel, dtype, tol, window, heads, kv_heads, head_dim,
                       block_size):
    """kv_cache_dtype="int8": each row of K and V is kept as int8 with its float32 scale, and
    attention over it is attention over the rows scaled back (the kernel's 16-lane path for
    head sizes of 32, 64, 128 with blocks of 8 or 16 where the CPU has AVX-512, its plain
    loop elsewhere; the torch path), for decode rows and short chunks. The kernel never reads
    an unwritten row's scale (NaN here)."""
    use_kernel_or_torch(monkeypatch, use_kernel)
    fill = float("nan") if use_kernel else 3.0  # (the torch path multiplies masked rows by 0)
    seq_lens = [1, 13, 40, 64, 5, 150, 97]
    out, ref = run_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, dtype, window,
                        block_size, fill=fill, cache_dtype=torch.int8)
    assert not out.isnan().any()
    assert (out - ref).abs().max().item() < tol
    out, ref = run_case([9, 17, 4, 30], [9, 6, 1, 1], heads, kv_heads, head_dim, dtype, window,
                        block_size, fill=fill, cache_dtype=torch.int8)
    assert (out - ref).abs().max().item() < tol


@pytest.mark.parametrize("prefill_kernel", [True, False])
def test_long_chunks_over_an_int8_cache(monkeypatch, prefill_kernel):
    """A long chunk after context reads its context from the int8 cache, scaled back to its
    queries' dtype; a whole long prompt attends to its own K/V, which differ from the kept ones
    by their quantization."""
    monkeypatch.setattr(torch_paged, "CPU_KERNEL_MAX_QUERY_LEN", 8)
    monkeypatch.setattr(chunk_kernels, "PREFILL_KERNEL", prefill_kernel)
    out, ref = run_case([9, 17, 4, 30, 30], [9, 6, 1, 1, 12], 9, 3, 64, torch.float32, None,
                        16, cache_dtype=torch.int8)
    assert (out - ref).abs().max().item() < 5e-2
    assert (out[-12:] - ref[-12:]).abs().max().item() < 1e-5  # the chunk after context


def test_int8_rows_and_their_scales():
    """keel's compiled write quantizes each row as quantize_rows does (the same bits: int8 to
    nearest, ties to even, scale amax / 127, 0 for a row of zeros), from float32 or bfloat16
    rows, each value within half a scale step; the op refuses an int8 cache without scales
    and scales with another cache."""
    ops = get_cpu_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(2, 6, 3, 4, 64, dtype=torch.int8)
        scales = torch.zeros(2, 6, 3, 4)
        kv = (torch.randn(10, 2 * 3 * 64, generator=g) * 3).to(dtype)
        kv[2, :64] = 0.0  # a zero row
        kv[4, 5] = 1e4  # one large value: the rest of its row rounds to few steps
        key, value = kv[:, :192].view(10, 3, 64), kv[:, 192:].view(10, 3, 64)
        slots = torch.randperm(24, generator=g)[:10]
        want, want_s = cache.clone(), scales.clone()
        for t, slot in enumerate(slots.tolist()):
            for i, rows in enumerate((key, value)):
                q, s = quantize_rows(rows[t])
                want[i, slot // 4, :, slot % 4], want_s[i, slot // 4, :, slot % 4] = q, s
        ops.write_kv_cache(key, value, cache[0], cache[1], slots, scales[0], scales[1])
        assert torch.equal(cache, want) and torch.equal(scales, want_s)
        back = cache.float() * scales[..., None]
        for t, slot in enumerate(slots.tolist()):
            err = (back[0, slot // 4, :, slot % 4] - key[t].float()).abs()
            assert (err <= scales[0, slot // 4, :, slot % 4, None] / 2 + 1e-6).all()
        assert scales[0, slots[2] // 4, 0, slots[2] % 4] == 0
    with pytest.raises(RuntimeError, match="key_scale and value_scale go with an int8 cache"):
        ops.write_kv_cache(key, value, cache[0], cache[1], slots)
    with pytest.raises(RuntimeError, match="an int8 KV cache needs key_scale and value_scale"):
        ops.paged_attention(torch.randn(2, 9, 64), cache[0], cache[1],
                            torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 4]), None,
                            0.125, 0)
    with pytest.raises(RuntimeError, match="scales are for an int8 KV cache only"):
        ops.paged_attention(torch.randn(2, 9, 64), cache[0].float(), cache[1].float(),
                            torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 4]), None,
                            0.125, 0, scales[0], scales[1])


def test_the_avx2_build_reads_an_int8_cache(tmp_path):
    """On a CPU with AVX-512 the tests above run `decode_row16`; `decode_row` (8 lanes, what
    an AVX2-only CPU runs) is checked here by building keel's kernels for x86-64-v3 (AVX2, no
    AVX-512) in a subprocess: decode rows, and several tokens of a request read together, over
    an int8 cache (widened by one vpmovsxbd a load), a bfloat16 and a float32 one, against the
    reference."""
    with open("/proc/cpuinfo") as f:
        assert "avx2" in f.read().split(), "keel's CI machines have AVX2"
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import keel.cpu_ops as c
ops = c.get_cpu_ops()
assert ops is not None
assert "avx2" in ops.built_for() and "avx512f" not in ops.built_for(), ops.built_for()
from test_paged_attention import run_case
seq_lens = [1, 13, 40, 64, 5, 150, 97]
for cache, dtype, tol in ((torch.int8, torch.float32, 1e-5), (torch.int8, torch.bfloat16, 3e-2),
                          (None, torch.bfloat16, 3e-2), (None, torch.float32, 1e-5)):
    for window in (None, 7):
        for q_lens in ([1] * len(seq_lens), [1, 4, 20, 1, 5, 17, 3]):  # decode rows, groups
            out, ref = run_case(seq_lens, q_lens, 9, 3, 64, dtype, window, 16,
                                fill=float("nan"), cache_dtype=cache)
            assert not out.isnan().any(), (cache, dtype)
            assert (out - ref).abs().max().item() < tol, (cache, dtype, window, q_lens)
print("ok")
"""
    env = {**os.environ, "KEEL_CPU_MARCH": "x86-64-v3"}  # AVX2 and FMA, no AVX-512
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
