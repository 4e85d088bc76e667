"""The OpenAI-compatible API's response bodies and stream chunks, and the conversion of keel's
logprob dicts into OpenAI's shapes. (The request models are in protocol.py.)"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, Field

from keel.entrypoints.openai.protocol import LOGPROB_FLOOR, UsageInfo, _now, random_uuid
from keel.outputs import Logprob

# ---- responses --------------------------------------------------------------------------------


class CompletionLogProbs(BaseModel):
    # One entry per token; None where a token has no logprob (an echoed prompt's first token).
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None  # only on the last chunk, with include_usage


class ChatLogProbTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatLogProbContent(ChatLogProbTop):
    top_logprobs: list[ChatLogProbTop] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbContent] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None  # only on the last chunk, with include_usage


# ---- logprobs: keel's per-position dicts -> OpenAI's shapes -----------------------------------


def _token_text(token_id: int, entry: Logprob | None, tokenizer: Any) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _most_likely_first(entries: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """By vocabulary rank where known, else by logprob. Rank, not logprob, decides ties: the
    sampled token (first in the dict) can tie the k-th top token without being in the top k."""
    return sorted(entries.items(),
                  key=lambda kv: (math.inf if kv[1].rank is None else kv[1].rank, -kv[1].logprob))


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                        tokenizer: Any, initial_text_offset: int) -> CompletionLogProbs:
    """/v1/completions logprobs for these tokens. Each position's dict holds the sampled token
    and the top-k; top_logprobs is all of it as {text: logprob}, most likely first (so k or k+1
    entries). A None position (an echoed prompt's first token) gets None logprobs.
    E.g. texts ["Hel", "lo", "!"] at initial_text_offset 5 -> text_offset [5, 8, 10]."""
    out = CompletionLogProbs()
    offset = initial_text_offset
    for token_id, entries in zip(token_ids, logprobs, strict=True):
        sampled = None if entries is None else entries.get(token_id)
        assert entries is None or sampled is not None, f"token {token_id} missing its logprob"
        text = _token_text(token_id, sampled, tokenizer)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        out.token_logprobs.append(None if sampled is None else _floor(sampled.logprob))
        if entries is None:
            out.top_logprobs.append(None)
            continue
        top: dict[str, float] = {}
        for tid, entry in _most_likely_first(entries):
            # Two ids can share a text; the more likely one keeps it.
            top.setdefault(_token_text(tid, entry, tokenizer), _floor(entry.logprob))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], tokenizer: Any,
                  top_logprobs: int) -> ChatLogProbs:
    """/v1/chat/completions logprobs: per token its text, logprob and bytes, with the
    `top_logprobs` most likely tokens (the sampled one among them only if it ranks there)."""
    content = []
    for token_id, entries in zip(token_ids, logprobs, strict=True):
        sampled = entries.get(token_id)
        assert sampled is not None, f"token {token_id} missing its logprob"
        top = []
        for tid, entry in _most_likely_first(entries)[:max(top_logprobs, 0)]:
            text = _token_text(tid, entry, tokenizer)
            top.append(ChatLogProbTop(token=text, logprob=_floor(entry.logprob),
                                      bytes=list(text.encode("utf-8"))))
        text = _token_text(token_id, sampled, tokenizer)
        content.append(ChatLogProbContent(token=text, logprob=_floor(sampled.logprob),
                                          bytes=list(text.encode("utf-8")), top_logprobs=top))
    return ChatLogProbs(content=content)


# ---- embeddings -------------------------------------------------------------------------------


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    # The floats, or (encoding_format "base64") their little-endian float32 bytes in base64.
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_embedding(vector: Any, encoding_format: str) -> list[float] | str:
    """A pooled vector (a tensor) as the response carries it: a list of floats, or base64 of
    its little-endian float32 bytes (what the openai client decodes with numpy.frombuffer)."""
    import base64

    import torch

    vector = vector.detach().to(torch.float32).cpu()
    if encoding_format == "float":
        return vector.tolist()
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
