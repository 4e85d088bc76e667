"""A portable paged attention in plain torch (CPU and CUDA).

KV cache layout, per layer: `[2, num_blocks, num_kv_heads, block_size, head_dim]` (K then V):
head-major blocks, so one KV head's keys of a block are one contiguous run (4 KiB at 16 x 64
float32), which a decode row's walk reads as one stream: at 64 requests and 600 tokens of
context the CPU kernel read K/V ~10% faster than from token-major blocks (BENCHMARKS.md). Token t of the flat
batch writes its K/V at `slot_mapping[t]` (= block_id * block_size + offset); request r reads
its keys through its row of the block table.

The kernel is vectorised over the whole batch, with no Python loop over tokens or requests:
  1. scatter this pass's K/V into the cache (one `index_copy_` each; on the CPU, keel's
     compiled copy),
  2. gather every request's blocks into a padded `[num_reqs, kv_len]` view (one `index_select`
     over whole blocks, kv_len = max_seq_len rounded up to a block),
  3. scatter the flat queries into a padded `[num_reqs, max_query_len]` view,
  4. one `scaled_dot_product_attention` with a per-request causal mask,
  5. gather the real query rows back into the flat token order.
Steps 2-3 use indices that depend only on the batch, so they are built once per pass in
`build_attention_metadata` and shared by every layer. A pure-decode pass (every query length 1)
skips the query scatter entirely.

On the CPU, keel's compiled kernel (`keel/cpu_ops.py`) replaces steps 2-5: it treats each
query token as a row whose keys end at the token's position, and reads K/V in place through
the block table, with no gathered or padded copy; up to 16 consecutive tokens of one request (a
speculative step's drafts, a short prompt) share each key and value it reads. A request with more than
`CPU_KERNEL_MAX_QUERY_LEN` query tokens in the pass (a long prompt chunk) goes on its own to
keel's causal prefill kernel instead (in bfloat16 on a CPU with AMX tiles, keel's AMX one; or
SDPA where it times faster or the kernels do not apply; blocked loops win once many queries
share each key), unpadded, while the other requests of the pass stay on the kernel: padding a batch of
decodes to a 700-token chunk made a mixed pass 30-100x slower. A faster CUDA kernel can take
the same place later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from keel.attention.backends import chunk_kernels
from keel.cpu_ops import get_cpu_ops

# The per-row kernel's cost per query token grows with its context (one pass over its keys); the
# chunk kernels share each key among a request's queries. Measured on 2 cores (9 heads, 3 KV
# heads, head_dim 64, float32, prompts without context), the prefill kernel's speed over the
# per-row one for one request / eight: 1.06x / 0.77x at 32 queries, 1.57x / 1.08x at 64,
# 2.05x / 1.41x at 128. Against SDPA (the fallback) the per-row kernel ties at 256 queries for
# one request and is 1.4x faster for eight.
CPU_KERNEL_MAX_QUERY_LEN = 64 if chunk_kernels.PREFILL_KERNEL else 256


@dataclass(slots=True)
class PagedAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, E.g. [0, 2, 7, 10]
    seq_lens: torch.Tensor  # [num_reqs] context + this pass's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Derived once per pass, shared by all layers:
    kv_blocks: torch.Tensor  # [num_reqs, kv_len // block_size] int64 block ids to gather
    kv_len: int  # padded key length: max_seq_len rounded up to whole blocks
    query_rows: torch.Tensor | None  # [num_tokens] row in the padded [num_reqs*max_query_len]
    query_pos: torch.Tensor  # [num_reqs, max_query_len] absolute position of each padded query
    # Per query token, for the CPU kernel (None in pure decode: row r is token r, seq_lens):
    token_rows: torch.Tensor | None  # [num_tokens] int32 request (block-table row) of token t
    token_seq_lens: torch.Tensor | None  # [num_tokens] int64 keys visible to token t
    # CPU, a pass with a long prompt chunk: (request, first token, query len, seq len) of each
    # long chunk (SDPA, one request at a time), and the tokens of every other request (kernel).
    long_chunks: list[tuple[int, int, int, int]] | None = None
    short_tokens: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict)  # sliding_window -> bool mask

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """bool [num_reqs, 1, max_query_len, kv_len]: key j visible to query i of request r."""
        m = self._masks.get(sliding_window)
        if m is None:
            key_pos = torch.arange(self.kv_len, device=self.seq_lens.device)
            qpos = self.query_pos[:, :, None]  # [R, Q, 1]
            m = (key_pos <= qpos) & (key_pos < self.seq_lens[:, None, None])
            if sliding_window is not None:
                m &= key_pos > qpos - sliding_window
            m = m[:, None]
            self._masks[sliding_window] = m
        return m


def build_attention_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> PagedAttentionMetadata:
    """Build the per-pass metadata. Tensors must already be on the compute device and cover
    exactly `num_reqs` requests (`query_start_loc` has num_reqs + 1 entries)."""
    device = seq_lens.device
    seq_lens = seq_lens.to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    query_lens = qsl[1:] - qsl[:-1]  # [R]
    num_tokens = int(slot_mapping.shape[0])
    if max_query_len is None:
        max_query_len = int(query_lens.max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())

    # The blocks that hold each request's keys. Entries past a request's own blocks are stale
    # but valid block ids; the mask hides what they hold.
    num_kv_blocks = -(-max_seq_len // block_size)
    kv_blocks = block_table[:, :num_kv_blocks].to(torch.int64)

    context_lens = seq_lens - query_lens  # tokens already in the cache before this pass
    query_pos = context_lens[:, None] + torch.arange(max_query_len, device=device)  # [R, Q]
    if max_query_len == 1:
        query_rows = token_rows = token_seq_lens = None  # row r is token r: nothing to scatter
    else:
        # E.g. query_start_loc [0, 2, 7, 10], max_query_len 5 -> rows [0,1, 5..9, 10,11,12]
        tok = torch.arange(num_tokens, device=device)
        req = torch.repeat_interleave(torch.arange(len(query_lens), device=device), query_lens)
        offset = tok - qsl[req]  # index of token t among its request's queries
        query_rows = req * max_query_len + offset
        token_rows = req.to(torch.int32)
        token_seq_lens = context_lens[req] + offset + 1
    long_chunks = short_tokens = None
    if device.type == "cpu" and max_query_len > CPU_KERNEL_MAX_QUERY_LEN:
        is_long = query_lens > CPU_KERNEL_MAX_QUERY_LEN
        long_chunks = [(r, int(qsl[r]), int(query_lens[r]), int(seq_lens[r]))
                       for r in torch.nonzero(is_long).flatten().tolist()]
        short = torch.nonzero(~is_long[req]).flatten()
        short_tokens = short if len(short) else None
    return PagedAttentionMetadata(
        num_actual_tokens=num_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        kv_blocks=kv_blocks,
        kv_len=num_kv_blocks * block_size,
        query_rows=query_rows,
        query_pos=query_pos,
        token_rows=token_rows,
        token_seq_lens=token_seq_lens,
        long_chunks=long_chunks,
        short_tokens=short_tokens,
    )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] rows -> (int8 rows, float32 scales [...]): each row scaled by 127 / amax and
    rounded to nearest (ties to even), its scale amax / 127, so q * scale is the row to within
    half a scale step; a row of zeros has scale 0. keel's compiled write computes the same
    bits."""
    x = x.float()
    amax = x.abs().amax(-1)
    # 127 / amax divided as the C++ divides (a Python scalar over a tensor is amax's
    # reciprocal times 127 in torch, which rounds differently)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def cache_rows(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, i: int,
               blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K (i = 0) or V (1) of the given blocks, [blocks, Hkv, block_size, D], widened to
    `dtype`; an int8 cache's rows times their scales (in float32, then rounded to `dtype`)."""
    rows = kv_cache[i].index_select(0, blocks)
    if kv_scale is None:
        return rows.to(dtype)
    return (rows.float() * kv_scale[i].index_select(0, blocks)[..., None]).to(dtype)


