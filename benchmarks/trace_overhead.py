"""What tracing costs: keel's throughput with tracing off (this checkout, and a baseline
checkout from before the recorder existed) and with tracing on, on the same prompts.

Each variant runs in its own child process (one engine per process: two OpenMP pools in one
process slow each other down), alternating, best of --rounds. Prints output tokens/s and the
ratios; greedy outputs must be identical across variants.

    git worktree add /tmp/keel-baseline 70e574e   # the commit before keel/trace/
    .venv/bin/python benchmarks/trace_overhead.py --baseline-src /tmp/keel-baseline
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from keel import LLM, SamplingParams
sys.path.insert(0, {bench!r})
from throughput import prompt_texts
args = json.loads(sys.argv[1])
kw = {{"trace_path": args["trace"]}} if args["trace"] else {{}}
llm = LLM(model=None, dtype=args["dtype"], **kw)
prompts = [{{"prompt_token_ids": llm.tokenizer.encode(t)}}
           for t in prompt_texts(args["num_prompts"])]
sp = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
             use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate(prompts, sp, use_tqdm=False)
dt = time.perf_counter() - t0
print(json.dumps({{"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt,
                   "tokens": [list(o.outputs[0].token_ids) for o in outs]}}))
"""


def run_child(src: Path, args: argparse.Namespace, trace: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    code = CHILD.format(bench=str(HERE / "benchmarks"))
    payload = json.dumps({"dtype": args.dtype, "num_prompts": args.num_prompts,
                          "max_tokens": args.max_tokens, "trace": trace})
    out = subprocess.run([sys.executable, "-c", code, payload], env=env, check=True,
                         capture_output=True, text=True, cwd=src)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-src", type=Path, required=True,
                   help="a checkout of keel from before keel/trace/ (git worktree)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    from keel.utils import cpu_model

    tmp = Path(tempfile.mkdtemp())
    variants = {"baseline (no recorder)": (args.baseline_src, None),
                "tracing off": (HERE, None),
                "tracing on": (HERE, str(tmp / "trace.jsonl"))}
    best: dict[str, float] = {}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for name, (src, trace) in variants.items():
            res = run_child(src, args, trace)
            best[name] = max(best.get(name, 0.0), res["tok_s"])
            tokens[name] = res["tokens"]
            print(f"round {r}: {name:24s} {res['tok_s']:8.1f} tok/s", flush=True)
    print(f"\n{cpu_model()}, {os.cpu_count()} cores, {platform.python_version()}; default model, "
          f"{args.dtype}, {args.num_prompts} prompts x {args.max_tokens} tokens, greedy, "
          f"best of {args.rounds}, {time.strftime('%Y-%m-%d')}")
    base = best["baseline (no recorder)"]
    for name, v in best.items():
        print(f"  {name:24s} {v:8.1f} tok/s   {v / base:5.3f}x baseline")
    same = all(t == tokens["baseline (no recorder)"] for t in tokens.values())
    size = (tmp / "trace.jsonl").stat().st_size
    print(f"  outputs identical across variants: {same}; trace file {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
