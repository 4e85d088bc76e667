"""Cost of structured outputs per step: the default model, 64 requests of which half carry a
JSON schema (the other half free, greedy), against the same 64 requests all free.

The engine is stepped by hand, timing each part of `EngineCore.step` separately:
  forward   execute_model(non_block=True) + future.result()   (the forward pass)
  bitmask   scheduler.get_grammar_bitmask                     (matchers fill their rows)
  sample    sample_tokens(grammar_output)                     (bitmask applied, sampling)
  update    update_from_output                                (matchers accept the tokens)
Only decode steps are counted (every request past its prompt), medians over them.

How much of the bitmask is hidden behind the forward pass depends on the executor: the seed's
`uni` executor on a GPU queues the forward pass and returns, so the bitmask is built while the
GPU works; on the CPU `uni` runs the forward pass inside execute_model, so nothing is hidden
and the bitmask adds its full cost; a multi-process executor hides it again. The script prints
the bitmask time as a share of the forward pass: what an asynchronous forward pass hides.

    .venv/bin/python benchmarks/structured_output.py
"""

from __future__ import annotations

import argparse
import logging
import platform
import random
import time

import numpy as np
import torch

from keel import LLM, SamplingParams
from keel.sampling_params import StructuredOutputsParams
from keel.utils import cpu_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "tags"],
}


def run(llm: LLM, prompts, params) -> dict[str, float]:
    core = llm.engine_core
    scheduler, executor = core.scheduler, core.model_executor
    for i, (p, sp) in enumerate(zip(prompts, params)):
        request, _ = llm.input_processor.process(f"bench-{time.monotonic_ns()}-{i}", p, sp)
        core.add_request(request)
    times: dict[str, list[float]] = {k: [] for k in ("forward", "bitmask", "sample", "update")}
    while scheduler.has_requests():
        so = scheduler.schedule()
        decode = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) > 0
        t0 = time.perf_counter()
        future = executor.execute_model(so, non_block=True)
        t1 = time.perf_counter()
        grammar_output = scheduler.get_grammar_bitmask(so)
        t2 = time.perf_counter()
        out = future.result()
        if out is None:
            out = executor.sample_tokens(grammar_output)
        t3 = time.perf_counter()
        scheduler.update_from_output(so, out)
        t4 = time.perf_counter()
        if decode and len(so.num_scheduled_tokens) == len(prompts):
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[k].append(v * 1e3)
    return {k: float(np.median(v)) for k, v in times.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    logging.disable(logging.WARNING)

    llm = LLM(dtype=args.dtype)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(10, 60))]}
               for _ in range(args.requests)]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    json_params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    half = [json_params if i % 2 else free for i in range(args.requests)]
    run(llm, prompts[:4], [json_params] * 4)  # warm-up: compile the grammar, build kernels

    print(f"# {cpu_model()} | {platform.python_version()} | torch {torch.__version__} | "
          f"{torch.get_num_threads()} threads | default model, {args.dtype}")
    print(f"# {args.requests} requests, prompts of 10-60 token ids, {args.max_tokens} new tokens;"
          " medians over decode steps with every request running")
    for name, params in (("all free", [free] * args.requests), ("half JSON schema", half),
                         ("all free (again)", [free] * args.requests)):
        t = run(llm, prompts, params)
        total = sum(t.values())
        print(f"{name:>18}: step {total:7.1f} ms = forward {t['forward']:6.1f} + bitmask "
              f"{t['bitmask']:5.2f} + sample {t['sample']:5.2f} + update {t['update']:5.2f}"
              f"   (bitmask = {100 * t['bitmask'] / t['forward']:.1f}% of the forward pass)")


if __name__ == "__main__":
    main()
