"""Decode attention by KV block size: keel's `paged_attention` over the default model's shapes
(9 query heads over 3 KV heads of 64 dims), 64 rows over 30 layers' caches (each call reads
its layer's cache from memory, as a decode step does), with blocks of 16, 32 and 64 tokens.

Two layouts of each row's blocks:
- `ascending`: a row's blocks one after another in memory (a prompt's, allocated together);
- `decoded`: block j of row r at j x rows + r, as 64 requests growing by decoding leave them.

Every (block size, layout) runs once a round, alternating in one process; the report is each
one's median over the rounds in us a layer, and its ratio to blocks of 16. This is what chose
`config.default_block_size` (BENCHMARKS.md, sixty-fifth round).

    .venv/bin/python benchmarks/block_size.py [--keys 364 864] [--query float32]
        [--cache bfloat16] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from keel.cpu_ops import get_cpu_ops

HEADS, KV_HEADS, HEAD_DIM, ROWS, LAYERS = 9, 3, 64, 64, 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_layers(block: int, hi: int, cache_dtype: torch.dtype, g: torch.Generator):
    """LAYERS (key, value) caches of ROWS * blocks-per-row blocks, and the two tables."""
    per = -(-hi // block)
    caches = [tuple(torch.randn(ROWS * per, KV_HEADS, block, HEAD_DIM, generator=g)
                    .to(cache_dtype) for _ in range(2)) for _ in range(LAYERS)]
    ascending = torch.arange(ROWS * per, dtype=torch.int32).view(ROWS, per)
    decoded = (torch.arange(per)[None, :] * ROWS + torch.arange(ROWS)[:, None]).to(torch.int32)
    return caches, {"ascending": ascending, "decoded": decoded.contiguous()}


def us_per_layer(ops, q, caches, table, lens, calls: int = 3) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        for k, v in caches:
            ops.paged_attention(q, k, v, table, lens, None, HEAD_DIM**-0.5, 0)
    return (time.perf_counter() - t0) / calls / len(caches) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, nargs=2, default=[364, 864], metavar=("LO", "HI"))
    ap.add_argument("--query", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--cache", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    ops = get_cpu_ops()
    if ops is None:
        raise SystemExit("keel's CPU kernels are not built here (see keel/cpu_ops.py).")
    lo, hi = args.keys
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi, (ROWS,), generator=g)
    q = torch.randn(ROWS, HEADS, HEAD_DIM, generator=g).to(DTYPES[args.query])
    layers = {b: make_layers(b, hi, DTYPES[args.cache], g) for b in args.blocks}
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for b, (caches, tables) in layers.items():
            for order, table in tables.items():
                times.setdefault((b, order), []).append(us_per_layer(ops, q, caches, table, lens))
    print(f"# {args.query} queries, {args.cache} cache, {ROWS} rows x {lo}-{hi} keys, "
          f"{LAYERS} layers' caches; medians of {args.rounds} rounds, us a layer")
    for order in ("ascending", "decoded"):
        base = statistics.median(times[(args.blocks[0], order)])
        for b in args.blocks:
            t = statistics.median(times[(b, order)])
            print(f"  {order:9s}  block {b:3d}: {t:8.1f}   / block {args.blocks[0]}: "
                  f"{t / base:.3f}")


if __name__ == "__main__":
    main()
