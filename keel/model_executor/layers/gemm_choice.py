"""Which GEMM runs a linear layer's weight on the CPU.

On the CPU, `process_weights_after_loading()` packs each weight once for the GEMM that runs
it and releases the dense copy (vLLM's CPU backend does the same with oneDNN): the packing and
the call are in packed_weights.py, the choices here. Two packed GEMMs, chosen once per process
(`KEEL_CPU_GEMM=auto`, the default):
- keel's own (csrc/gemm.cpp: panels of 16 output columns, each streamed from memory once per
  block of rows while the next is prefetched). On an AVX2 CPU it is taken without measuring:
  there it ran as fast as oneDNN with the weights hot in cache and 1.13-1.15x faster with them
  cold, as in a real step that reads every layer's weights from memory (BENCHMARKS.md, sixth
  round). On a CPU with AVX-512 keel's runs 16-lane tiles of up to 10 rows against 32 columns
  (the same bits); there the two are timed once at a decode shape, and keel's is kept unless
  oneDNN's is faster by more than OWN_KERNEL_MARGIN (keel's ran 1.36-1.46x oneDNN's at 64 rows
  with the weights from memory, 0.99-1.01x at 2,048 rows, on an Intel Xeon with AMX;
  BENCHMARKS.md, thirty-second round; the margin: forty-fourth round).
- oneDNN's, through torch (`torch.ops.mkldnn`), in the blocked layout it reads fastest: 1.5x
  faster than `F.linear`'s MKL path in float32 here, 1.2x in bfloat16.
`KEEL_CPU_GEMM=keel|onednn` forces one; `KEEL_CPU_GEMM=torch` packs nothing (plain `F.linear`).

A bfloat16 weight on a CPU without native bfloat16 dot products (AVX2 only, or AVX-512
without AVX512-BF16) is computed in float32 with the output rounded back to bfloat16: there
oneDNN and torch emulate bfloat16 GEMMs, 4x slower than float32 on an AVX2 EPYC. keel's GEMM
keeps the weight in bfloat16 and widens it exactly in registers (half the bytes to stream);
oneDNN's is given the weight's float32 upcast. Either way the result is the bfloat16 GEMM's
(float32 accumulation, one rounding). Where the CPU has native bfloat16 GEMMs, they and
float32 are timed once at load and the faster kept: native bfloat16 GEMMs ran at half the
float32 rate on an Intel Xeon with AVX512-BF16 but no AMX, and at twice it on an AMD EPYC
with AVX512-BF16. Where oneDNN's measure slower and the CPU has AVX512-BF16 without AMX
tiles, keel's bfloat16 GEMM on its dot products (csrc/bf16_dot_gemm.cpp) is timed against
float32 too, and the layers stay bfloat16 where it wins (amx_choice.bf16_dots_beat_float32).

Where the CPU has AMX tiles, keel's AMX GEMM takes bfloat16 layers' passes over a tile copy
of their weights, and where it has AVX512-BF16 without tiles the same GEMM runs that copy on
`vdpbf16ps` (csrc/bf16_dot_gemm.cpp): those choices are amx_choice.py's.

Where it has AVX512-FP16 and no AMX tiles, dtype="auto" lets a float32 model's GEMMs run on
float16 FMAs (csrc/fp16_gemm.cpp: x and W rounded to float16, float16 sums of at most 128
products widened into float32 ones), as it lets a CPU with AMX compute such a model in bfloat16
(keel/dtypes.py auto_float16_gemms; the loader packs the model inside `float16_gemms(True)`).
`fp16_gemm_chosen` then times it once against the float32 GEMM at a decode shape and keeps the
faster. A float16 FMA does twice a float32 FMA's products at the same rate: at the default
model's shapes with the weights from memory it ran 1.77x keel's float32 GEMM at 64 rows and
1.80-1.96x at 512-2,048 (BENCHMARKS.md, forty-sixth round), and its mean error is below
bfloat16 arithmetic's.
Where it has neither, but AVX512-VNNI, the same choice takes int16 dot products instead
(csrc/i16_gemm.cpp: x and W as int16 scaled per block of 128 values of k, exact int32 sums of
a block): one `vpdpwssd` does twice a float32 FMA's products. On an AVX-512 Xeon without AMX,
AVX512-BF16 or -FP16 the 120 decode GEMMs from memory ran 1.73x keel's float32 GEMM at 64 rows
(1.92x at 512; BENCHMARKS.md, fiftieth round). Its mean error is about 1/8 of bfloat16
arithmetic's on the default model's layers and activations, 1/14 on random data
(benchmarks/i16_accuracy.py; sixty-second round).
dtype="float32" keeps float32 GEMMs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)


# oneDNN picks its blocked layout for a batch size; one packed for 64 rows was as fast as one
# packed for the actual size at every size measured (1 to 2048 rows).
_PACK_BATCH_HINT = 64
_GEMM_MODES = ("auto", "keel", "onednn", "torch")


def forced_choice(name: str, off: str, on: str) -> bool | None:
    """An env var that forces a choice measured at load: 0 -> False, 1 -> True, unset or empty
    -> None (measure); any other value is an error naming the choices."""
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 ({off}), 1 ({on}) or unset (measured "
                         "at load)")
    return value == "1"


def _gemm_mode() -> str:
    mode = os.environ.get("KEEL_CPU_GEMM", "auto")
    if mode not in _GEMM_MODES:
        raise ValueError(f"KEEL_CPU_GEMM={mode!r}: expected one of {', '.join(_GEMM_MODES)}")
    return mode


def onednn_gemm_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed for oneDNN's CPU GEMM (float32, or bfloat16 where the CPU
    has native support), unless `KEEL_CPU_GEMM=torch`."""
    if weight.device.type != "cpu" or _gemm_mode() == "torch":
        return False
    if not _onednn_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and _linear_pointwise is not None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN copy of `weight` [out, in] for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)


