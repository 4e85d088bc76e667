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


KV_PROBE = r"""
import json
import torch
from keel.attention.layer import _zeros
c = _zeros((8 << 20,), torch.float32, torch.device("cpu"))  # 32 MiB, as a layer's K/V cache
c.fill_(1.0)  # the first touch
huge = sum(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
print(json.dumps({"huge_kib": huge, "sum": float(c.sum())}))
"""


def _kv_probe(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KEEL_KV_HUGE_PAGES=mode, KEEL_HUGE_PAGES="0", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", KV_PROBE], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_kv_cache_goes_on_huge_pages_only_when_asked():
    """KEEL_KV_HUGE_PAGES=1 advises the K/V cache's mapping before its first touch, so the
    kernel backs it with 2 MiB pages (where THP is not off); by default it stays on 4 KiB
    pages; any other value is refused by name."""
    on, off = (json.loads(_kv_probe(m).stdout.strip().splitlines()[-1]) for m in ("1", "0"))
    assert on["sum"] == off["sum"] == 8 << 20
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[madvise]" in thp:  # huge pages only where advised: this machine's setting
        assert on["huge_kib"] >= 16 << 10 and off["huge_kib"] < 16 << 10
    elif "[always]" in thp:  # every anonymous mapping may get them
        assert on["huge_kib"] >= 16 << 10
    else:  # [never]: the advice is harmless and changes nothing
        assert on["huge_kib"] < 16 << 10 and off["huge_kib"] < 16 << 10
    bad = _kv_probe("yes")
    assert bad.returncode != 0 and "KEEL_KV_HUGE_PAGES must be 0 or 1, got 'yes'" in bad.stderr
