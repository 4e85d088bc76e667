"""Per-step cost of sampling: `SamplingMetadata` (already built; a steady batch reuses it) ->
`Sampler` on [N, vocab] float32 logits -> tokens to the CPU -> appended to the persistent batch,
at N running requests, for three batches:

  greedy   every request greedy (must cost what it cost before the sampling options landed)
  top_p    every request random, temperature 0.8, top-p 0.9
  mixed    a quarter each: greedy; top-k 40 + top-p 0.9 (half of them seeded); presence /
           frequency / repetition penalties; min-p 0.05 + 5 logprobs

No forward pass: logits are random (the vocabulary of SmolLM2, 49152), and the copy that feeds
each step is made outside the timed region. Requests have a 200-token prompt and a growing
output, so the penalties count real histories.

    .venv/bin/python benchmarks/sampling_overhead.py
    .venv/bin/python benchmarks/sampling_overhead.py --sizes 8 --steps 5   # smoke test

With --generate it also times the whole engine (`LLM.generate`, the default model, float32):
64 prompts of 10-122 random token ids, 128 new tokens, greedy and then temperature 0.8 /
top-p 0.9, output tokens/s (best of 2).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

from keel.sampling_params import SamplingParams
from keel.utils import cpu_model
from keel.worker.input_batch import CachedRequestState, InputBatch

VOCAB = 49152
PROMPT_LEN = 200
MAX_LEN = 1024


def scenario_params(name: str, n: int) -> list[SamplingParams]:
    if name == "greedy":
        return [SamplingParams(temperature=0.0) for _ in range(n)]
    if name == "top_p":
        return [SamplingParams(temperature=0.8, top_p=0.9) for _ in range(n)]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(temperature=0.0))
        elif kind == 1:
            out.append(SamplingParams(temperature=0.8, top_k=40, top_p=0.9,
                                      seed=i if i % 8 == 1 else None))
        elif kind == 2:
            out.append(SamplingParams(temperature=0.7, presence_penalty=0.5,
                                      frequency_penalty=0.3, repetition_penalty=1.1))
        else:
            out.append(SamplingParams(temperature=1.0, min_p=0.05, logprobs=5))
    return out


def build_batch(params: list[SamplingParams]) -> InputBatch:
    n = len(params)
    try:
        batch = InputBatch(n, MAX_LEN, 4096, 16, torch.device("cpu"), vocab_size=VOCAB)
    except TypeError:  # keel before the sampling options (the "before" column)
        batch = InputBatch(n, MAX_LEN, 4096, 16, torch.device("cpu"))
    rng = np.random.default_rng(0)
    for i, sp in enumerate(params):
        gen = None
        if sp.seed is not None and not sp.greedy:
            gen = torch.Generator().manual_seed(sp.seed)
        batch.add_request(CachedRequestState(
            req_id=f"r{i}", prompt_token_ids=rng.integers(0, VOCAB, PROMPT_LEN).tolist(),
            sampling_params=sp, generator=gen, block_ids=([0] * (MAX_LEN // 16),),
            num_computed_tokens=PROMPT_LEN,
        ))
    batch.condense()
    batch.refresh_metadata()
    return batch


def run(name: str, n: int, steps: int, warmup: int) -> float:
    from keel.sample.sampler import Sampler

    batch = build_batch(scenario_params(name, n))
    sampler = Sampler(n)
    meta = batch.sampling_metadata
    rows = np.arange(n)
    base = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    times = []
    for step in range(warmup + steps):
        logits = base.clone()  # the sampler consumes its input; not timed
        t0 = time.perf_counter()
        out = sampler(logits, meta)
        sampled = getattr(out, "sampled_token_ids", out)  # also runs against older samplers
        batch.append_sampled_tokens(rows, sampled.cpu().numpy())
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def generate_throughput() -> None:
    import logging
    import random

    from keel import LLM

    logging.disable(logging.WARNING)
    llm = LLM(dtype="float32")
    rng = random.Random(0)
    reqs = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(10, 122))]}
            for _ in range(64)]
    llm.generate(reqs[:4], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for name, sp in [("greedy", SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)),
                     ("top_p", SamplingParams(temperature=0.8, top_p=0.9, max_tokens=128,
                                              ignore_eos=True))]:
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            llm.generate(reqs, sp, use_tqdm=False)
            best = max(best, 64 * 128 / (time.perf_counter() - t0))
        print(f"LLM.generate {name:>6}: {best:7.1f} output tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--scenarios", nargs="+", default=["greedy", "top_p", "mixed"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--generate", action="store_true",
                    help="also time LLM.generate on the default model (greedy and top-p)")
    args = ap.parse_args()

    print(f"# {cpu_model()} | {platform.python_version()} | torch {torch.__version__} | "
          f"{torch.get_num_threads()} threads | vocab {VOCAB}")
    results = {}
    for n in args.sizes:
        for name in args.scenarios:
            us = run(name, n, args.steps, args.warmup)
            results[f"{name}@{n}"] = us
            print(f"{name:>7} N={n:<4} {us / 1000:8.2f} ms/step  ({us / n:7.1f} us/request)")
    if args.json:
        print(json.dumps(results))
    if args.generate:
        generate_throughput()


if __name__ == "__main__":
    main()
