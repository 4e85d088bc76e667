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
