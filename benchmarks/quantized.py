"""Quantized weights: keel with the GGUF file's 4-bit weights kept quantized vs keel with them
dequantized vs llama.cpp (llama-cpp-python) on the same GGUF file, the default model.

Single stream: one chat prompt, 256 new tokens, greedy (EOS does not stop). keel quantized
runs twice: with its default activations (two int8 parts per group of 32) and with
llama.cpp's (one int8 part, KEEL_QUANT_ACTIVATIONS=int8). Time to first
token (the prompt's prefill + one token), decode tokens/s over the other 255, peak RSS of the
process. Then keel at 8 and 64 concurrent requests (64 new tokens each), quantized vs dense,
to show the per-pass choice (layers/quantization.py) holds up. Every run is its own child
process (one engine per process), alternating, best of --rounds.

    .venv/bin/python benchmarks/quantized.py --llama-cpp-python /tmp/llamacpp-venv/bin/python

llama.cpp: `benchmarks/setup_peers.sh llamacpp` (llama-cpp-python 0.3.36 compiled for this CPU
in /tmp/llamacpp-venv, ~10 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "Explain how a steam engine works, step by step."}]

KEEL_CHILD = r"""
import json, resource, sys, time
args = json.loads(sys.argv[1])
t_start = time.perf_counter()
from keel import LLM, SamplingParams
llm = LLM(quantization=args["quantization"], dtype=args["dtype"])
tok = llm.tokenizer
ids = tok.apply_chat_template(args["messages"], add_generation_prompt=True, tokenize=True,
                              return_dict=False)
startup = time.perf_counter() - t_start
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate({"prompt_token_ids": ids}, one, use_tqdm=False)  # warm-up
res = {"startup_s": startup}
if args["batch"] == 1:
    t0 = time.perf_counter()
    llm.generate({"prompt_token_ids": ids}, one, use_tqdm=False)
    ttft = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=args["tokens"], ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].outputs[0]
    total = time.perf_counter() - t0
    res.update(ttft_s=ttft, decode_tok_s=(args["tokens"] - 1) / (total - ttft),
               text=out.text[:200], tokens=list(out.token_ids))
