"""Offline throughput: keel `LLM.generate` vs Hugging Face transformers `generate`.

Same model folder, same prompt token ids, greedy, a fixed number of new tokens per prompt (EOS
does not stop either engine). Each side is warmed up, then only its generate call(s) are timed
(wall clock). Prints the hardware, the model, the workload, output tokens/s for each, the ratio
keel/transformers, and how many greedy sequences are identical.

    .venv/bin/python benchmarks/throughput.py                       # default model, 64 x 128
    .venv/bin/python benchmarks/throughput.py --random-llama --dtype bfloat16
    .venv/bin/python benchmarks/throughput.py --num-prompts 4 --max-tokens 8   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# OpenMP's default (spinning) wait policy: one process runs here, as a user's would. Run
# nothing else heavy at the same time.
import torch
import transformers

from keel import SamplingParams
from keel.config import resolve_model_path
from keel.engine.llm import LLM
from keel.utils import cpu_model

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, two astronauts walked on the Moon while a third orbited above them.",
    "A persistent batch keeps each request's tokens in place from one step to the next.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "The recipe calls for two cups of flour, one egg, and a pinch of salt.",
    "Rivers carry sediment from the mountains down to the sea over thousands of years.",
    "She opened the old wooden door and found a room full of forgotten books.",
    "Photosynthesis turns sunlight, water, and carbon dioxide into sugar and oxygen.",
    "The committee will meet again next Tuesday to review the budget proposal.",
    "Prime numbers have exactly two divisors: one and the number itself.",
    "Once upon a time, a small robot wanted to learn how to paint the sky.",
    "The train to the coast leaves at seven and arrives shortly before noon.",
    "Good software is written for the next person who has to read it.",
    "Whales communicate with songs that can travel hundreds of kilometres underwater.",
    "The museum's new exhibit explores the history of printing and paper.",
    "After the storm, the village gathered to repair the bridge over the river.",
]
# Shape of --random-llama (make_hf_model's "llama" is tiny; this one does real matmuls).
RANDOM_LLAMA = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1408}
RANDOM_LLAMA_VOCAB = 49152  # the default model's tokenizer


def prompt_texts(n: int) -> list[str]:
    """Deterministic prompts of 1..8 sentences (lengths vary by ~8x)."""
    k = len(SENTENCES)
    return [" ".join(SENTENCES[(5 * i + j) % k] for j in range(1 + (7 * i) % 8)) for i in range(n)]


def build_random_llama(folder: Path) -> Path:
    """make_hf_model("llama") with RANDOM_LLAMA's shape and the default model's vocabulary and
    tokenizer, so both models see the same prompts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests/
    from tests import hf_models

    folder = hf_models.make_hf_model(
        "llama", folder, vocab_size=RANDOM_LLAMA_VOCAB, **RANDOM_LLAMA
    )
    default = resolve_model_path(None)
    for f in default.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    return folder


