"""The OpenAI-compatible HTTP API as pydantic models: request bodies that check themselves and
turn into SamplingParams, and the response bodies and stream chunks the server sends back.

Requests take OpenAI's types strictly (the string "0.5" is not a number, 2.0 is not an integer)
and ignore fields they do not know, so a client that sends OpenAI-only extras still works."""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from keel.outputs import Logprob
from keel.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_N = 128  # OpenAI's limit on choices per request
MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs per token
LOGPROB_FLOOR = -9999.0  # what -inf is sent as: JSON has no infinities


def random_uuid() -> str:
    return uuid.uuid4().hex


def _now() -> int:
    return int(time.time())


# ---- errors and models ------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str  # e.g. "BadRequestError"
    param: str | None = None  # the request field at fault, when there is one
    code: int  # the HTTP status


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "keel"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# ---- requests ---------------------------------------------------------------------------------


class _RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_RequestModel):
    include_usage: bool = False


class JsonSchemaResponseFormat(_RequestModel):
    # `schema` would shadow BaseModel.schema; the wire name stays "schema" both ways.
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # keel always enforces the schema


class ResponseFormat(_RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError('response_format of type "json_schema" needs json_schema.schema: '
                             "pass the JSON schema there, or use type \"json_object\".")
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


TokenId = Annotated[int, Field(ge=0)]


class SamplingRequest(_RequestModel):
    """The fields (and checks) that completions and chat completions share."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    # int64, so that torch.Generator takes seed + index for each of n choices.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    user: str | None = None
    response_format: ResponseFormat | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None,
                                    info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true: drop it, or "
                             "pass stream=true.")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if any(not s for s in ([v] if isinstance(v, str) else v or [])):
            raise ValueError("stop strings must be non-empty.")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (strings such as \"50256\"), "
                                 f"got {key!r}.")
        return v

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> SamplingRequest:
        max_tokens = self._max_tokens()
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({max_tokens}).")
        if self.min_tokens and self._structured_outputs() is not None:
            raise ValueError("min_tokens cannot be combined with a JSON response_format: the "
                             "schema decides where the output ends; pass min_tokens=0.")
        return self

    def _max_tokens(self) -> int | None:
        """The request's own limit on new tokens (None: the server's default)."""
        return None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        return None if self.response_format is None else self.response_format.structured_outputs()

    def _sampling_params(self, default_max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Unset fields take OpenAI's defaults. Raises ValueError for what only the server's
        default shows (e.g. min_tokens above default_max_tokens)."""
        max_tokens = self._max_tokens()
        return SamplingParams(
            n=self.n,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=_or(self.min_p, 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self._structured_outputs(),
        )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


class CompletionRequest(SamplingRequest):
    # A prompt, a batch of prompts, a prompt's token ids, or a batch of those.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(default=16, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: str | list) -> str | list:
        # E.g. "" -> [""], [1, 2] -> [[1, 2]], ["a", ""] -> as is: every prompt needs a token.
        prompts = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else v
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompt must not be empty (nor hold an empty prompt).")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")
        if v is not None and n is not None and v != n:
            raise ValueError(f"best_of ({v}) must equal n ({n}): keel returns every sampled "
                             "choice; drop best_of.")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("suffix is not supported: drop it.")
        return v

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        # echo with logprobs also scores the prompt, which the server puts before the output.
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(default_max_tokens, self.logprobs, prompt_logprobs)


class ChatContentPart(_RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(_RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else []:
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError("only text content parts are supported, got a part of type "
                                 f"{part.get('type')!r}.")
        return v

    def text(self) -> str:
        """The message's text, its parts joined by newlines."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated by OpenAI
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs", True):
            raise ValueError("top_logprobs is only allowed when logprobs is true: pass "
                             "logprobs=true, or drop top_logprobs.")
        return v

    def _max_tokens(self) -> int | None:
        return _or(self.max_completion_tokens, self.max_tokens)

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        logprobs = _or(self.top_logprobs, 0) if self.logprobs else None
        return self._sampling_params(default_max_tokens, logprobs)


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
