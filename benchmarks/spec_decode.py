"""Speculative decoding with n-gram drafts on a workload where drafts hit: the default model
(float32 unless --dtype) asked to repeat a given passage, greedy. Output tokens/s and mean
per-request latency at batch 1 and batch 16, with and without drafts, and the acceptance
rate (accepted / proposed drafts, and per position). Outputs must be identical.

    .venv/bin/python benchmarks/spec_decode.py
    .venv/bin/python benchmarks/spec_decode.py --max-tokens 16 --batches 1   # smoke
"""

from __future__ import annotations

import argparse
import logging
import platform
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    print(f"# {cpu_model()} | {platform.python_version()} | torch {torch.__version__} | "
          f"default model, {args.dtype} | repeat-a-passage prompts, greedy, "
          f"{args.max_tokens} new tokens at most, ngram k={args.k}, prompt_lookup 2..4")
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    plain = LLM(dtype=args.dtype, enable_prefix_caching=False)
    spec = LLM(dtype=args.dtype, enable_prefix_caching=False, speculative_config=spec_cfg)
    for llm in (plain, spec):
        run(llm, prompts(2), 8)  # warm-up
    for batch in args.batches:
        convs = prompts(batch)
        best = {}
        for name, llm in (("plain", plain), ("ngram", spec), ("plain", plain),
                          ("ngram", spec)):
            before = llm.engine_core.scheduler.make_stats()
            tok_s, dt, tokens = run(llm, convs, args.max_tokens)
            after = llm.engine_core.scheduler.make_stats()
            if name not in best or tok_s > best[name][0]:
                best[name] = (tok_s, dt, tokens, before, after)
        p, s = best["plain"], best["ngram"]
        b, a = s[3], s[4]
        drafts = a.spec_num_draft_tokens - b.spec_num_draft_tokens
        accepted = a.spec_num_accepted_tokens - b.spec_num_accepted_tokens
        passes = max(a.spec_num_drafts - b.spec_num_drafts, 1)
        per_pos = [(x - y) / passes for x, y in zip(a.spec_accepted_per_pos,
                                                    b.spec_accepted_per_pos + [0] * args.k)]
        same = sum(x == y for x, y in zip(p[2], s[2]))
        print(f"batch {batch:3d}: plain {p[0]:7.1f} tok/s ({p[1] / batch * 1e3:8.0f} ms per "
              f"request) | ngram {s[0]:7.1f} tok/s ({s[1] / batch * 1e3:8.0f} ms per request) | "
              f"speed-up {s[0] / p[0]:.2f}x | acceptance {accepted / max(drafts, 1):.1%} "
              f"({accepted}/{drafts}), per position "
              f"{', '.join(f'{x:.2f}' for x in per_pos)} | identical {same}/{batch}")


if __name__ == "__main__":
    main()
