"""Which passes keel's AMX GEMM (csrc/amx_gemm.cpp) takes, where the CPU has AMX tiles, or
AVX512-BF16 without them.

Without tiles, amx_gemm runs the same bfloat16 copy on AVX512-BF16's dot products
(csrc/bf16_dot_gemm.cpp: `vdpbf16ps`, i16_gemm's schedule, amx_gemm's epilogues), and the
choices below are made the same way, against oneDNN's bfloat16 GEMMs: on an AMD EPYC Zen 4 it
ran level with them with the weights in cache and took oneDNN's place in a decode step's
(BENCHMARKS.md, sixty-seventh round). The GGUF int4 / int8 copies and amx_gemm_f32 need the
tiles.

A bfloat16 layer on oneDNN also keeps a copy of its weight in the GEMM's tile layout. The GEMM
takes the passes of up to `AMX_GEMM_MAX_ROWS` rows (decode steps) unless oneDNN's times faster
by more than gemm_choice.OWN_KERNEL_MARGIN at load, and the longer passes (prompt chunks) too
where they time faster on it, in two kinds measured apart: a [gate; up] layer's passes with
SiLU in the epilogue (`silu=True`: a prompt chunk's MLP against oneDNN's GEMMs and
silu_and_mul) and every other layer's plain passes (`silu=False`: the default model's qkv, o
and down GEMMs); up to `AMX_PROMPT_SPLIT_ROWS` rows measured at 512 (`amx_prompt_chosen`),
past that at 2,048 (`amx_long_chosen`; `KEEL_AMX_PROMPT=0|1` forces all four); else oneDNN
keeps them.
The copies may take a quarter of the memory available at load; past that the remaining layers
run on oneDNN alone. `KEEL_AMX_GEMM=0` turns it off.

A float32 layer whose weight values are all bfloat16 (a bfloat16 checkpoint run in float32)
keeps the same tile copy where `amx_f32_chosen`, and its float32 passes run on it
(amx_gemm_f32). The GGUF int4 / int8 copies are `amx_compressed_copy_chosen`'s. Each choice is
made once per process, at load; gemm_choice.py holds the rest (keel's and oneDNN's GEMMs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from keel.model_executor.layers import gemm_choice as gc

logger = logging.getLogger(__name__)


# bfloat16 passes of up to this many rows (decode steps) run on keel's AMX GEMM
# (csrc/amx_gemm.cpp) where it is chosen (amx_gemm_chosen): at 64 rows it measured 1.3-1.8x
# oneDNN's with the weights in cache and ~1.15x streaming them from memory; from 128 rows
# oneDNN's brgemm is as fast or faster (3.3 TFLOP/s at 2048 rows against 1.4; eighteenth
# round, BENCHMARKS.md), so the layer keeps oneDNN's packed weight for those.
AMX_GEMM_MAX_ROWS = 64
_amx_gemm_faster: bool | None = None
_amx_prompt_faster: bool | None = None  # longer passes too (amx_prompt_chosen)
# Prompt passes of more rows than this are a second choice (amx_long_chosen): on one AMX host
# keel's MLP ran 0.88-0.93x oneDNN's time at 512-1,024 rows but 1.11-1.19x at 1,536-2,048
# (oneDNN's brgemm gains with the rows, keel's panels of 128 rows do not; BENCHMARKS.md,
# thirty-sixth round), so the 512-row measurement alone sent 2,048-row chunks to the slower.
AMX_PROMPT_SPLIT_ROWS = 1024
_amx_long_faster: bool | None = None  # passes past AMX_PROMPT_SPLIT_ROWS (amx_long_chosen)
# The same two choices for plain passes (silu=False). Measured apart because the two kinds
# went different ways on one host: with the weights in cache oneDNN's plain prompt GEMMs ran
# 1.12-1.20x faster than keel's, while keel's [gate; up] with SiLU in its epilogue beat
# oneDNN's GEMM and silu_and_mul; chosen apart, a 4,096-token prompt step took 443-459 ms
# (median 445) against 465-471 with every layer on keel's and 456-459 on oneDNN's
# (BENCHMARKS.md, forty-seventh round).
_amx_plain_prompt_faster: bool | None = None
_amx_plain_long_faster: bool | None = None
_amx_bytes_left: int | None = None  # the copies' memory budget (see _amx_budget)


def amx_gemm_chosen() -> bool:
    """Whether bfloat16 decode-sized passes run on keel's AMX GEMM: built, with AMX tiles or
    AVX512-BF16 (amx_gemm_dense_available), not turned off (KEEL_AMX_GEMM=0), and not
    measured slower than oneDNN's at 64 rows by more than gemm_choice.OWN_KERNEL_MARGIN (once
    per process)."""
    global _amx_gemm_faster
    if _amx_gemm_faster is None:
        _amx_gemm_faster = False
        if os.environ.get("KEEL_AMX_GEMM", "1") != "0" and gc._gemm_mode() != "torch" \
                and gc._onednn_available():
            from keel.cpu_ops import get_cpu_ops

            ops = get_cpu_ops()
            if ops is not None and ops.amx_gemm_dense_available():
                gc._keel_ops = ops
                _amx_gemm_faster = gc._first_faster((torch.bfloat16, "amx"), (torch.bfloat16,),
                                                    gc._CHOICE_ROUNDS, gc.OWN_KERNEL_MARGIN)
                logger.info("bfloat16 passes of up to %d rows: %s (measured at 64 x 1536 x 576)",
                            AMX_GEMM_MAX_ROWS, "oneDNN's GEMM" if not _amx_gemm_faster else
                            "keel's GEMM on " + ("AMX tiles" if ops.amx_gemm_available() else
                                                 "AVX512-BF16 dot products"))
    return _amx_gemm_faster


_dots_beat_float32: bool | None = None  # bf16_dots_beat_float32, measured once


def bf16_dots_beat_float32() -> bool:
    """Where oneDNN's bfloat16 GEMMs measured slower than float32 (gemm_choice.
    bf16_gemm_in_float32 asks; an Intel Xeon with AVX512-BF16 but no AMX ran them at half the
    float32 rate) and the CPU has AVX512-BF16 without AMX tiles: whether keel's GEMM on its dot
    products (amx_gemm over its bfloat16 copy, csrc/bf16_dot_gemm.cpp) is faster than the
    float32 GEMM a bfloat16 layer would take instead (keel's over the bfloat16 weight, or
    oneDNN's over its upcast), at 64 rows and at 512, 5 rounds each in turn. Then bfloat16
    layers stay bfloat16, and amx_gemm_chosen and the prompt-pass choices give their passes to
    it as elsewhere. Once per process; False where KEEL_AMX_GEMM=0 or KEEL_CPU_GEMM is not
    auto. Not measured on such a Xeon yet: this is what lets its load find out."""
    global _dots_beat_float32
    if _dots_beat_float32 is None:
        _dots_beat_float32 = False
        from keel.cpu_ops import get_cpu_ops

        ops = get_cpu_ops()
        if (os.environ.get("KEEL_AMX_GEMM", "1") != "0" and gc._gemm_mode() == "auto"
                and ops is not None and not ops.amx_gemm_available()
                and ops.amx_gemm_dense_available()):
            gc._keel_ops = ops
            # keel's float32 GEMM widens the bfloat16 weight in registers; oneDNN's gets its
            # float32 upcast (packed_weights.pack_for_cpu_gemm).
            other = ((torch.bfloat16, "keel") if gc.keel_gemm_chosen()
                     else (torch.float32, "onednn"))
            _dots_beat_float32 = all(
                gc._first_faster((torch.bfloat16, "amx", rows), (*other, rows),
                                 gc._CHOICE_ROUNDS)
                for rows in (64, 512))
            logger.info("bfloat16 weights: keel's GEMM on AVX512-BF16 dot products measured %s "
                        "than the float32 GEMM", "faster" if _dots_beat_float32 else "slower")
    return _dots_beat_float32


def amx_prompt_chosen(silu: bool) -> bool:
    """Whether passes of more than AMX_GEMM_MAX_ROWS rows (prompt chunks) also run on keel's
    AMX GEMM, over a layer's bfloat16 tile copy (never a widened int4 or int8 one), where it
    is chosen for decode passes: measured once per process and kind at 512 rows. `silu`: a
    [gate; up] layer's passes with SiLU in the epilogue, timed on the default model's MLP
    (gate_up with SiLU in the AMX GEMM's epilogue, then down; against oneDNN's two GEMMs and
    silu_and_mul between them); else plain passes, timed on its qkv, o and down GEMMs.
    Passes of more than AMX_PROMPT_SPLIT_ROWS rows are amx_long_chosen's. The AMX GEMM takes
    long passes in panels of 128 rows (csrc/amx_gemm.cpp); on one AMX host the MLP of a
    2,048-row chunk ran 1.5x faster on it than on oneDNN, and oneDNN's brgemm has read 3.3
    TFLOP/s at 2,048 rows on another, so it is measured. KEEL_AMX_PROMPT=0 / 1 skips the
    measurement."""
    def measure() -> bool:
        _amx_prompt_forced()  # a bad value is an error on any CPU, AMX or not
        return amx_gemm_chosen() and _prompt_rows_chosen(
            512, f"{AMX_GEMM_MAX_ROWS + 1}-{AMX_PROMPT_SPLIT_ROWS} rows", silu)

    return _once("_amx_prompt_faster" if silu else "_amx_plain_prompt_faster", measure)


def amx_long_chosen(silu: bool) -> bool:
    """Whether passes of more than AMX_PROMPT_SPLIT_ROWS rows of that kind run on keel's AMX
    GEMM too, where amx_prompt_chosen: measured once per process as that choice, at 2,048
    rows (the scheduler's default chunk). KEEL_AMX_PROMPT=0 / 1 forces this one as well."""
    return _once("_amx_long_faster" if silu else "_amx_plain_long_faster",
                 lambda: amx_prompt_chosen(silu) and _prompt_rows_chosen(
                     2 * AMX_PROMPT_SPLIT_ROWS, f"more than {AMX_PROMPT_SPLIT_ROWS} rows", silu))


def _once(name: str, measure: Callable[[], bool]) -> bool:
    """The module-level choice `name`, measured (and kept) the first time it is asked for."""
    if globals()[name] is None:
        globals()[name] = measure()
    return globals()[name]


_amx_f32_faster: bool | None = None  # amx_f32_chosen


def amx_f32_chosen() -> bool:
    """Whether float32 layers whose weights are all bfloat16 values (a bfloat16 checkpoint run
    in float32) also keep a bfloat16 tile copy, on which keel's AMX GEMM computes every pass in
    float32 (csrc/amx_gemm.cpp amx_gemm_f32: x in three bfloat16 parts, float32 sums): built,
    with AMX tiles, and measured faster than keel's float32 GEMM at 64 x 1536 x 576 (once per
    process). On an AMX Xeon 30 layers' GEMMs went 52 -> 27 ms at 64 rows and 1.8x faster at
    2,048 (BENCHMARKS.md, thirty-eighth round). KEEL_AMX_F32=0 / 1 forces it."""
    global _amx_f32_faster
    if _amx_f32_faster is None:
        forced = gc.forced_choice("KEEL_AMX_F32", "float32 GEMMs in float32 FMAs",
                                "on the AMX tiles")
        _amx_f32_faster = False
        from keel.cpu_ops import get_cpu_ops

        ops = get_cpu_ops()
        if forced is not False and gc._gemm_mode() != "torch" and ops is not None \
                and hasattr(ops, "amx_gemm_f32") and ops.amx_gemm_available():
            gc._keel_ops = ops
            _amx_f32_faster = True if forced else _amx_f32_measured_faster(ops)
            logger.info("float32 layers with bfloat16 weights: %s", "AMX tiles (x in three "
                        "bfloat16 parts)" if _amx_f32_faster else "float32 FMAs")
    return _amx_f32_faster


def _amx_f32_measured_faster(ops: Any) -> bool:
    from keel.utils import best_seconds

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1536, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(64, 576, generator=g)
    amx, panels = ops.amx_gemm_pack(w), ops.gemm_pack(w.float())  # AMX CPUs have keel's GEMM
    return gc._faster(lambda: best_seconds(lambda: ops.amx_gemm_f32(x, amx, 1536), 5),
                      lambda: best_seconds(lambda: ops.gemm(x, panels, 1536), 5), rounds=2)


def _amx_prompt_forced() -> bool | None:
    return gc.forced_choice("KEEL_AMX_PROMPT", "prompt chunks on oneDNN", "on keel's AMX GEMM")


def _prompt_rows_chosen(rows: int, passes: str, silu: bool) -> bool:
    """KEEL_AMX_PROMPT's answer, else whether `rows` rows of the kind's passes (see
    amx_prompt_chosen) measure faster on keel's AMX GEMM than on oneDNN (2 rounds, each the
    best of 5), logged as the choice for the passes named."""
    forced = _amx_prompt_forced()
    if forced is not None:
        return forced
    timing = _time_prompt_mlp if silu else _time_prompt_plain
    faster = gc._faster(timing("amx", rows=rows), timing("onednn", rows=rows), rounds=2)
    logger.info("bfloat16 %s passes of %s: %s's GEMM (measured faster on %d rows)",
                "[gate; up] + SiLU" if silu else "plain", passes,
                "keel" if faster else "oneDNN", rows)
    return faster


def _time_prompt_mlp(kernel: str, rows: int = 512, inter: int = 1536,
                     hidden: int = 576) -> Callable[[], float]:
    """A timing (best of 5) of one MLP of a prompt chunk: gate_up, SiLU, down."""
    from keel.utils import best_seconds

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).bfloat16()
    gate_up = (torch.randn(2 * inter, hidden, generator=g) * 0.05).bfloat16()
    down = (torch.randn(hidden, inter, generator=g) * 0.05).bfloat16()
    if kernel == "amx":  # called by amx_prompt_chosen(), once amx_gemm_chosen() found gc._keel_ops
        gu = gc._keel_ops.amx_gemm_pack(gate_up[gc.silu_pair_order(2 * inter)].contiguous())
        dn = gc._keel_ops.amx_gemm_pack(down)
        fn = lambda: gc._keel_ops.amx_gemm(gc._keel_ops.amx_gemm(x, gu, 2 * inter, None, True),
                                        dn, hidden)
    else:
        gu, dn = gc.pack_weight(gate_up), gc.pack_weight(down)
        fn = lambda: gc.packed_linear(gc._keel_ops.silu_and_mul(gc.packed_linear(x, gu)), dn)
    return lambda: best_seconds(fn, 5)


def _time_prompt_plain(kernel: str, rows: int = 512, inter: int = 1536, hidden: int = 576,
                       qkv: int = 960) -> Callable[[], float]:
    """A timing (best of 5) of a prompt chunk's plain GEMMs in one layer of the default model:
    qkv, o and down."""
    from keel.utils import best_seconds

    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (hidden, inter)}
    shapes = [(qkv, hidden), (hidden, hidden), (hidden, inter)]  # (out, in)
    weights = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in shapes]
    if kernel == "amx":
        packed = [gc._keel_ops.amx_gemm_pack(w) for w in weights]
        fn = lambda: [gc._keel_ops.amx_gemm(xs[k], p, n) for p, (n, k) in zip(packed, shapes)]
    else:
        packed = [gc.pack_weight(w) for w in weights]
        fn = lambda: [gc.packed_linear(xs[k], p) for p, (_, k) in zip(packed, shapes)]
    return lambda: best_seconds(fn, 5)


