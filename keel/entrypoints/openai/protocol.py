"""The OpenAI-compatible HTTP API as pydantic models: request bodies that check themselves and
turn into SamplingParams (or, for /v1/embeddings, engine prompts), plus the error, model-list
and usage bodies. (The other response bodies are in responses.py.)

Requests take OpenAI's types strictly (the string "0.5" is not a number, 2.0 is not an integer)
and ignore fields they do not know, so a client that sends OpenAI-only extras still works."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from keel.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_N = 128  # OpenAI's limit on choices per request
MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs per token
LOGPROB_FLOOR = -9999.0  # what -inf is sent as: JSON has no infinities
INT64_MAX = 2**63 - 1  # the engine keeps top_k, min_tokens and seeds in int64 arrays


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
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    # int64, so that torch.Generator takes seed + index for each of n choices.
    seed: int | None = Field(default=None, ge=-(2**63), le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
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


class EmbeddingRequest(_RequestModel):
    """/v1/embeddings: OpenAI's fields plus vLLM's truncate_prompt_tokens. `user` is accepted
    and ignored; `dimensions` must be the model's own size (checked by the engine)."""

    model: str | None = None
    # A text, a batch of texts, a text's token ids, or a batch of those.
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # keep this many tokens; -1: max_model_len

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v: str | list) -> str | list:
        inputs = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else v
        if not inputs or any(len(x) == 0 for x in inputs):
            raise ValueError("input must not be empty (nor hold an empty text or token list).")
        return v

    def prompts(self) -> list[str | dict]:
        """The inputs as engine prompts, in order."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if isinstance(x[0], int):
            return [{"prompt_token_ids": x}]
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in x]