else:
    prompts = [{"prompt_token_ids": ids[: len(ids) - (i % 7)]} for i in range(args["batch"])]
    sp = SamplingParams(temperature=0, max_tokens=args["tokens"], ignore_eos=True)
    # Warm-up at this batch size too (oneDNN makes its kernels for each new shape).
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res["tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(res))
"""

LLAMA_CHILD = r"""
import json, resource, sys, time
args = json.loads(sys.argv[1])
t_start = time.perf_counter()
from llama_cpp import Llama
llm = Llama(model_path=args["gguf"], n_ctx=1024, n_threads=args["threads"], verbose=False)
ids = args["ids"]
startup = time.perf_counter() - t_start
def run(n):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    out = []
    for i in range(n):
        tok = int(llm.sample(temp=0.0))
        if i == 0:
            ttft = time.perf_counter() - t0
        out.append(tok)
        if i + 1 < n:
            llm.eval([tok])
    return ttft, time.perf_counter() - t0, out
run(4)  # warm-up
ttft, total, out = run(args["tokens"])
print(json.dumps({"startup_s": startup, "ttft_s": ttft,
                  "decode_tok_s": (args["tokens"] - 1) / (total - ttft),
                  "text": llm.detokenize(out).decode(errors="replace")[:200], "tokens": out,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def child(python: str, code: str, payload: dict, env: dict | None = None) -> dict:
    out = subprocess.run([python, "-c", code, json.dumps(payload)], capture_output=True,
                         text=True, check=False, env=env, cwd=HERE)
    if out.returncode != 0:
        raise RuntimeError(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp-python", default="/tmp/llamacpp-venv/bin/python",
                   help="a Python with llama-cpp-python installed ('' to skip llama.cpp)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = p.parse_args()
    if args.llama_cpp_python and not Path(args.llama_cpp_python).is_file():
        p.error(f"{args.llama_cpp_python} not found: run benchmarks/setup_peers.sh llamacpp, "
                "pass --llama-cpp-python, or pass --llama-cpp-python '' to leave llama.cpp out")
    sys.path.insert(0, str(HERE))
    from transformers import AutoTokenizer

    from keel.config import resolve_model_path
    from keel.model_executor.default_model import default_model_path
    from keel.utils import cpu_model

    gguf = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    threads = len(os.sched_getaffinity(0))
    # keel's default activations (two int8 parts per group of 32), llama.cpp's (one part).
    runs = {"keel quantized (gguf)": ("keel", "auto"), "keel quantized, int8 act": ("keel", "auto"),
            "keel dequantized": ("keel", None)}
    if args.llama_cpp_python:
        runs["llama.cpp"] = ("llama", None)
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for name, (engine, quant) in runs.items():
            if engine == "keel":
                env = dict(os.environ, KEEL_QUANT_ACTIVATIONS="int8" if "int8" in name
                           else "int16")
                res = child(sys.executable, KEEL_CHILD, {
                    "quantization": quant, "dtype": args.dtype, "messages": QUESTION,
                    "tokens": args.tokens, "batch": 1}, env)
            else:
                res = child(args.llama_cpp_python, LLAMA_CHILD, {
                    "gguf": gguf, "ids": ids, "tokens": args.tokens, "threads": threads})
            print(f"round {r}: {name:22s} decode {res['decode_tok_s']:6.1f} tok/s, TTFT "
                  f"{res['ttft_s'] * 1e3:6.1f} ms, peak RSS {res['peak_rss_mib']:6.0f} MiB",
                  flush=True)
            if name not in best or res["decode_tok_s"] > best[name]["decode_tok_s"]:
                best[name] = res
    batch: dict[str, float] = {}
    for r in range(args.rounds):
        for n in (8, 64):
            for name, quant in (("quantized", "auto"), ("dense", None)):
                res = child(sys.executable, KEEL_CHILD, {
                    "quantization": quant, "dtype": args.dtype, "messages": QUESTION,
                    "tokens": args.batch_tokens, "batch": n})
                key = f"{n} requests, {name}"
                batch[key] = max(batch.get(key, 0.0), res["tok_s"])
                print(f"round {r}: keel {key:24s} {res['tok_s']:7.1f} tok/s", flush=True)

    print(f"\n{cpu_model()}, {threads} cores, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}; default model ({Path(gguf).name}), dtype "
          f"{args.dtype}, prompt {len(ids)} tokens, {args.tokens} new tokens, greedy, best of "
          f"{args.rounds}")
    print(f"{'engine':24s} {'decode tok/s':>12s} {'TTFT ms':>8s} {'start-up s':>10s} "
          f"{'peak RSS MiB':>12s}")
    for name, res in best.items():
        print(f"{name:24s} {res['decode_tok_s']:12.1f} {res['ttft_s'] * 1e3:8.1f} "
              f"{res['startup_s']:10.2f} {res['peak_rss_mib']:12.0f}")
    if "llama.cpp" in best:
        for name in ("keel quantized (gguf)", "keel quantized, int8 act"):
            ratio = best[name]["decode_tok_s"] / best["llama.cpp"]["decode_tok_s"]
            print(f"{name} / llama.cpp (decode): {ratio:.2f}x")
    q, d = best["keel quantized (gguf)"]["tokens"], best["keel dequantized"]["tokens"]
    agree = next((i for i, (a, b) in enumerate(zip(q, d)) if a != b), len(q))
    print(f"greedy tokens: quantized and dequantized agree on the first {agree} of {len(q)}")
    for name in ("keel quantized (gguf)", "keel quantized, int8 act", "llama.cpp"):
        if name in best:
            print(f"{name} says: {best[name]['text']!r}")
    for n in (8, 64):
        qv, dv = batch[f"{n} requests, quantized"], batch[f"{n} requests, dense"]
        print(f"keel, {n} requests x {args.batch_tokens} tokens: quantized {qv:.1f} tok/s, "
              f"dense {dv:.1f} tok/s ({qv / dv:.2f}x)")


if __name__ == "__main__":
    main()