_bf16_slower_than_fp32: bool | None = None  # measured once per process
_keel_gemm_faster: bool | None = None  # chosen once per process

# keel's own decode GEMMs (this file's and amx_choice's) are measured against oneDNN's with
# the weight hot in cache, a fraction of a millisecond at load, but a decode step reads every
# layer's weight from memory, where keel's kernels stream it ahead of the arithmetic. So they
# are kept unless oneDNN measures faster by more than this factor, over 5 rounds in turn. On
# an Intel Xeon (AMX visible and hidden) the hot ratio keel / oneDNN read 0.77-1.06 from one
# process to the next for the float32 GEMM and 0.62-1.16 for the AMX one, so the plain
# comparison chose oneDNN in 3 processes of 15 and 1 of 11; in the engine, alternated in one
# process, keel's float32 GEMM gave 1.23-1.38x oneDNN's tokens/s on short prompts and
# 1.22-1.31x on long ones with AMX hidden, and the AMX GEMM 1.10-1.36x and 0.99-1.22x
# (BENCHMARKS.md, forty-fourth round).
OWN_KERNEL_MARGIN = 1.15
_CHOICE_ROUNDS = 5
_keel_ops: Any = None  # keel's kernels, once keel_gemm_chosen() or low_precision_kind() found them
_float16_allowed = False  # within float16_gemms(True): the model being packed allows them
_fp16_gemm_faster: bool | None = None  # measured once per process


@contextlib.contextmanager
def float16_gemms(allowed: bool) -> Iterator[None]:
    """Within it, float32 weights may be packed for fp16_gemm (fp16_gemm_chosen): the loader
    packs a model inside it with ModelConfig.float16_gemms (dtype="auto" allowed it)."""
    global _float16_allowed
    before, _float16_allowed = _float16_allowed, allowed
    try:
        yield
    finally:
        _float16_allowed = before


# The GEMMs dtype="auto" may put a float32 model's weights on (packed_by): float16 FMAs where
# the CPU has AVX512-FP16, else int16 dot products where it has AVX512-VNNI.
LOW_PRECISION_KINDS = ("fp16", "i16")
_LOW_NAMES = {"fp16": "float16 FMAs (keel's fp16_gemm)",
              "i16": "int16 dot products (keel's i16_gemm)"}


def low_precision_kind() -> str | None:
    """The reduced-precision GEMM this build has for float32 weights: "fp16" (AVX512-FP16),
    else "i16" (AVX512-VNNI), else None."""
    global _keel_ops
    from keel.cpu_ops import get_cpu_ops

    ops = get_cpu_ops()
    if ops is None:
        return None
    kind = ("fp16" if ops.fp16_gemm_available() else "i16" if ops.i16_gemm_available()
            else None)
    if kind is not None:
        _keel_ops = ops
    return kind