def _scale_args(kv_scale: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The compiled op's key_scale and value_scale for an int8 cache; none for another."""
    return () if kv_scale is None else (kv_scale[0], kv_scale[1])


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] -> their slots in the cache (an int8
    cache: quantized, their scales into kv_scale)."""
    ops = get_cpu_ops() if kv_cache.device.type == "cpu" else None
    if kv_cache.dtype == torch.int8:
        if kv_scale is None:
            raise ValueError("an int8 KV cache needs its scales (kv_scale)")
        if ops is not None:
            ops.write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping,
                               *_scale_args(kv_scale))
            return
        block_size = kv_cache.shape[3]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        for i, rows in enumerate((key, value)):
            q, s = quantize_rows(rows)
            kv_cache[i].transpose(1, 2)[blocks, offsets] = q
            kv_scale[i].transpose(1, 2)[blocks, offsets] = s
        return
    # keel's copy takes rows of the cache's dtype, or float32 rows into a bfloat16 cache.
    if ops is not None and key.dtype == value.dtype and (
            key.dtype == kv_cache.dtype
            or (key.dtype == torch.float32 and kv_cache.dtype == torch.bfloat16)):
        ops.write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping)
        return
    block_size = kv_cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[0].transpose(1, 2)[blocks, offsets] = key.to(kv_cache.dtype)
    kv_cache[1].transpose(1, 2)[blocks, offsets] = value.to(kv_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_scale: torch.Tensor | None = None,
    int16_prompts: bool = False,
) -> torch.Tensor:
    """query: [T, H, D]; key/value: [T, Hkv, D] (this pass's tokens). Returns [T, H * D].
    An int8 cache comes with its scales, kv_scale [2, num_blocks, Hkv, block_size].
    int16_prompts: long prompt chunks may run on int16 dot products (chunk_kernel_name)."""
    n = meta.num_actual_tokens
    query, key, value = query[:n], key[:n], value[:n]
    write_kv_cache(key, value, kv_cache, meta.slot_mapping, kv_scale)
    scales = _scale_args(kv_scale)

    _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    ops = get_cpu_ops() if kv_cache.device.type == "cpu" else None
    if ops is not None and meta.long_chunks is None:
        # One row per query token, K/V read in place: no gathered copy.
        decode = meta.query_rows is None
        out = ops.paged_attention(
            query, kv_cache[0], kv_cache[1], meta.block_table,
            meta.seq_lens if decode else meta.token_seq_lens,
            None if decode else meta.token_rows, scale, sliding_window or 0, *scales,
        )
        return out.view(n, num_heads * head_dim)
    if ops is not None:
        return _split_attention(ops, query, key, value, kv_cache, meta, scale, sliding_window,
                                kv_scale, int16_prompts)
    r, s, q_len = meta.num_reqs, meta.kv_len, meta.max_query_len
    blocks = meta.kv_blocks.view(-1)
    # [R * NB, Hkv, block_size, D] -> [R, Hkv, NB, block_size, D] -> [R, Hkv, S, D]
    shape = (r, s // block_size, num_kv_heads, block_size, head_dim)
    # A cache narrower than the query (kv_cache_dtype) is widened: the arithmetic stays in
    # the query's dtype, as in keel's CPU kernels.
    k = cache_rows(kv_cache, kv_scale, 0, blocks, query.dtype).view(shape).transpose(1, 2)
    v = cache_rows(kv_cache, kv_scale, 1, blocks, query.dtype).view(shape).transpose(1, 2)
    k = k.reshape(r, num_kv_heads, s, head_dim)
    v = v.reshape(r, num_kv_heads, s, head_dim)

    if meta.query_rows is None:  # pure decode: one query per request, already in row order
        q = query.view(r, 1, num_heads, head_dim)
    else:
        q = query.new_zeros(r * q_len, num_heads, head_dim)
        q.index_copy_(0, meta.query_rows, query)
        q = q.view(r, q_len, num_heads, head_dim)
    q = q.transpose(1, 2)  # [R, H, Q, D]

    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=meta.mask(sliding_window),
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [R, H, Q, D]
    out = out.transpose(1, 2).reshape(r * q_len, num_heads * head_dim)
    if meta.query_rows is not None:
        out = out.index_select(0, meta.query_rows)
    return out


def _split_attention(ops, query, key, value, kv_cache, meta: PagedAttentionMetadata,
                     scale: float, sliding_window: int | None,
                     kv_scale: torch.Tensor | None = None,
                     int16_prompts: bool = False) -> torch.Tensor:
    """CPU, a pass with long prompt chunks: the kernel for every other request's tokens, and
    SDPA for each long chunk alone over its own keys (no padding to the longest)."""
    n, num_heads, head_dim = query.shape
    out = query.new_empty(n, num_heads * head_dim)
    idx = meta.short_tokens
    if idx is not None:
        rows = ops.paged_attention(
            query.index_select(0, idx), kv_cache[0], kv_cache[1], meta.block_table,
            meta.token_seq_lens.index_select(0, idx), meta.token_rows.index_select(0, idx),
            scale, sliding_window or 0, *_scale_args(kv_scale),
        )
        out.index_copy_(0, idx, rows.view(len(idx), -1))
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    kernel = None
    if (query.dtype == key.dtype == value.dtype
            and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (query, key, value))):
        name = chunk_kernels.chunk_kernel_name(ops, query.dtype, num_heads, num_kv_heads,
                                               head_dim, int16_prompts)
        kernel = getattr(ops, name) if name is not None else None
    for req, start, q_len, seq_len in meta.long_chunks:
        context = seq_len - q_len
        if context == 0:  # a whole prompt: its keys are this pass's own
            k, v = key[start : start + q_len], value[start : start + q_len]
        else:
            blocks = meta.block_table[req, : -(-seq_len // block_size)].to(torch.int64)
            # [blocks, Hkv, block_size, D] -> [blocks * block_size, Hkv, D]
            # Widened where the cache is narrower than the query (kv_cache_dtype).
            k = cache_rows(kv_cache, kv_scale, 0, blocks, query.dtype).transpose(1, 2)
            v = cache_rows(kv_cache, kv_scale, 1, blocks, query.dtype).transpose(1, 2)
            k = k.reshape(-1, num_kv_heads, head_dim)[:seq_len]
            v = v.reshape(-1, num_kv_heads, head_dim)[:seq_len]
        if kernel is not None:  # ~2x SDPA's speed at 600 tokens (BENCHMARKS.md)
            kernel(query[start : start + q_len], k, v, out[start : start + q_len], scale,
                   sliding_window or 0)
            continue
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        mask = None
        if context or sliding_window:  # built once per pass, shared by every layer
            mask = meta._masks.get((req, sliding_window))
            if mask is None:
                qpos = torch.arange(context, seq_len)[:, None]
                kpos = torch.arange(seq_len)[None]
                mask = kpos <= qpos
                if sliding_window:
                    mask &= kpos > qpos - sliding_window
                meta._masks[(req, sliding_window)] = mask
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[start : start + q_len] = o[0].transpose(0, 1).reshape(q_len, -1).to(out.dtype)
    return out
