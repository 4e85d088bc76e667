"""Executors side by side: the round-trip latency of one collective_rpc (a no-op method on
every worker, the cost each step pays twice: execute_model and sample_tokens), uni vs mp vs
ray, and the throughput of tensor_parallel_size=2 (mp and ray) and pipeline_parallel_size=2
(mp) against uni on the same model and token ids.

The machine has 2 cores: uni runs one process with 2 threads; TP=2 and PP=2 run two processes
with one pinned core each (their share).

The model is a random Llama (hidden 512, 8 layers, 8 heads, vocab 49152): the default model
has 9 attention heads, which 2 ranks cannot split.

    .venv/bin/python benchmarks/executor_overhead.py
"""

from __future__ import annotations

import argparse
import logging
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from keel import LLM, SamplingParams
from keel.utils import cpu_model


def rpc_latency_us(llm: LLM, calls: int = 300) -> tuple[float, float]:
    """Median and p90 of a blocking collective_rpc that returns from the output rank only."""
    executor = llm.engine_core.model_executor
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        executor.collective_rpc("get_rank", single_value=True)
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))]


def throughput(llm: LLM, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return len(prompts) * max_tokens / dt, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    logging.disable(logging.WARNING)

    import transformers

    folder = Path(tempfile.mkdtemp()) / "llama"
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4,
                                   vocab_size=49152, max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    model = str(folder)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(10, 80))]}
               for _ in range(args.num_prompts)]

    print(f"# {cpu_model()} | {platform.python_version()} | torch {torch.__version__} | "
          f"random Llama, float32 | {args.num_prompts} "
          f"prompts, {args.max_tokens} new tokens, greedy")
    results = {}
    for name, kwargs in (("uni", {}), ("mp TP=2", dict(tensor_parallel_size=2)),
                         ("mp PP=2", dict(pipeline_parallel_size=2)),
                         ("ray TP=2", dict(tensor_parallel_size=2,
                                           distributed_executor_backend="ray")),
                         ("uni (again)", {})):
        llm = LLM(model, dtype="float32", **kwargs)
        med, p90 = rpc_latency_us(llm)
        tok_s, tokens = throughput(llm, prompts, args.max_tokens)
        results[name] = tokens
        print(f"{name:>11}: collective_rpc round trip median {med:8.1f} us (p90 {p90:8.1f}) | "
              f"{tok_s:7.1f} output tok/s")
        llm.close()
    for name in ("mp TP=2", "mp PP=2", "ray TP=2"):
        same = sum(a == b for a, b in zip(results["uni"], results[name]))
        print(f"greedy sequences identical, uni vs {name}: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
