"""Decode attention alone: keel's `paged_attention` kernel over the default model's shapes (9
query heads over 3 KV heads of 64 dims, blocks of 16), in two settings.

- `l2`: K/V that stay in L2 (2 rows x 512 keys, one thread, 2,000 calls a pass): the kernel's
  arithmetic, in ns per key and KV head.
- `memory`: 64 rows over 30 layers' caches, contexts of 364-864 keys (50-179 with `--short`),
  each call reading its layer's cache from memory as a decode step does, with the blocks of
  each row in ascending, descending or random order.

Each case runs once per bfloat16 kernel choice where it applies (`KEEL_ATTN_BF16_DOT=0|1`:
`decode_row16` or the bfloat16 dot-product kernel; the same kernel where the CPU lacks
AVX512-BF16), alternated, best of `--repeats` passes (BENCHMARKS.md, thirty-fourth round).
The caches are float32, bfloat16, or int8 rows with a float32 scale each
(`kv_cache_dtype="int8"`, thirty-fifth round).

    .venv/bin/python benchmarks/decode_attention.py [--cases l2 memory] [--short]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from keel.cpu_ops import get_cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPES = {"bf16/bf16": (torch.bfloat16, torch.bfloat16), "bf16 cache/fp32 query":
          (torch.bfloat16, torch.float32), "fp32/fp32": (torch.float32, torch.float32),
          "int8 cache/bf16 query": (torch.int8, torch.bfloat16),
          "int8 cache/fp32 query": (torch.int8, torch.float32)}


def make_case(rows: int, lo: int, hi: int, layers: int, cache_dtype, query_dtype, order: str):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi, (rows,), generator=g)
    per = -(-hi // BLOCK)
    ids = torch.arange(rows * per).view(rows, per)
    if order == "descending":
        ids = ids.flip(1)
    elif order == "random":
        ids = torch.randperm(rows * per, generator=g).view(rows, per)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(query_dtype)
    if cache_dtype == torch.int8:  # kv_cache_dtype="int8": rows of int8 and their scales
        caches = [tuple(torch.randint(-127, 128, (rows * per, KV_HEADS, BLOCK, HEAD_DIM),
                                      generator=g, dtype=torch.int8) for _ in range(2))
                  + tuple(torch.rand(rows * per, KV_HEADS, BLOCK, generator=g) / 64
                          for _ in range(2)) for _ in range(layers)]
    else:
        caches = [tuple(torch.randn(rows * per, KV_HEADS, BLOCK, HEAD_DIM, generator=g)
                        .to(cache_dtype) for _ in range(2)) for _ in range(layers)]
    return q, caches, ids.to(torch.int32).contiguous(), lens


def timed(ops, case, calls: int) -> float:
    q, caches, table, lens = case
    t0 = time.perf_counter()
    for _ in range(calls):
        for k, v, *scales in caches:
            ops.paged_attention(q, k, v, table, lens, None, HEAD_DIM**-0.5, 0, *scales)
    return time.perf_counter() - t0


def choices(name: str) -> list[str]:
    return ["0", "1"] if name == "bf16/bf16" else [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=["l2", "memory"], choices=["l2", "memory"])
    ap.add_argument("--short", action="store_true", help="memory: contexts of 50-179 keys")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ops = get_cpu_ops()
    if ops is None:
        raise SystemExit("keel's CPU kernels did not build on this machine")
    threads = torch.get_num_threads()
    if "l2" in args.cases:
        torch.set_num_threads(1)
        print("K/V in L2 (2 rows x 512 keys, one thread): ns per key and KV head")
        for name, (cd, qd) in DTYPES.items():
            case = make_case(2, 512, 513, 1, cd, qd, "random")
            best = {c: float("inf") for c in choices(name)}
            for _ in range(args.repeats):
                for c, t in best.items():
                    os.environ["KEEL_ATTN_BF16_DOT"] = c
                    best[c] = min(t, timed(ops, case, 2000))
            for c, t in best.items():
                label = {"0": " (decode_row16)", "1": " (KEEL_ATTN_BF16_DOT=1)", "": ""}[c]
                print(f"  {name}{label}: {t / (2000 * 2 * 512 * KV_HEADS) * 1e9:.2f} ns")
        torch.set_num_threads(threads)
    if "memory" in args.cases:
        lo, hi = (50, 180) if args.short else (364, 865)
        print(f"64 rows, 30 layers' caches from memory, {lo}-{hi - 1} keys: ms per 30 calls")
        for name, (cd, qd) in DTYPES.items():
            for order in ("ascending", "descending", "random"):
                case = make_case(64, lo, hi, 30, cd, qd, order)
                best = {c: float("inf") for c in choices(name)}
                for _ in range(args.repeats):
                    for c, t in best.items():
                        os.environ["KEEL_ATTN_BF16_DOT"] = c
                        best[c] = min(t, timed(ops, case, 1))
                # K/V bytes a pass reads (an int8 cache's scales too: 4 bytes a row)
                row = HEAD_DIM * case[1][0][0].element_size() + 4 * (cd == torch.int8)
                nbytes = 30 * int(case[3].sum()) * KV_HEADS * 2 * row
                for c, t in best.items():
                    label = {"0": ", decode_row16", "1": ", KEEL_ATTN_BF16_DOT=1", "": ""}[c]
                    print(f"  {name}, {order} blocks{label}: {t * 1e3:.1f} ms "
                          f"({nbytes / t / 1e9:.1f} GB/s of K/V)")
                del case
    os.environ.pop("KEEL_ATTN_BF16_DOT", None)


if __name__ == "__main__":
    main()