class KeelSide:
    """keel, loaded once; `run()` times one LLM.generate over all prompts."""

    def __init__(self, folder: Path, args, prompts: list[list[int]]) -> None:
        self.llm = LLM(model=str(folder), dtype=args.dtype, threads=args.threads)
        self.sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        self.reqs = [{"prompt_token_ids": p} for p in prompts]
        self.llm.generate(self.reqs[:4], SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True), use_tqdm=False)

    def run(self) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = self.llm.generate(self.reqs, self.sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def hf_generate(model, prompts: list[list[int]], batch_size: int, max_tokens: int,
                pad_id: int) -> tuple[float, list[list[int]]]:
    """Greedy, left-padded batches of prompts of similar length (sorted, so padding is small);
    returns (seconds inside generate, new tokens per prompt in the original order)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    elapsed = 0.0
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)  # [batch, width]
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        t0 = time.perf_counter()
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=pad_id)
        elapsed += time.perf_counter() - t0
        for row, i in enumerate(idx):
            out[i] = gen[row, width:].tolist()
    return elapsed, out


class HFSide:
    """transformers, loaded once, at its fastest batch size; `run()` times one pass."""

    def __init__(self, folder: Path, args, prompts: list[list[int]], pad_id: int) -> None:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype).eval()
        # Like keel's ignore_eos: EOS neither stops nor is masked. (min_new_tokens would mask
        # EOS logits, changing the greedy path whenever EOS is the argmax.)
        self.model.generation_config.eos_token_id = None
        self.prompts, self.pad_id, self.max_tokens = prompts, pad_id, args.max_tokens
        n = len(prompts)
        hf_generate(self.model, prompts[:4], 4, 8, pad_id)  # warm-up
        self.probes: dict[int, float] = {}
        if args.hf_batch_size == "auto":
            # Short probe on the whole prompt set at each candidate size; keep the fastest.
            probe_tokens = min(args.max_tokens, 32)
            for bs in sorted({n, min(n, 32), min(n, 16)}, reverse=True):
                t, _ = hf_generate(self.model, prompts, bs, probe_tokens, pad_id)
                self.probes[bs] = n * probe_tokens / t
            self.batch_size = max(self.probes, key=self.probes.get)
        else:
            self.batch_size = min(int(args.hf_batch_size), n)
        self.attn = getattr(self.model.config, "_attn_implementation", "?")

    def run(self) -> tuple[float, list[list[int]]]:
        return hf_generate(self.model, self.prompts, self.batch_size, self.max_tokens,
                           self.pad_id)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(identical sequences, mean fraction of each sequence before the first difference)."""
    same, prefix = 0, 0.0
    for x, y in zip(a, b):
        same += x == y
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix += k / max(len(x), 1)
    return same, prefix / len(a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf (default: keel's default model)")
    p.add_argument("--random-llama", action="store_true",
                   help="a random Llama (hidden 512, 8 layers, the default model's vocabulary) built in a temp dir")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--hf-batch-size", default="auto",
                   help="transformers batch size, or 'auto': probe all/32/16 and keep the best")
    p.add_argument("--rounds", type=int, default=3,
                   help="keel and transformers alternate this many times; the ratio is the "
                        "median of the per-round ratios (this machine's speed drifts)")
    p.add_argument("--json", metavar="PATH", help="append a JSON record of the result to PATH")
    args = p.parse_args()
    if args.random_llama and args.model:
        p.error("pass --model or --random-llama, not both")
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="keel-bench-") as tmp:
        if args.random_llama:
            folder = build_random_llama(Path(tmp))
            shape = ", ".join(f"{k}={v}" for k, v in RANDOM_LLAMA.items())
            model_name = f"random Llama ({shape}, vocab_size={RANDOM_LLAMA_VOCAB})"
        else:
            folder = resolve_model_path(args.model)
            if args.model is None:
                from keel.model_executor.default_model import DEFAULT_MODEL_NAME
                model_name = DEFAULT_MODEL_NAME
            else:
                model_name = args.model
        tok = transformers.AutoTokenizer.from_pretrained(str(folder))
        max_pos = transformers.AutoConfig.from_pretrained(str(folder)).max_position_embeddings
        limit = max_pos - args.max_tokens  # keel: prompt + max_tokens <= max_model_len
        if limit < 1:
            p.error(f"--max-tokens {args.max_tokens} leaves no room for a prompt "
                    f"(max_position_embeddings={max_pos})")
        prompts = [tok(t).input_ids[:limit] for t in prompt_texts(args.num_prompts)]
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

        keel, hf = KeelSide(folder, args, prompts), HFSide(folder, args, prompts, pad_id)
        keel_times, hf_times = [], []
        for _ in range(args.rounds):  # alternate, so drift hits both sides alike
            keel_s, keel_tokens = keel.run()
            hf_s, hf_tokens = hf.run()
            keel_times.append(keel_s)
            hf_times.append(hf_s)
        hf_bs, probes, attn = hf.batch_size, hf.probes, hf.attn

    n_out = args.num_prompts * args.max_tokens
    assert all(len(t) == args.max_tokens for t in keel_tokens), "keel stopped early"
    assert all(len(t) == args.max_tokens for t in hf_tokens), "transformers stopped early"
    ratios = sorted(h / k for k, h in zip(keel_times, hf_times))
    ratio = statistics.median(ratios)
    keel_s, hf_s = statistics.median(keel_times), statistics.median(hf_times)
    keel_tps, hf_tps = n_out / keel_s, n_out / hf_s
    same, prefix = agreement(keel_tokens, hf_tokens)
    lens = [len(x) for x in prompts]
    cores = len(os.sched_getaffinity(0))
    probe_txt = ", ".join(f"{bs}: {tps:.1f} tok/s" for bs, tps in probes.items())

    print(f"hardware:     {cpu_model()}, {cores} cores available ({os.cpu_count()} online), "
          f"{args.threads} torch threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(f"software:     torch {torch.__version__}, transformers {transformers.__version__}, "
          f"python {platform.python_version()}")
    print(f"model:        {model_name}  [{folder if not args.random_llama else 'temp dir'}]")
    print(f"dtype:        {args.dtype}")
    print(f"workload:     {args.num_prompts} prompts of {min(lens)}-{max(lens)} tokens "
          f"({sum(lens)} total), {args.max_tokens} new tokens each, greedy, EOS ignored")
    print(f"keel:         {keel_tps:9.1f} output tok/s  (median of {args.rounds}: {keel_s:.2f} s, "
          "LLM.generate, all prompts submitted at once, default max_num_seqs/"
          "max_num_batched_tokens)")
    print(f"transformers: {hf_tps:9.1f} output tok/s  (median of {args.rounds}: {hf_s:.2f} s, "
          f"generate, batch size {hf_bs}, left padding, prompts sorted by length, attn={attn})")
    if probes:
        print(f"              batch size chosen by a {min(args.max_tokens, 32)}-token probe: "
              f"{probe_txt}")
    print(f"ratio:        keel / transformers = {ratio:.2f}x  (median of the rounds' ratios: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"agreement:    {same}/{args.num_prompts} greedy sequences identical "
          f"({100 * same / args.num_prompts:.1f}%); mean common prefix {100 * prefix:.1f}%")

    if args.json:
        record = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "benchmark": "throughput",
            "cpu": cpu_model(), "cores": cores, "threads": args.threads,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "model": model_name, "dtype": args.dtype, "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens, "prompt_tokens": sum(lens),
            "keel_tok_s": keel_tps, "hf_tok_s": hf_tps, "hf_batch_size": hf_bs,
            "hf_probe_tok_s": probes, "ratio": ratio, "round_ratios": ratios,
            "identical": same, "mean_common_prefix": prefix,
        }
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