def amx_max_rows(amx: torch.Tensor, silu: bool) -> int:
    """The most rows of a pass that runs on the AMX GEMM over the copy `amx` (`silu`: a [gate;
    up] layer's pass with SiLU in the epilogue, else a plain one): for a bfloat16 copy where
    amx_prompt_chosen for that kind, AMX_PROMPT_SPLIT_ROWS, or every pass where
    amx_long_chosen as well."""
    if amx.dtype == torch.bfloat16 and amx_prompt_chosen(silu):
        return 1 << 62 if amx_long_chosen(silu) else AMX_PROMPT_SPLIT_ROWS
    return AMX_GEMM_MAX_ROWS


def amx_takes(amx: torch.Tensor, rows: int, silu: bool) -> bool:
    """Whether a pass of `rows` rows runs on the AMX GEMM over the copy `amx` (`silu`: see
    amx_max_rows)."""
    return rows <= amx_max_rows(amx, silu)


def _amx_budget(nbytes: int) -> bool:
    """Whether one more AMX copy of nbytes fits. The copies sit beside oneDNN's packed
    weights (which the longer passes take): all of them together may take at most a quarter
    of the memory available when the first was made."""
    global _amx_bytes_left
    if _amx_bytes_left is None:
        avail = 0
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        avail = int(line.split()[1]) * 1024
        except OSError:
            pass
        _amx_bytes_left = avail // 4
    if nbytes > _amx_bytes_left:
        if _amx_bytes_left >= 0:
            logger.info("AMX GEMM copies stop here: a quarter of the available memory is used; "
                        "the remaining layers run on oneDNN alone")
            _amx_bytes_left = -1
        return False
    _amx_bytes_left -= nbytes
    return True


