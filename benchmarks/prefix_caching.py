"""Prefix caching on and off, on the default model (float32 unless --dtype):

  chat      64 requests sharing a 1,000-token system prompt, each with its own 50-token
            question, 64 new tokens, greedy, all submitted at once (a chat or agent server's
            traffic): time to first token (p50 / p90, from submission), total time, the share
            of prompt tokens the cache supplied, and whether the outputs agree.
  distinct  64 requests with nothing in common (16-47 random token ids, 128 new tokens): the
            cost of hashing blocks when nothing is ever reused, as output tokens/s on vs off,
            plus the time of one block hash against one decode step.

    .venv/bin/python benchmarks/prefix_caching.py
    .venv/bin/python benchmarks/prefix_caching.py --num-requests 8 --system-len 200  # smoke
"""

from __future__ import annotations

import argparse
import logging
import platform
import random
import statistics
import time

import torch

from keel import LLM, SamplingParams
from keel.core.kv_cache_utils import hash_block_tokens
from keel.utils import cpu_model


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], float,
                                                                         list[list[int]]]:
    """Submit every prompt at once and step the engine: (TTFT per request, total seconds,
    output token ids)."""
    core = llm.engine_core
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        request, _ = llm.input_processor.process(f"b{i}", {"prompt_token_ids": p}, params)
        core.add_request(request)
    while core.scheduler.has_requests():
        out, _ = core.step()
        now = time.perf_counter()
        for o in out.get(0).outputs if out else ():
            if o.new_token_ids:
                first.setdefault(o.request_id, now - t0)
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    total = time.perf_counter() - t0
    order = [f"b{i}" for i in range(len(prompts))]
    return [first[r] for r in order], total, [outputs[r] for r in order]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    rng = random.Random(0)
    vocab = 40000

    def ids(n):
        return [rng.randrange(100, vocab) for _ in range(n)]

    system = ids(args.system_len)
    chat = [system + ids(args.question_len) for _ in range(args.num_requests)]
    distinct = [ids(rng.randint(16, 47)) for _ in range(args.num_requests)]
    print(f"# {cpu_model()} | {platform.python_version()} | torch {torch.__version__} | "
          f"default model, {args.dtype} | {args.num_requests} requests")

    results = {}
    for caching in (True, False):
        llm = LLM(dtype=args.dtype, enable_prefix_caching=caching)
        run(llm, chat[:2], 4)  # warm-up (and, with caching, nothing useful is left cached:
        llm.reset_prefix_cache()  # the timed run starts cold)
        ttft, total, outs = run(llm, chat, args.max_tokens)
        stats = llm.engine_core.scheduler.make_stats()
        hit_rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
        _, d_total, d_outs = run(llm, distinct, 128)
        results[caching] = (ttft, total, outs, hit_rate, d_total, d_outs)
        llm.close()
        name = "on " if caching else "off"
        print(f"chat, caching {name}: TTFT p50 {statistics.median(ttft):6.2f} s  p90 "
              f"{pct(ttft, 0.9):6.2f} s | total {total:6.2f} s | "
              f"{args.num_requests * args.max_tokens / total:6.1f} output tok/s | "
              f"prefix-cache hit rate {hit_rate:5.1%}")
        print(f"distinct, caching {name}: {args.num_requests * 128 / d_total:6.1f} output "
              f"tok/s ({d_total:.2f} s)")
    on, off = results[True], results[False]
    print(f"chat: TTFT p50 off/on = {statistics.median(off[0]) / statistics.median(on[0]):.1f}x,"
          f" total off/on = {off[1] / on[1]:.2f}x; outputs identical "
          f"{sum(a == b for a, b in zip(on[2], off[2]))}/{len(chat)}")
    print(f"distinct: output tok/s on/off = {off[4] / on[4]:.3f} (1.0 = hashing costs nothing); "
          f"outputs identical {sum(a == b for a, b in zip(on[5], off[5]))}/{len(distinct)}")
    block = list(range(16))
    parent = hash_block_tokens(None, block)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        hash_block_tokens(parent, block)
    per_hash = (time.perf_counter() - t0) / n
    step = off[4] / 128  # seconds per decode step of the distinct run (64 requests)
    per_step = args.num_requests / 16  # blocks that fill up per step at 64 decoding requests
    print(f"one block hash: {per_hash * 1e6:.1f} us; ~{per_step:.0f} hashes per decode step "
          f"at {args.num_requests} requests = {per_hash * per_step * 1e6:.0f} us against a "
          f"{step * 1e3:.0f} ms step ({per_hash * per_step / step:.4%})")


if __name__ == "__main__":
    main()
