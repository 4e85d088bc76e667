"""Speculative decoding with n-gram drafts on a workload where drafts hit: the default model
(float32 unless --dtype) asked to repeat a given passage, greedy. Output tokens/s and mean
per-request latency at batch 1 and batch 16, with and without drafts (and with drafts plus
async scheduling, where the scheduler plans with draft placeholders), and the acceptance rate
(accepted / proposed drafts, and per position). Outputs must be identical.

    .venv/bin/python benchmarks/spec_decode.py
    .venv/bin/python benchmarks/spec_decode.py --max-tokens 16 --batches 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import sys
import time

import torch

from keel import LLM, SamplingParams
from keel.utils import cpu_model

PASSAGES = [
    ("The quick brown fox jumps over the lazy dog. The dog did not move, and the fox ran on "
    "into the forest, where it found a river and followed it to the sea."),
    ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    "    return a * b\n"),
    ("Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital "
    "of Spain. Rome is the capital of Italy. Lisbon is the capital of Portugal."),
    ("To make tea, boil water, put a tea bag in a cup, pour the water over it, wait three "
    "minutes, take the bag out, and add milk if you like."),
]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": "Repeat this text exactly, word for word:\n\n"
              + PASSAGES[i % len(PASSAGES)]}] for i in range(n)]


def run(llm: LLM, convs, max_tokens: int) -> tuple[float, float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return n_tokens / dt, dt, [o.outputs[0].token_ids for o in outs]


ENGINES = {"plain": {}, "ngram": {"spec": True},
           "ngram+async": {"spec": True, "async_scheduling": True}}


def measure(name: str, args) -> dict:
    """One engine, in this process: every batch size once. Returns per batch: tok/s, seconds,
    the outputs and the spec-decode counters of the run."""
    opts = ENGINES[name]
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False,
              speculative_config=spec_cfg if opts.get("spec") else None,
              async_scheduling=opts.get("async_scheduling", False))
    run(llm, prompts(2), 8)  # warm-up
    out = {}
    for batch in args.batches:
        before = llm.engine_core.scheduler.make_stats()
        tok_s, dt, tokens = run(llm, prompts(batch), args.max_tokens)
        a = llm.engine_core.scheduler.make_stats()
        out[batch] = dict(
            tok_s=tok_s, dt=dt, tokens=tokens,
            drafts=a.spec_num_draft_tokens - before.spec_num_draft_tokens,
            accepted=a.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
            passes=max(a.spec_num_drafts - before.spec_num_drafts, 1),
            per_pos=[x - y for x, y in zip(a.spec_accepted_per_pos,
                                           before.spec_accepted_per_pos + [0] * args.k)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    if args.engine:
        print(json.dumps(measure(args.engine, args)))
        return
    print(f"# {cpu_model()} | {platform.python_version()} | torch {torch.__version__} | "
          f"default model, {args.dtype} | repeat-a-passage prompts, greedy, "
          f"{args.max_tokens} new tokens at most, ngram k={args.k}, prompt_lookup 2..4 | "
          "one process per engine run (two engines' thread pools in one process slow both), "
          "alternating, best of 2")
    best: dict[str, dict] = {}
    for _ in range(2):
        for name in ENGINES:
            cmd = [sys.executable, __file__, "--engine", name, "--max-tokens",
                   str(args.max_tokens), "--k", str(args.k), "--dtype", args.dtype,
                   "--batches", *map(str, args.batches)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                            text=True).stdout.strip().splitlines()[-1])
            for batch, r in res.items():
                key = best.setdefault(name, {})
                if batch not in key or r["tok_s"] > key[batch]["tok_s"]:
                    key[batch] = r
    for batch in map(str, args.batches):
        p = best["plain"][batch]
        n = int(batch)
        print(f"batch {n:3d}: plain {p['tok_s']:7.1f} tok/s ({p['dt'] / n * 1e3:8.0f} ms per "
              "request)")
        for name in ("ngram", "ngram+async"):
            s = best[name][batch]
            per_pos = ", ".join(f"{x / s['passes']:.2f}" for x in s["per_pos"])
            same = sum(x == y for x, y in zip(p["tokens"], s["tokens"]))
            print(f"    {name:11s} {s['tok_s']:7.1f} tok/s ({s['dt'] / n * 1e3:8.0f} ms per "
                  f"request) | speed-up {s['tok_s'] / p['tok_s']:.2f}x | acceptance "
                  f"{s['accepted'] / max(s['drafts'], 1):.1%} ({s['accepted']}/{s['drafts']}),"
                  f" per position {per_pos} | identical {same}/{n}")


if __name__ == "__main__":
    main()
