"""Which dtypes a model computes in and keeps its K/V in: the names a user may type, and the
rules behind `dtype="auto"` and `kv_cache_dtype="auto"` for the CPU keel finds.

ModelConfig and CacheConfig (keel/config.py) call these; every failure is a `ValueError` that
names the value to change.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")


@functools.cache
def cpu_has_amx_bfloat16() -> bool:
    """Whether this CPU has AMX tiles and oneDNN computes bfloat16 GEMMs on them (asked once:
    the attention backend asks on every pass with long prompt chunks).

    `KEEL_AMX=0` answers no, and keel's own AMX kernels stay off (csrc/prefill_attention_amx.cpp):
    keel then chooses and runs as on an AVX-512 CPU without tiles. With
    `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` oneDNN leaves them too; together they stand in for
    an AVX-512 Xeon without AMX (`benchmarks/vs_vllm.py --no-amx`)."""
    if os.environ.get("KEEL_AMX", "1") == "0":
        return False
    return bool(torch.cpu._is_amx_tile_supported()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def checkpoint_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    """The dtype a user's `dtype` names; for "auto", the checkpoint's own (config.json's
    `dtype` / `torch_dtype`, float32 when absent), with float16 computed in bfloat16 on a
    CPU (float16 matmuls are slow and inaccurate on most CPUs; bfloat16 keeps the range)."""
    if dtype == "auto":
        dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(dt, str):
            dt = DTYPES.get(dt, torch.float32)
        dt = dt or torch.float32
        if dt == torch.float16 and device.type == "cpu":
            dt = torch.bfloat16
        return dt
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}: use one of auto, float32, bfloat16, float16.")
    return DTYPES[dtype]


# Weights kept as a GGUF file's own blocks count as the checkpoint's weights here, not as a
# quantization the user asked for: on an AMX CPU the default model computed in float32 over
# its int4 blocks ran 64 long requests at 82-108 tok/s against 326-398 in bfloat16 (AMX GEMMs,
# the blocks' int4 kernels kept for one-row passes), and its float32 K/V doubled a long
# decode step's reads (BENCHMARKS.md, fortieth round). keel's own int8 / int4 / w8a8, asked for
# by name, keep the float32 arithmetic their kernels are made for.
_AUTO_QUANTIZATIONS = (None, "gguf")


def _cpu_float32_auto(dtype: str, compute: torch.dtype, device: torch.device, runner: str,
                      quantization: str | None) -> bool:
    """dtype="auto" left a generating float32 model on a CPU, its weights dense or a GGUF
    file's blocks: the case both rules below are about."""
    return (dtype == "auto" and compute == torch.float32 and device.type == "cpu"
            and runner == "generate" and quantization in _AUTO_QUANTIZATIONS)


def auto_compute_dtype(dtype: str, compute: torch.dtype, device: torch.device, runner: str,
                       quantization: str | None) -> torch.dtype:
    """dtype="auto" on a CPU with AMX tiles computes a float32 checkpoint in bfloat16, as
    vLLM's "auto" does for any float32 checkpoint: there oneDNN's bfloat16 GEMMs run 4-8x
    faster than float32 (BENCHMARKS.md, seventeenth round). Elsewhere (AVX2, or AVX512-BF16
    without AMX) bfloat16 GEMMs are no faster than float32 and float32 stays. Only for a
    generating model whose weights are dense or a GGUF file's blocks (_AUTO_QUANTIZATIONS);
    dtype="float32" keeps float32."""
    if _cpu_float32_auto(dtype, compute, device, runner, quantization) and cpu_has_amx_bfloat16():
        logger.info("dtype='auto': this float32 model computes in bfloat16 on this CPU "
                    "(AMX tiles); pass dtype='float32' to keep float32.")
        return torch.bfloat16
    return compute


def auto_kv_cache_dtype(dtype: str, compute: torch.dtype, device: torch.device, runner: str,
                        quantization: str | None) -> torch.dtype:
    """dtype="auto" on a CPU that computes a float32 model in float32 (no AMX tiles) keeps its
    K/V in bfloat16, as llama.cpp keeps a float32 model's in float16: a long decode step reads
    every request's K/V once per layer, and with half the bytes the CPU attention ran ~1.9x
    faster and a long decode step 1.28-1.43x (BENCHMARKS.md, twenty-sixth round); the
    arithmetic stays float32. `compute` is the dtype after auto_compute_dtype. Only for a
    generating model whose weights are dense or a GGUF file's blocks (llama.cpp keeps a GGUF
    model's K/V in float16 by default); an explicit dtype keeps the cache in that dtype."""
    if _cpu_float32_auto(dtype, compute, device, runner, quantization):
        return torch.bfloat16
    return compute


def auto_float16_gemms(dtype: str, compute: torch.dtype, device: torch.device, runner: str,
                       quantization: str | None) -> bool:
    """dtype="auto" on a CPU that computes a float32 model in float32 (no AMX tiles) lets its
    GEMMs run on float16 FMAs where the CPU has AVX512-FP16 and they measure faster
    (layers/gemm_choice.py fp16_gemm_chosen): x and W rounded to float16 (11 significant bits,
    bfloat16's 8) and float32 results, as "auto" computes such a model in bfloat16 where the
    CPU has AMX; without AVX512-FP16 but with AVX512-VNNI, on int16 dot products (x and W as
    int16 scaled per block of 128 values, ~1/8 of bfloat16 arithmetic's mean error on the
    default model's layers).
    `compute` is the dtype after auto_compute_dtype; the same models as
    auto_kv_cache_dtype. dtype="float32" keeps float32 GEMMs."""
    return _cpu_float32_auto(dtype, compute, device, runner, quantization)


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"Unknown kv_cache_dtype {name!r}: use auto, float32, bfloat16 or int8.")


def kv_cache_dtype(name: str, compute: torch.dtype, auto: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for `kv_cache_dtype=name` under compute dtype `compute`, with
    `auto` what "auto" resolves to for this model (auto_kv_cache_dtype). The cache may be the
    compute dtype, or bfloat16 under float32: never wider than the arithmetic. "int8" (opt-in,
    under float32 or bfloat16) keeps each K/V row as int8 with its own float32 scale (amax /
    127): half a bfloat16 cache's bytes, a quarter of float32's, each value within half a
    scale step (see torch_paged)."""
    if name == "auto":
        return auto
    if name == "int8":
        if compute not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_cache_dtype='int8' under dtype {str(compute)[6:]}: it needs "
                             "float32 or bfloat16 arithmetic; pass kv_cache_dtype='auto'.")
        return torch.int8
    dt = DTYPES[name]
    if dt != compute and not (compute == torch.float32 and dt == torch.bfloat16):
        short = str(compute)[6:]
        raise ValueError(
            f"kv_cache_dtype={name!r} under dtype {short}: the cache may be the compute dtype, "
            f"or bfloat16 under float32; pass kv_cache_dtype='auto' or {short!r}.")
    return dt
