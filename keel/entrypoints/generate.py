"""`keel generate`: greedy completions with the model driven directly through the paged cache."""

from __future__ import annotations

import argparse

import torch

from keel.config import ModelConfig
from keel.model_executor.direct import DirectRunner
from keel.model_executor.loader import load_model
from keel.utils import configure_threads


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
    return tokenizer.encode(prompt)


def run_generate(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    configure_threads(args.threads)
    cfg = ModelConfig(args.model, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model_path))
    model = load_model(cfg)
    prompts = [encode_prompt(tokenizer, p, args.chat) for p in args.prompts]
    max_len = max(len(p) for p in prompts) + args.max_tokens
    if max_len > cfg.max_model_len:
        raise ValueError(f"prompt + max_tokens = {max_len} exceeds max_model_len {cfg.max_model_len}")
    runner = DirectRunner(model, len(prompts), max_len)
    outputs = runner.greedy(prompts, args.max_tokens)
    eos = tokenizer.eos_token_id
    for prompt, out in zip(args.prompts, outputs):
        if eos in out:
            out = out[: out.index(eos)]
        print(f"{prompt!r} -> {tokenizer.decode(out, skip_special_tokens=True)!r}")
