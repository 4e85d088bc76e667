"""keep_freed_memory: freed activations are reused by the next pass instead of being faulted
in again page by page (each case in its own process: malloc's settings are process-wide)."""

import json
import os
import subprocess
import sys

PROBE = r"""
import json, resource, sys
import torch
from keel.utils import keep_freed_memory
applied = keep_freed_memory()
faults = []
for i in range(5):
    # 40 MB: above the 32 MiB that glibc's own threshold ever reaches, like a long pass's
    # activations; the sizes vary as a pass's do.
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(10_000_000 - 1000 * i).fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"applied": applied, "faults": faults}))
"""

PAGES = 40_000_000 // 4096


def _probe(keep: str) -> dict:
    env = dict(os.environ, KEEL_KEEP_FREED_MEMORY=keep, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_freed_activations_are_reused_without_page_faults():
    kept = _probe("1")
    assert kept["applied"] is True
    assert kept["faults"][0] > PAGES // 2  # the first pass touches fresh pages
    assert max(kept["faults"][1:]) < PAGES // 10, kept  # the later ones reuse them


def test_switched_off_by_env():
    plain = _probe("0")
    assert plain["applied"] is False
    # glibc's default: each 40 MB block goes back to the kernel and is faulted in again.
    assert min(plain["faults"]) > PAGES // 2, plain
