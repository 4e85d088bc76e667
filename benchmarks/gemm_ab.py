"""keel's float32 GEMM (keel/csrc/gemm.cpp) of two git revisions, side by side in one process.

Builds `gemm.cpp` (with `fused_ops.cpp` for gemm_silu's epilogue) of a base revision and of the
working tree as two small extensions, checks that both give the same bits, then times them in
alternation on SmolLM2-135M's layer shapes and prints the median of the per-pair time ratios.
On a shared host whose speed moves by 10-20% from one minute to the next, only such pairs show
a few percent; separate processes do not.

    .venv/bin/python benchmarks/gemm_ab.py                      # base HEAD~1, 2,052 rows
    .venv/bin/python benchmarks/gemm_ab.py --base ef8e245 --rows 64 --repeats 61
    .venv/bin/python benchmarks/gemm_ab.py --weights bfloat16
    .venv/bin/python benchmarks/gemm_ab.py --rows 64 --layers 30   # weights from memory
    .venv/bin/python benchmarks/gemm_ab.py --no-avx512             # the AVX2 kernel
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "keel" / "csrc"
SOURCES = ("gemm.cpp", "fused_ops.cpp")
BINDING = """#include <torch/extension.h>
#include "ops.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_pack", &gemm_pack);
  m.def("gemm", &gemm);
  m.def("gemm_silu", &gemm_silu);
}
"""
# (name, N, K): qkv, o_proj, gate_up (gemm_silu), down_proj of the default model.
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up_silu", 3072, 576), ("down", 576, 1536)]


def build(src: Path, tag: str, extra_cflags: list[str]):
    from torch.utils.cpp_extension import load

    from keel.cpu_ops import _CFLAGS

    (src / "ab_binding.cpp").write_text(BINDING)
    digest = hashlib.sha256((tag + " ".join(extra_cflags)).encode())
    for name in sorted(os.listdir(src)):
        digest.update((src / name).read_bytes())
    return load(name=f"keel_gemm_ab_{digest.hexdigest()[:12]}",
                sources=[str(src / "ab_binding.cpp")] + [str(src / s) for s in SOURCES],
                extra_cflags=_CFLAGS + extra_cflags, extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(src)], verbose=False)


def checkout_csrc(rev: str, into: Path) -> Path:
    """keel/csrc as it was at `rev`, written under `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "keel/csrc"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "keel" / "csrc"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD~1", help="git revision to compare against")
    p.add_argument("--rows", type=int, default=2052)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--weights", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--layers", type=int, default=1,
                   help="distinct weights per shape, each call running all of them in turn "
                        "(30: a decode step's, streamed from memory; 1: one weight, hot)")
    p.add_argument("--no-avx512", action="store_true",
                   help="build both without AVX-512: the AVX2 kernel, measured on an AVX-512 CPU")
    args = p.parse_args()
    cflags = ["-mno-avx512f"] if args.no_avx512 else []
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]
    with tempfile.TemporaryDirectory() as tmp:
        base = build(checkout_csrc(args.base, Path(tmp)), args.base, cflags)
        work_src = Path(tmp) / "work"
        work_src.mkdir()
        for f in CSRC.iterdir():
            (work_src / f.name).write_bytes(f.read_bytes())
        work = build(work_src, "working tree", cflags)
    torch.manual_seed(0)
    dtype = getattr(torch, args.weights)
    m = args.rows
    print(f"keel gemm{' (AVX2 build)' if args.no_avx512 else ''}: {args.base} vs the working "
          f"tree; {m} rows, {args.weights} weights, "
          f"{args.layers} weight(s) per shape, {torch.get_num_threads()} threads, "
          f"{args.repeats} pairs")
    for name, n, k in SHAPES:
        ws = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(args.layers)]
        x = torch.randn(m, k)
        fns = []
        for mod in (base, work):
            packed = [mod.gemm_pack(w) for w in ws]
            op = mod.gemm_silu if name.endswith("silu") else mod.gemm
            fns.append(lambda op=op, packed=packed, x=x, n=n: [op(x, p, n, None)
                                                                for p in packed][-1])
        if not torch.equal(fns[0](), fns[1]()):
            raise SystemExit(f"{name}: the two revisions give different bits")
        times: list[list[float]] = [[], []]
        for _ in range(args.repeats):
            for i, fn in enumerate(fns):
                t = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - t)
        flops = 2 * m * n * k * args.layers
        ratio = statistics.median(a / b for a, b in zip(times[0], times[1]))
        print(f"{name:13s} base {flops / statistics.median(times[0]) / 1e9:6.1f}  "
              f"work {flops / statistics.median(times[1]) / 1e9:6.1f} GFLOP/s (medians)  "
              f"base / work time {ratio:.3f}  (same bits)")


if __name__ == "__main__":
    main()
