"""keel's float32 GEMM as a fraction of what the cores' FMAs can do, measured in one process.

The issue's GEMM floor takes the best rate this machine reaches for a step's shapes; this
script asks how far that rate is from the hardware's. It builds benchmarks/fma_peak.c as a
library (12 independent FMA chains per thread, nothing else: the float32 FMA rate no GEMM can
pass) and, round after round, times the probe, then each GEMM, then the probe again. Each
GEMM's rate is divided by the mean of the two probe rates around it, so that a phase of the
shared host moves both sides of the fraction. Printed per shape: the median and the best of the
rounds, for keel's GEMM (`gemm`, `gemm_silu` for [gate; up]) and for torch's `F.linear`. The
median is the measure: a round whose probe met a slower phase than its GEMM can read above 1.

The shapes are the default model's four layer kinds (SmolLM2-135M: qkv 960 x 576, o 576 x 576,
[gate; up] 3,072 x 576 with SiLU, down 576 x 1,536) at a decode step's 64 rows and a prompt
step's 4,096, the weights hot in cache (BENCHMARKS.md, fifty-third round).

    .venv/bin/python benchmarks/gemm_efficiency.py [--rows 64 4096] [--rounds 8]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from keel.cpu_ops import get_cpu_ops

HERE = Path(__file__).resolve().parent
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up_silu": (3072, 576), "down": (576, 1536)}


def fma_probe(folder: Path):
    """fma_peak_gflops(threads, iters) from fma_peak.c, built for this CPU. Loaded after torch,
    its OpenMP calls bind to the libgomp torch has loaded: one pool of threads, not two."""
    lib = folder / "fma_peak.so"
    subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", "-fPIC", "-shared",
                    "-DFMA_PEAK_LIB", "-o", str(lib), str(HERE / "fma_peak.c")], check=True)
    probe = ctypes.CDLL(str(lib)).fma_peak_gflops
    probe.argtypes, probe.restype = [ctypes.c_int, ctypes.c_long], ctypes.c_double
    return probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    ops = get_cpu_ops()
    if ops is None or not ops.gemm_available():
        raise SystemExit("keel's GEMM is not built for this CPU (it needs AVX2 and FMA).")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        probe = fma_probe(Path(tmp))
        iters = 2_000_000
        cases = []
        for rows in args.rows:
            for name, (n, k) in SHAPES.items():
                x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
                packed = ops.gemm_pack(w)
                flop = 2 * rows * n * k
                reps = max(1, int(3e9 / flop))
                if name == "gate_up_silu":
                    keel = (lambda x=x, p=packed, n=n: ops.gemm_silu(x, p, n, None))
                else:
                    keel = (lambda x=x, p=packed, n=n: ops.gemm(x, p, n, None))
                cases.append((f"{rows} rows, {name} [{n} x {k}]", flop * reps, reps,
                              {"keel gemm": keel, "F.linear": (lambda x=x, w=w: F.linear(x, w))}))
        fractions = {(c[0], kind): [] for c in cases for kind in c[3]}
        peaks = []
        for _ in range(args.rounds):
            before = probe(args.threads, iters)
            peaks.append(before)
            for label, flops, reps, fns in cases:
                for kind, fn in fns.items():
                    t = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    rate = flops / (time.perf_counter() - t) / 1e9
                    after = probe(args.threads, iters)
                    fractions[label, kind].append(rate / ((before + after) / 2))
                    before = after
    print(f"{torch.__version__} | {args.threads} threads | float32 FMA probe: median "
          f"{statistics.median(peaks):.1f}, best {max(peaks):.1f} GFLOP/s | {args.rounds} rounds")
    print("fraction of the FMA rate (median / best of the rounds):")
    for label, _, _, fns in cases:
        cells = "   ".join(f"{kind} {statistics.median(fractions[label, kind]):.2f} / "
                           f"{max(fractions[label, kind]):.2f}" for kind in fns)
        print(f"  {label:38s} {cells}")


if __name__ == "__main__":
    main()
