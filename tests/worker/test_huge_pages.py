"""weights_on_huge_pages: the anonymous memory a model load mapped goes on transparent huge
pages (each case in its own process, so the memory probed is the probe's own)."""

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json
import torch
from keel.utils import anonymous_regions, weights_on_huge_pages
before = anonymous_regions()
w = torch.ones(16 << 20)  # 64 MiB: mapped after `before`, as packed weights are
advised = weights_on_huge_pages(before)
huge = sum(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
print(json.dumps({"advised": advised, "huge_kib": huge, "sum": float(w.sum())}))
"""


def _probe(mode: str) -> dict:
    env = dict(os.environ, KEEL_HUGE_PAGES=mode, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_memory_mapped_since_the_snapshot_is_advised_and_keeps_its_values():
    on = _probe("1")
    assert on["advised"] >= 60 << 20  # the tensor's 2 MiB-aligned inside
    assert on["sum"] == 16 << 20
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    if "[never]" not in thp and release >= (6, 1):  # MADV_COLLAPSE: Linux 6.1
        assert on["huge_kib"] >= 32 << 10


def test_off_advises_nothing():
    off = _probe("0")
    assert off["advised"] == 0 and off["huge_kib"] < 32 << 10 and off["sum"] == 16 << 20
