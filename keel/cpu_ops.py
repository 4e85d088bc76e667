"""keel's compiled CPU kernels (keel/csrc/), built once per machine.

- `paged_attention` (csrc/paged_attention.cpp): attention for rows of one query token (decode
  rows, and the tokens of short prompts) reading K/V in place through the block table. The
  portable torch path gathers every request's context into a padded copy first; for decode
  rows that copy cost more than the attention itself (~45% of a SmolLM2 decode step).
- `prefill_attention` (csrc/prefill_attention.cpp), `prefill_attention_amx` (AMX tiles) and
  `prefill_attention_i16` (csrc/prefill_attention_i16.cpp, AVX512-VNNI's int16 dot products,
  dtype="auto"'s where its GEMMs run on int16 or float16; `prefill_attention_i16_available()`):
  causal flash attention of one long prompt chunk over its keys.
- `rms_norm`, `fused_add_rms_norm_`, `rotary_neox_`, `silu_and_mul`, `argmax_rows`
  (csrc/fused_ops.cpp): the decoder layer's elementwise steps, one op each instead of 5-15
  torch ops, rounding where those torch expressions round; `write_kv_cache`
  (csrc/write_kv_cache.cpp): a pass's K/V into their cache slots.
- `quant_linear` (csrc/quant_gemm.cpp, AVX2 + FMA; `quant_gemm_available()` says whether
  this build has it): weight-only quantized matmul (int4 groups of 32, int8 per row) for
  passes of at most 4 rows (one user's decode), with the activations as integers per group
  of 32 and integer dot products (`int4_gemm_q8`, `int8_gemm_q8`), or in float32
  (`int4_gemm`, `int8_gemm`); torch's kernels are the fallback and the tests' oracle
  (keel/model_executor/layers/quantization.py).
- `gemm_pack`, `gemm` (csrc/gemm.cpp, AVX2 + FMA): keel's float32 GEMM over weights packed
  once into panels of 16 output columns (float32, or bfloat16 widened in registers), which
  streams each panel from memory once per block of rows and prefetches the next while the
  current one is used; where it runs instead of oneDNN is layers/gemm_choice.py's choice.
- `fp16_gemm_pack`, `fp16_gemm` (csrc/fp16_gemm.cpp, AVX512-FP16; `fp16_gemm_available()`):
  float32 x @ W^T on float16 FMAs (silu(gate) * up in its epilogue where asked), for CPUs
  with AVX512-FP16 and no AMX tiles: dtype="auto" runs a float32 model's GEMMs on it there
  (layers/gemm_choice.py fp16_gemm_chosen).
- `i16_gemm_pack`, `i16_gemm` (csrc/i16_gemm.cpp, AVX512-VNNI; `i16_gemm_available()`):
  float32 x @ W^T on int16 dot products, x and W scaled per block of 128 values of k, for
  CPUs with AVX512-VNNI and neither AMX tiles nor AVX512-FP16: dtype="auto" runs a float32
  model's GEMMs on it there (layers/gemm_choice.py fp16_gemm_chosen).
- `amx_gemm_pack`, `amx_gemm`, `amx_gemm_argmax` (csrc/amx_gemm.cpp): bfloat16 x @ W^T over a
  copy of the weight in AMX's tile layout, on the tiles; where the CPU has none but AVX512-BF16,
  the same calls run that copy on `vdpbf16ps` (csrc/bf16_dot_gemm.cpp;
  `amx_gemm_dense_available()`): `dtype="bfloat16"`'s decode GEMMs there instead of oneDNN's
  (layers/amx_choice.py amx_gemm_chosen).
- `greedy_head_pack`, `greedy_head` (csrc/greedy_head.cpp, AVX512-VNNI;
  `greedy_head_available()`): a greedy step's tokens without all the logits: every column of the
  LM head screened on int8 dot products (per-block scales) with a rigorous bound on their error,
  then the exact float32 logits of the columns the bound cannot rule out; a tied head takes it
  where the CPU has no AMX tiles (layers/vocab_embedding.py greedy_head_chosen).
- `DecodePlan` (csrc/decode_layers.cpp): a Llama-family model's decoder layers for a pass of
  decode rows, in one call: the kernels above and the layers' GEMMs (oneDNN through the
  dispatcher, or the quantized kernels) in the Python layers' order, without the
  interpreter between them (keel/model_executor/layers/fused_decode.py).

They are built with torch's JIT extension builder the first time they are needed (~50 s on 2
cores: the sources include ATen's core headers, not all of torch/extension.h; cached under
~/.cache/torch_extensions/keel, or $TORCH_EXTENSIONS_DIR/keel), with `-march=native`, and used
only on the CPU. A build's folder is named by a digest of everything that makes it (sources,
flags, this CPU, torch and Python), so a later start imports the finished build directly:
the JIT builder's own check (importing setuptools, running ninja) cost ~0.3 s of every start.
If they cannot be built (no compiler), keel logs why and keeps the torch code.
`KEEL_CPU_KERNEL=0` turns them all off. `KEEL_CPU_MARCH` builds them for another target than
this CPU (`-march=<value>`, e.g. `x86-64-v3` for any AVX2 machine, or `x86-64-v4`): for a
cache shared by a fleet of CPU kinds, or to run this CPU as an older one (the tests do).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp",
            "prefill_attention_amx.cpp", "prefill_attention_i16.cpp",
            "fused_ops.cpp", "write_kv_cache.cpp",
            "quant_gemm.cpp", "quant_gemm_q8.cpp", "decode_layers.cpp", "gemm.cpp",
            "amx_gemm.cpp", "bf16_dot_gemm.cpp", "fp16_gemm.cpp", "greedy_head.cpp",
            "i16_gemm.cpp")
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
_MARCH_ENV = "KEEL_CPU_MARCH"
_module: Any = None
_tried = False


def _cpu_identity() -> bytes:
    """This CPU's model and instruction-set flags (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [ln for ln in f.read().split(b"\n")
                     if ln.startswith((b"model name", b"flags"))]
        return b"\n".join(lines[:2])
    except OSError:
        import platform

        return platform.processor().encode()