_compressed_faster: dict[str, bool] = {}


def amx_compressed_copy_chosen(kind: str) -> bool:
    """Whether the AMX GEMM's int4 ("int4": a GGUF Q4 layer's groups, 0.75 bytes a weight) or
    int8 ("int8": Q8_0 blocks, ~1.06) copy is faster than its bfloat16 copy on this CPU,
    measured once per process: 64 rows through 8 layers of 1536 x 576 (14 MB in bfloat16,
    past L2), best of 8 alternated, and chosen only if 3% faster. The copies read fewer bytes
    but widen every weight in registers: on one AMX host the int4 copy took 9.6 ms for a
    step's layers against the bfloat16 copy's 12.1, on another 16.4-17.4 against 12.0-12.2
    (BENCHMARKS.md, twentieth round). KEEL_AMX_COMPRESSED=0 / 1 skips the measurement. False
    without AMX tiles (AVX512-BF16's dot products take the bfloat16 copy only)."""
    from keel.cpu_ops import get_cpu_ops

    ops = get_cpu_ops()
    if ops is None or not ops.amx_gemm_available():  # the copies are widened on the tiles
        return False
    if kind not in _compressed_faster:
        forced = gc.forced_choice("KEEL_AMX_COMPRESSED", "the bfloat16 copy",
                                "the file's int4 / int8 blocks")
        if forced is not None:
            _compressed_faster[kind] = forced
        else:
            _compressed_faster[kind] = _time_compressed_copy(kind)
            logger.info("AMX GEMM on this CPU: the %s copy of a GGUF file's blocks %s", kind,
                        "measured faster than the bfloat16 copy, and is used" if
                        _compressed_faster[kind] else "measured no faster than the bfloat16 "
                        "copy, which is used instead")
    return _compressed_faster[kind]


