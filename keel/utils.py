"""Small process-level helpers."""

from __future__ import annotations

import os

import torch


def configure_threads(threads: int | None) -> int:
    """Pick torch's intra-op thread count deliberately.

    On a 2-core machine two processes that both spin OpenMP threads slow each other down ~40x,
    so keel uses passive OpenMP waiting for processes it starts and takes `threads` (default:
    the cores this process may run on) instead of torch's guess.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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


def seconds_since_process_start() -> float | None:
    """Wall time since this process was created (Linux /proc), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    import time

    return time.time() - (btime + start_ticks / os.sysconf("SC_CLK_TCK"))
