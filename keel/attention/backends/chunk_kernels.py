"""Which kernel takes a long causal prompt chunk on the CPU: keel's prefill kernel (float32, or
bfloat16 without AMX), keel's AMX or int16 one, or torch's SDPA, by dtype, shape and CPU (timed
once per shape where the CPU has AMX tiles). torch_paged._split_attention and the fused pass
(layers/fused_decode.py) both ask `chunk_kernel_name`."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from keel import dtypes

# A long prompt chunk goes to keel's causal prefill kernel (keel/csrc/prefill_attention.cpp): a
# flash-attention loop whose work items share each key among 16 query rows and a KV head's query
# heads. `KEEL_PREFILL_ATTENTION=0` sends those chunks to torch's SDPA instead (also where the
# kernel does not apply: a head size not a multiple of 16, more than 16 query heads per KV head).
PREFILL_KERNEL = os.environ.get("KEEL_PREFILL_ATTENTION", "1") != "0"

_long_chunk_kernels: dict[tuple, str | None] = {}  # (dtype, H, Hkv, D) -> measured once


def long_chunk_kernel(ops, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> str | None:
    """Which of keel's kernels runs a long causal chunk here (the name of its op), or None for
    torch's SDPA. In float32, and on CPUs without AMX, keel's prefill kernel (~1.1-2x SDPA,
    BENCHMARKS.md fifth round), unmeasured. Where the CPU has AMX tiles, SDPA's bfloat16 /
    float16 GEMMs run on them (2.5x the prefill kernel on a 600-token chunk, seventeenth
    round), and so does keel's AMX kernel (bfloat16, head size a multiple of 32; ~2x SDPA,
    eighteenth round): keel's kernel for the shape and SDPA are timed once per shape on a
    512-token chunk, and the faster kept."""
    if dtype == torch.float32 or not dtypes.cpu_has_amx_bfloat16():
        return "prefill_attention"
    key = (dtype, num_heads, num_kv_heads, head_dim)
    if key in _long_chunk_kernels:
        return _long_chunk_kernels[key]
    from keel.utils import best_seconds

    name = "prefill_attention"
    if (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256
            and getattr(ops, "prefill_attention_amx_available", lambda: False)()):
        name = "prefill_attention_amx"
    fn = getattr(ops, name)
    n = 512
    q = torch.randn(n, num_heads, head_dim).to(dtype)
    k, v = (torch.randn(n, num_kv_heads, head_dim).to(dtype) for _ in range(2))
    out = q.new_empty(n, num_heads * head_dim)
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    kernel = best_seconds(lambda: fn(q, k, v, out, 1.0, 0), 5)
    sdpa = best_seconds(lambda: F.scaled_dot_product_attention(
        qt, kt, vt, is_causal=True, enable_gqa=num_heads != num_kv_heads), 5)
    _long_chunk_kernels[key] = name if kernel <= sdpa else None
    return _long_chunk_kernels[key]


def bfloat16_chunks_on_int16() -> bool:
    """Whether a bfloat16 model's long chunks run on int16 dot products
    (prefill_attention_i16, where the build has AVX512-VNNI) even where its GEMMs do not: on a
    CPU without AMX tiles (which have their own bfloat16 kernel), unless KEEL_I16_ATTENTION=0.
    Over bfloat16 queries, keys and values the float32 kernel's arithmetic is exact but its
    output is rounded to bfloat16, and that rounding is most of either kernel's error: on
    random chunks 1.42e-3 mean relative error against 1.39e-3. A long prompt phase of
    `dtype="bfloat16"` took 0.953x the time with it on an AMD EPYC Zen 4 (BENCHMARKS.md,
    sixty-seventh round)."""
    from keel.model_executor.layers.gemm_choice import forced_choice

    forced = forced_choice("KEEL_I16_ATTENTION", "float32 FMAs", "int16 dot products")
    return forced is not False and not dtypes.cpu_has_amx_bfloat16()


def chunk_kernel_name(ops, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                      head_dim: int, int16: bool = False) -> str | None:
    """The name of keel's kernel that takes a long chunk of this shape (dense rows of one
    dtype), or None for torch's SDPA. The fused pass (layers/fused_decode.py) asks the same.
    int16: the layer's prompt attention may run on int16 dot products
    (Attention.int16_prompt_attention: dtype="auto" with its GEMMs on i16_gemm or fp16_gemm),
    which prefill_attention_i16 does where the build has AVX512-VNNI; a bfloat16 chunk may
    without AMX tiles too (bfloat16_chunks_on_int16)."""
    if (not PREFILL_KERNEL or dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or head_dim % 16 != 0):
        return None
    if ((int16 or (dtype == torch.bfloat16 and bfloat16_chunks_on_int16()))
            and dtype in (torch.float32, torch.bfloat16) and num_heads // num_kv_heads <= 16
            and ops.prefill_attention_i16_available()):
        return "prefill_attention_i16"
    name = long_chunk_kernel(ops, dtype, num_heads, num_kv_heads, head_dim)
    # keel's prefill kernel takes at most 16 query heads per KV head; the AMX one any.
    if name == "prefill_attention_amx" or (
            name == "prefill_attention" and num_heads // num_kv_heads <= 16):
        return name
    return None
