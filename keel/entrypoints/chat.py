"""`keel chat`: a conversation in the terminal. Answers stream token by token through AsyncLLM
(the server's streaming path, not a second one); the conversation is kept between turns.
Ctrl-D or Ctrl-C ends it cleanly (Ctrl-C during an answer aborts that answer first)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any, TextIO

from keel.engine.async_llm import AsyncLLM
from keel.sampling_params import RequestOutputKind, SamplingParams


async def _answer(engine: AsyncLLM, messages: list[dict[str, str]], params: SamplingParams,
                  out: TextIO) -> str:
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = {"prompt_token_ids": tok.encode(text, add_special_tokens=False), "prompt": text}
    pieces = []
    async for output in engine.generate(prompt, params):
        delta = output.outputs[0].text
        pieces.append(delta)
        out.write(delta)
        out.flush()
    out.write("\n")
    return "".join(pieces)


def chat_loop(engine_args: Any, system: str | None = None, max_tokens: int = 512,
              temperature: float = 0.7, top_p: float = 0.9, out: TextIO = sys.stdout) -> None:
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template: use keel generate.")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                output_kind=RequestOutputKind.DELTA)
        messages = [{"role": "system", "content": system}] if system else []
        interactive = sys.stdin.isatty()
        if interactive:
            out.write("keel chat: Ctrl-D or Ctrl-C to quit.\n")
        while True:
            try:
                line = input(">>> " if interactive else "")
            except EOFError:
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = asyncio.run(_answer(engine, messages, params, out))
            messages.append({"role": "assistant", "content": reply})
    except KeyboardInterrupt:
        out.write("\n")
    finally:
        engine.shutdown()