def fp16_gemm_chosen() -> str | None:
    """The GEMM a float32 weight packed now goes to instead of the float32 one, or None:
    fp16_gemm (csrc/fp16_gemm.cpp) where keel's kernels are built for AVX512-FP16, else
    i16_gemm (csrc/i16_gemm.cpp) where they are built for AVX512-VNNI (low_precision_kind);
    inside float16_gemms(True), under KEEL_CPU_GEMM=auto, and where it measured faster than
    the float32 GEMM chosen (keel's or oneDNN's) at a decode shape (once per process; each
    tensor-parallel rank measures in its own). KEEL_FP16_GEMM=0 / 1 forces it (where the
    kernels have one of the two)."""
    global _fp16_gemm_faster
    if not _float16_allowed or _gemm_mode() != "auto":
        return None
    forced = forced_choice("KEEL_FP16_GEMM", "float32 GEMMs",
                           "float16 FMAs or int16 dot products")
    if forced is False:
        return None
    kind = low_precision_kind()
    if kind is None:
        return None
    if forced:
        return kind
    if _fp16_gemm_faster is None:
        float32 = "keel" if keel_gemm_chosen() else "onednn"
        _fp16_gemm_faster = _first_faster((torch.float32, kind), (torch.float32, float32),
                                          _CHOICE_ROUNDS)
        logger.info("dtype='auto': float32 GEMMs run on %s (measured on this CPU)",
                    _LOW_NAMES[kind] if _fp16_gemm_faster else f"{float32}'s float32 GEMM")
    return kind if _fp16_gemm_faster else None


def int16_attention_chosen() -> bool:
    """Whether an attention layer packed now runs its long prompt chunks on int16 dot products
    (csrc/prefill_attention_i16.cpp) instead of float32 FMAs: where dtype="auto" put the
    model's GEMMs on i16_gemm or fp16_gemm (fp16_gemm_chosen), and the build has AVX512-VNNI.
    On the default model's layers its mean error is ~1/10 of the float32 kernel's over a
    bfloat16 K/V (benchmarks/prefill_attention_i16.py), and it ran 1.3-1.5x the float32
    kernel's speed on an AMD EPYC Zen 4 (BENCHMARKS.md, sixty-third round).
    KEEL_I16_ATTENTION=0 / 1 forces it (1: for any float32 or bfloat16 model, where the build
    has AVX512-VNNI). A bfloat16 model's chunks take it without this layer flag too, on a CPU
    without AMX tiles (attention/backends/chunk_kernels.py bfloat16_chunks_on_int16)."""
    from keel.cpu_ops import get_cpu_ops

    forced = forced_choice("KEEL_I16_ATTENTION", "float32 FMAs", "int16 dot products")
    if forced is False or (forced is None and fp16_gemm_chosen() is None):
        return False
    ops = get_cpu_ops()
    return ops is not None and ops.prefill_attention_i16_available()


