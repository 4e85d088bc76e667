"""The GEMMs of one decode step of the default model: `F.linear` (MKL for float32) against
keel's oneDNN-packed weights (keel/model_executor/layers/linear.py), same inputs, same process.

Shapes: SmolLM2-135M's 30 layers of qkv [960 x 576], o [576 x 576], gate_up [3072 x 576],
down [576 x 1536], and the vocabulary projection [49152 x 576], each with its own weight (so
weights stream from memory as in a real step). Prints ms per step for each and the ratio.

    .venv/bin/python benchmarks/linear_gemm.py               # 64 rows (64 decode requests)
    .venv/bin/python benchmarks/linear_gemm.py --rows 32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from keel.model_executor.layers.linear import onednn_gemm_supported, pack_weight, packed_linear
from keel.utils import cpu_model

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
VOCAB = 49152
NUM_LAYERS = 30


def time_step(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"machine: {cpu_model()}, {torch.get_num_threads()} torch threads, torch "
          f"{torch.__version__}; {args.rows} rows, {NUM_LAYERS} layers + vocabulary projection")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        weights = [
            (0.05 * torch.randn(n, k, generator=g)).to(dtype)
            for _ in range(NUM_LAYERS) for n, k in LAYER_SHAPES
        ] + [(0.05 * torch.randn(VOCAB, 576, generator=g)).to(dtype)]
        if not onednn_gemm_supported(weights[0]):
            print(f"{dtype}: oneDNN packing unavailable on this machine")
            continue
        inputs = {k: torch.randn(args.rows, k, generator=g).to(dtype) for _, k in LAYER_SHAPES}
        packed = [pack_weight(w) for w in weights]

        def dense(weights=weights, inputs=inputs):
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def onednn(packed=packed, weights=weights, inputs=inputs):
            for pw, w in zip(packed, weights):
                packed_linear(inputs[w.shape[1]], pw)

        t_dense = time_step(dense, args.repeats)
        t_packed = time_step(onednn, args.repeats)
        print(f"{dtype!s:15} F.linear {t_dense:7.1f} ms   oneDNN packed {t_packed:7.1f} ms   "
              f"F.linear / packed = {t_dense / t_packed:.2f}x")


if __name__ == "__main__":
    main()
