"""Async scheduling on and off, on a small model where the per-step Python (scheduling, the
diff, input preparation, output handling) is a visible share of a step: a random Llama
(hidden 256, 4 layers, vocab 32000), float32, 32 requests of 16-47 random token ids, 128 new
tokens, greedy. Output tokens/s, best of 3, alternating; outputs must be identical.

With async scheduling the engine schedules step N+1 while the worker thread runs step N
(two steps in flight); the overlap is whatever Python the engine thread can do while torch
ops run with the GIL released.

    .venv/bin/python benchmarks/async_scheduling.py
"""

from __future__ import annotations

import argparse
import logging
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from keel import LLM, SamplingParams
from keel.utils import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    import transformers

    folder = Path(tempfile.mkdtemp()) / "small-llama"
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=32000, max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 30000)
                                     for _ in range(rng.randint(16, 47))]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"# {cpu_model()} | {platform.python_version()} | torch {torch.__version__} | random "
          f"Llama (hidden 256, 4 layers), {args.dtype} | {args.num_prompts} prompts, "
          f"{args.max_tokens} new tokens, greedy")
    engines = {name: LLM(str(folder), dtype=args.dtype, async_scheduling=flag)
               for name, flag in (("sync", False), ("async", True))}
    best, tokens = {}, {}
    for _ in range(3):
        for name, llm in engines.items():
            llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            tok_s = args.num_prompts * args.max_tokens / (time.perf_counter() - t0)
            best[name] = max(best.get(name, 0.0), tok_s)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    for name in engines:
        print(f"{name:>5}: {best[name]:7.1f} output tok/s (best of 3)")
    same = sum(a == b for a, b in zip(tokens["sync"], tokens["async"]))
    print(f"async / sync = {best['async'] / best['sync']:.2f}x; outputs identical "
          f"{same}/{args.num_prompts}")


if __name__ == "__main__":
    main()