def _time_compressed_copy(kind: str, layers: int = 8, n: int = 1536, k: int = 576) -> bool:
    from keel.utils import best_seconds

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, k, generator=g).bfloat16()
    plain, compressed = [], []
    for _ in range(layers):
        d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        if kind == "int4":  # Q4_1's form: q d + m, d and m float16
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            m = (-torch.rand(n, k // 32, generator=g) * 0.08).half()
            w = (q.float().view(n, -1, 32) * d.float()[..., None] + m.float()[..., None])
            copy = gc._keel_ops.amx_gemm_pack_int4(
                (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), d, m, w.view(n, k).bfloat16())
        else:  # Q8_0's: q d, d float16
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            w = q.float().view(n, -1, 32) * d.float()[..., None]
            copy = gc._keel_ops.amx_gemm_pack_int8(q, d.float(), w.view(n, k).bfloat16())
        if not copy.numel():
            return False
        plain.append(gc._keel_ops.amx_gemm_pack(w.view(n, k).bfloat16()))
        compressed.append(copy)

    def run(copies):
        return lambda: [gc._keel_ops.amx_gemm(x, c, n) for c in copies]

    # Alternated, best of 8 each (this machine's speed drifts), and faster by 3% at least:
    # the bfloat16 copy is the plain path.
    run(compressed)(), run(plain)()  # warm-up
    return gc._faster(lambda: best_seconds(run(compressed), 1, warmup=False),
                   lambda: best_seconds(run(plain), 1, warmup=False), 8, margin=0.97)
