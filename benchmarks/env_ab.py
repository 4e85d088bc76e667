"""Two keel engines in one process, each loaded under its own environment variables, timed on
one of vs_vllm.py's workloads, alternating round by round (the order reversed every other
round), with new prompts each round. For a choice keel makes at load (e.g.
`KEEL_I16_ATTENTION=0`): the host's phases, which move a process's speed by 10-30% from one
minute to the next, then fall on both alike. Reports each engine's times, the best-time ratio
and how many greedy sequences are identical.

    .venv/bin/python benchmarks/env_ab.py --a KEEL_I16_ATTENTION=0 --b "" --workload long \\
        --max-tokens 1 --rounds 4       # the long workload's prompt phase
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_env(text: str) -> dict[str, str]:
    """'A=1 B=2' -> {'A': '1', 'B': '2'}; '' -> {}."""
    env = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        env[name] = value
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="", help="engine A's variables, 'NAME=VALUE ...'")
    ap.add_argument("--b", default="", help="engine B's variables")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workload", default="long", choices=["short", "long"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    logging.disable(logging.WARNING)

    from vs_vllm import kv_cache_gib, make_prompts

    from keel import LLM, SamplingParams
    from keel.config import resolve_model_path

    folder = str(resolve_model_path(None))
    engines = {}
    for name, text in (("A", args.a), ("B", args.b)):
        env = parse_env(text)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            engines[name] = LLM(model=folder, dtype=args.dtype,
                                kv_cache_memory_gib=kv_cache_gib(args.dtype))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {n: [] for n in engines}
    same = total = 0
    for r in range(args.rounds):
        prompts = [{"prompt_token_ids": p}
                   for p in make_prompts(args.workload, args.num_prompts, 49152, 0, r + 1)]
        tokens = {}
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts, sp, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        same += sum(a == b for a, b in zip(tokens["A"], tokens["B"]))
        total += len(prompts)
    print(f"{args.workload} workload, {args.num_prompts} prompts, {args.max_tokens} new tokens, "
          f"dtype={args.dtype}, {args.rounds} rounds")
    for name, text in (("A", args.a), ("B", args.b)):
        print(f"  {name} ({text or 'defaults'}): " + " ".join(f"{t:.2f}" for t in times[name])
              + f" s, best {min(times[name]):.2f} s")
    print(f"  B / A, best times: {min(times['B']) / min(times['A']):.3f}x; round by round: "
          + " ".join(f"{b / a:.3f}" for a, b in zip(times["A"], times["B"])))
    print(f"  identical greedy sequences: {same} of {total}")


if __name__ == "__main__":
    main()
