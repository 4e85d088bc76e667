"""What a K/V cache dtype costs in accuracy: the default model's log-likelihood of real text
(keel's own README.md and BENCHMARKS.md, cut into sequences), teacher-forced, with the prompt fed
in chunks of 32 tokens so that every chunk's queries read their context (and their own K/V)
back from the cache, as decode steps do, for each `kv_cache_dtype` under one compute dtype.
Prints each cache's mean negative log-likelihood per token and perplexity, and against the
widest cache: the mean absolute difference of the per-token log-probabilities and the share of
positions whose top-1 token is the same.

    .venv/bin/python benchmarks/kv_cache_accuracy.py                       # float32 compute
    .venv/bin/python benchmarks/kv_cache_accuracy.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv", nargs="+", default=None,
                    help="cache dtypes (default: float32 bfloat16 int8 under float32, "
                         "bfloat16 int8 under bfloat16)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-seqs", type=int, default=16)
    args = ap.parse_args()
    logging.disable(logging.WARNING)

    from keel import LLM, SamplingParams
    from keel.config import resolve_model_path
    from keel.utils import cpu_model

    kvs = args.kv or (["float32", "bfloat16", "int8"] if args.dtype == "float32"
                      else ["bfloat16", "int8"])
    folder = str(resolve_model_path(None))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = "\n\n".join((ROOT / name).read_text() for name in ("README.md", "BENCHMARKS.md")
                       if (ROOT / name).is_file())
    ids = tok(text)["input_ids"]
    n = min(args.num_seqs, len(ids) // args.seq_len)
    seqs = [ids[i * args.seq_len:(i + 1) * args.seq_len] for i in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    print(f"# {cpu_model()} | default model, dtype {args.dtype} | {n} sequences of "
          f"{args.seq_len} tokens of keel's README.md and BENCHMARKS.md, prompts in chunks of 32")
    runs = {}
    for kv in kvs:
        llm = LLM(model=folder, dtype=args.dtype, kv_cache_dtype=kv, max_num_batched_tokens=32,
                  enable_prefix_caching=False, max_model_len=args.seq_len + 8)
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
        lps, top1 = [], []
        for s, o in zip(seqs, outs):
            for t, pos in zip(s[1:], o.prompt_logprobs[1:]):
                lps.append(pos[t].logprob)
                top1.append(max(pos, key=lambda k: pos[k].logprob))
        runs[kv] = (lps, top1)
        nll = -sum(lps) / len(lps)
        print(f"  kv_cache_dtype={kv:9s} NLL {nll:.4f} nats/token, perplexity {math.exp(nll):.3f}")
        del llm
    ref_lps, ref_top1 = runs[kvs[0]]
    for kv in kvs[1:]:
        lps, top1 = runs[kv]
        diff = sum(abs(a - b) for a, b in zip(lps, ref_lps)) / len(lps)
        same = sum(a == b for a, b in zip(top1, ref_top1)) / len(top1)
        print(f"  {kv} against {kvs[0]}: mean |log-probability difference| {diff:.4f}, "
              f"top-1 token the same at {same:.2%} of {len(lps)} positions")


if __name__ == "__main__":
    main()
