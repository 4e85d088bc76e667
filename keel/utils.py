"""Small process-level helpers."""

from __future__ import annotations

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