_DONE = "keel-build-done"  # written after a build has linked and imported


def _cflags() -> list[str]:
    """The compiler flags: `_CFLAGS`, with `-march=$KEEL_CPU_MARCH` when that is set."""
    march = os.environ.get(_MARCH_ENV, "").strip()
    if not march or march == "native":
        return list(_CFLAGS)
    if not all(ch.isalnum() or ch in "-_." for ch in march):
        raise ValueError(f"{_MARCH_ENV}={march!r} is not a -march value the compiler takes "
                         "(e.g. x86-64-v3, x86-64-v4, sapphirerapids, znver4); unset it to "
                         "build for this CPU.")
    return [f"-march={march}" if f == "-march=native" else f for f in _CFLAGS]


def _build_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(cache) / "torch_extensions"
    return Path(root) / "keel"


def _mark_built(folder: Path, name: str) -> None:
    try:
        tmp = folder / f"{_DONE}.{os.getpid()}"
        tmp.write_text(name)
        tmp.replace(folder / _DONE)  # atomic: a reader sees no marker or a whole one
    except OSError as e:  # the kernels are loaded; only the next start's shortcut is lost
        logger.debug("Could not mark the kernels' build in %s finished: %s", folder, e)


def _import_built(name: str, folder: Path) -> Any | None:
    """The finished build in `folder` imported as a module, or None if there is none (or it
    does not import: the JIT builder then builds it again)."""
    import importlib.util

    lib = folder / f"{name}.so"
    if not (folder / _DONE).is_file() or not lib.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, lib)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure: rebuild
        logger.warning("keel's CPU kernels in %s did not load (%s); building them again.",
                       folder, e)
        (folder / _DONE).unlink(missing_ok=True)
        return None
    return module


def get_cpu_ops() -> Any | None:
    """The compiled module, or None when unavailable or disabled (`KEEL_CPU_KERNEL=0`)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("KEEL_CPU_KERNEL", "1") == "0":
        return None
    # The `ninja` that pip installed with keel sits next to this interpreter; torch looks for
    # it on PATH, which an unactivated virtual environment does not extend.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        # `-march=native` builds for this CPU: its instruction sets are part of the name, so
        # a cache shared with another machine never hands this one a build it cannot run;
        # torch's and Python's versions are too, as the build is loaded without a rebuild check.
        import torch

        cflags = _cflags()
        digest = hashlib.sha256(" ".join(cflags).encode() + _cpu_identity())
        digest.update(f"{torch.__version__} {sys.version} {getattr(sys, 'abiflags', '')}".encode())
        for f in sorted(_CSRC.iterdir()):
            digest.update(f.name.encode() + f.read_bytes())
        name = f"keel_cpu_ops_{digest.hexdigest()[:12]}"
        folder = _build_root() / name
        _module = _import_built(name, folder)
        if _module is None:
            from torch.utils.cpp_extension import load

            logger.info("Building keel's CPU kernels (once per machine, ~1 minute)")
            folder.mkdir(parents=True, exist_ok=True)
            _module = load(
                name=name,
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(_CSRC)],
                build_directory=str(folder),
                verbose=False,
            )
            _mark_built(folder, name)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error: torch path
        march = os.environ.get(_MARCH_ENV)
        hint = f" (built with {_MARCH_ENV}={march!r}: check the value)" if march else ""
        logger.warning("keel's CPU kernels are unavailable (%s)%s; using torch ops instead.",
                       e, hint)
        _module = None
    return _module


def cpu_ops_for(t: Any) -> Any | None:
    """The compiled module when `t` lives on the CPU, else None."""
    return get_cpu_ops() if t.device.type == "cpu" else None
