"""The attention layer models use. It takes q/k/v of the flat batch and nothing about paging:
block tables and slot mappings come from the forward context, the KV cache is bound by the
runner (`bind_kv_cache`)."""

from __future__ import annotations

import math
import mmap

import torch
from torch import nn

from keel.attention.backends.torch_paged import paged_attention
from keel.attention.forward_context import get_forward_context
from keel.utils import kv_cache_on_huge_pages


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.prefix = prefix
        # [2, num_blocks, num_kv_heads, block_size, head_size]; set by bind_kv_cache.
        self.kv_cache: torch.Tensor | None = None
        # An int8 cache's float32 scales, [2, num_blocks, num_kv_heads, block_size].
        self.kv_scale: torch.Tensor | None = None
        # Long prompt chunks on int16 dot products (process_weights_after_loading).
        self.int16_prompt_attention = False

    def process_weights_after_loading(self) -> None:
        """Under dtype="auto" with the model's GEMMs on int16 dot products or float16 FMAs
        (gemm_choice.int16_attention_chosen), its long prompt chunks' attention runs on
        int16 dot products too (keel/csrc/prefill_attention_i16.cpp)."""
        from keel.model_executor.layers import gemm_choice

        self.int16_prompt_attention = gemm_choice.int16_attention_chosen()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H * D], k/v: [T, Hkv * D] -> [T, H * D]."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.prefix}: no KV cache bound; call bind_kv_cache first.")
        meta = get_forward_context().attn_metadata
        t = q.shape[0]
        return paged_attention(
            q.view(t, self.num_heads, self.head_size),
            k.view(t, self.num_kv_heads, self.head_size),
            v.view(t, self.num_kv_heads, self.head_size),
            self.kv_cache,
            meta,
            self.scale,
            self.sliding_window,
            self.kv_scale,
            self.int16_prompt_attention,
        )


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_cache(model: nn.Module, kv_caches: list[torch.Tensor],
                  kv_scales: list[torch.Tensor] | None = None) -> None:
    """Give each attention layer (in model order) its own cache tensor."""
    layers = attention_layers(model)
    if len(layers) != len(kv_caches):
        raise ValueError(f"{len(layers)} attention layers but {len(kv_caches)} KV caches.")
    for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
        layer.kv_cache = cache
        layer.kv_scale = kv_scales[i] if kv_scales is not None else None


def allocate_kv_caches(
    model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One [2, num_blocks, Hkv, block_size, D] tensor per attention layer, bound to the model:
    head-major blocks, so one KV head's keys (or values) of a block are one contiguous run,
    which the attention kernels read as one stream (see torch_paged). An int8 cache
    (kv_cache_dtype="int8") also gets each layer's float32 scales, one per row of K or V
    ([2, num_blocks, Hkv, block_size]), bound to the layer beside its cache."""
    layers = attention_layers(model)
    caches = [
        _zeros((2, num_blocks, layer.num_kv_heads, block_size, layer.head_size), dtype, device)
        for layer in layers
    ]
    scales = None
    if dtype == torch.int8:
        scales = [_zeros((2, num_blocks, layer.num_kv_heads, block_size), torch.float32, device)
                  for layer in layers]
    bind_kv_cache(model, caches, scales)
    return caches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU it is backed by an anonymous mmap: the kernel hands out zero
    pages lazily, so a large KV budget costs memory only as blocks are first written (and
    start-up does not memset gigabytes)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    # Private, not mmap's default shared mapping: a shared one is shmem, whose first-touch
    # faults cost ~1.5x as much (measured here), and nothing else maps the cache.
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kv_cache_on_huge_pages():
        buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: pages come huge from then on
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    scale = 4 if dtype == torch.int8 else 0  # an int8 cache's float32 scale per row
    return sum(
        2 * block_size * layer.num_kv_heads * (layer.head_size * elem + scale)
        for layer in attention_layers(model)
    )


class EncoderOnlyAttention(nn.Module):
    """Bidirectional attention within each request of the flat batch, and no KV cache (an
    encoder such as BERT sees its whole prompt in one pass: the engine turns chunked prefill
    and prefix caching off for it). Not an `Attention`, so no KV cache is allocated for it.

    The pass's tokens are scattered into a padded [R, max_query_len] layout (the same
    `query_rows` the decoder path uses), attended with padded keys masked, and gathered back.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, prefix: str = "") -> None:
        super().__init__()
        self.num_heads, self.head_size, self.scale, self.prefix = (num_heads, head_size, scale,
                                                                   prefix)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [T, H * D] -> [T, H * D]."""
        meta = get_forward_context().attn_metadata
        t, h, d = q.shape[0], self.num_heads, self.head_size
        num_reqs, q_len = meta.num_reqs, meta.max_query_len
        if q_len == 1:
            return v  # one token per request: it attends to itself only
        rows = meta.query_rows  # [T] row of each token in [R * max_query_len]

        def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H*D] -> [R, H, Q, D]
            out = x.new_zeros(num_reqs * q_len, h, d)
            out.index_copy_(0, rows, x.view(t, h, d))
            return out.view(num_reqs, q_len, h, d).transpose(1, 2)

        qsl = meta.query_start_loc.to(torch.int64)
        key_valid = torch.arange(q_len, device=q.device) < (qsl[1:] - qsl[:-1])[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            padded(q), padded(k), padded(v), attn_mask=key_valid[:, None, None, :],
            scale=self.scale)  # [R, H, Q, D]
        return out.transpose(1, 2).reshape(num_reqs * q_len, h * d)[rows]