def bf16_gemm_in_float32(weight: torch.Tensor) -> bool:
    """Whether a bfloat16 weight is computed in float32 (see the module docstring): always
    without native bfloat16 GEMMs, else when oneDNN's measure slower, unless keel's GEMM on
    AVX512-BF16's dot products (a CPU without AMX tiles) measures faster than float32 at both
    a decode's and a prompt chunk's rows (amx_choice.bf16_dots_beat_float32)."""
    global _bf16_slower_than_fp32
    if not (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and _gemm_mode() != "torch"):
        return False
    if not (_onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return True
    if _bf16_slower_than_fp32 is None:
        from keel.model_executor.layers.amx_choice import bf16_dots_beat_float32

        _bf16_slower_than_fp32 = _first_faster((torch.float32,), (torch.bfloat16,))
        # oneDNN's bfloat16 slower, but keel's own on AVX512-BF16's dots may not be: then the
        # layers stay bfloat16 and their passes go to it (amx_choice.amx_gemm_chosen).
        if _bf16_slower_than_fp32 and bf16_dots_beat_float32():
            _bf16_slower_than_fp32 = False
        logger.info("bfloat16 weights: GEMMs in %s (measured faster on this CPU)",
                    "float32" if _bf16_slower_than_fp32 else "bfloat16")
    return _bf16_slower_than_fp32


def keel_gemm_chosen() -> bool:
    """Whether float32 GEMMs run on keel's kernel (csrc/gemm.cpp) rather than oneDNN's; see
    the module docstring. Decided once per process."""
    global _keel_gemm_faster, _keel_ops
    mode = _gemm_mode()
    if mode in ("torch", "onednn"):
        return False
    from keel.cpu_ops import get_cpu_ops

    ops = get_cpu_ops()
    if ops is None or not ops.gemm_available():
        return False
    _keel_ops = ops
    if mode == "keel":
        return True
    if _keel_gemm_faster is None:
        measure = _onednn_available() and torch.backends.cpu.get_cpu_capability() != "AVX2"
        _keel_gemm_faster = not measure or _first_faster(
            (torch.float32, "keel"), (torch.float32,), _CHOICE_ROUNDS, OWN_KERNEL_MARGIN)
        logger.info("Linear layers run on %s's GEMM (%s)",
                    "keel" if _keel_gemm_faster else "oneDNN",
                    f"measured on this CPU, keel's kept unless oneDNN's is {OWN_KERNEL_MARGIN}x "
                    "faster" if measure else "AVX2 CPU, or no oneDNN")
    return _keel_gemm_faster


def _first_faster(a: tuple, b: tuple, rounds: int = 3, margin: float = 1.0) -> bool:
    """Whether the packed GEMM `_gemm_timer(*a)` times is faster than `_gemm_timer(*b)`'s (by
    `margin`, see _faster): each timed `rounds` times, in turn, the best kept. On a shared host
    a burst of another tenant's work can slow one side's only window: measured one after the
    other, the AMX GEMM once lost to oneDNN (140 us against 93 a minute later), and the choice
    holds for the process. Each side's operands are made and packed once, not every round."""
    return _faster(_gemm_timer(*a), _gemm_timer(*b), rounds, margin)


def _faster(time_a: Callable[[], float], time_b: Callable[[], float], rounds: int,
            margin: float = 1.0) -> bool:
    """Whether a is faster than b by `margin` (a's time below margin x b's: a margin above 1
    favours a): each timing called `rounds` times, in turn, the best of each kept."""
    ta = tb = float("inf")
    for _ in range(rounds):
        ta = min(ta, time_a())
        tb = min(tb, time_b())
    return ta < margin * tb


def _gemm_timer(dtype: torch.dtype, kernel: str = "onednn", rows: int = 64, n: int = 1536,
                k: int = 576) -> Callable[[], float]:
    """A packed GEMM at a decode-sized shape (the default model's gate_up) on `kernel`, its
    weight made and packed now; each call of the result times the best of 10 passes. Made once
    for all of a choice's rounds: made again every round, the random weight and its packing
    took about half of the ~0.2 s the load-time choices cost."""
    from keel.utils import best_seconds

    w = torch.randn(n, k).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    if kernel == "keel":  # called by keel_gemm_chosen(), which has found _keel_ops
        packed, x = _keel_ops.gemm_pack(w), x.float()
        fn = lambda: _keel_ops.gemm(x, packed, n)
    elif kernel == "fp16":  # called by fp16_gemm_chosen(), likewise
        packed, w_max = _keel_ops.fp16_gemm_pack(w)
        fn = lambda: _keel_ops.fp16_gemm(x, packed, n, w_max)
    elif kernel == "i16":  # likewise
        packed, scales = _keel_ops.i16_gemm_pack(w)
        fn = lambda: _keel_ops.i16_gemm(x, packed, scales, n)
    elif kernel == "amx":  # called by amx_choice.amx_gemm_chosen(), likewise
        packed = _keel_ops.amx_gemm_pack(w)
        fn = lambda: _keel_ops.amx_gemm(x, packed, n)
    else:
        packed = pack_weight(w)
        fn = lambda: packed_linear(x, packed)
    return lambda: best_seconds(fn, 10)


def silu_pair_order(n: int) -> torch.Tensor:
    """The rows of a [gate; up] weight (n = 2I rows, I % 16 == 0) interleaved by 16: gate rows
    0-15, up rows 0-15, gate rows 16-31, ... (amx_gemm's silu_mul form)."""
    i = n // 2
    blocks = torch.arange(i).view(-1, 16)
    return torch.stack([blocks, blocks + i], dim=1).reshape(-1)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return _linear_pointwise(x, packed, bias, "none", [], "")


def _resolve_linear_pointwise():
    """The op's overload, resolved once (the overload packet resolves it on every call);
    None in a torch built without oneDNN."""
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


_linear_pointwise = _resolve_linear_pointwise()
