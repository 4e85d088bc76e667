"""SamplingParams: how one request is decoded, with vLLM's fields, defaults and meanings.

Values are checked at construction (a ValueError that names the field and its allowed range);
what needs the model (token ids inside the vocabulary, `logprobs` against the engine's
`max_logprobs`, bad words as token ids) is checked when the request is added, so a bad value is
an error for that request alone."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output, with vLLM's meanings. Exactly one of:
    json (a JSON schema, dict or string), json_object (any JSON object), regex, choice (one of
    these strings), grammar (EBNF / GBNF). Whether the grammar compiles is checked when the
    request is added (it needs the model's tokenizer).

    keel's default differs from vLLM's in one place: no free whitespace between JSON tokens
    (`disable_any_whitespace=True`), so a model cannot run out of tokens in whitespace the
    grammar allows; pass False to allow it."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice or "
                f"grammar; got {', '.join(given) if given else 'none'}."
            )
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r}.")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict or a "
                             f"string), got {type(self.json).__name__}.")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): what a compiled grammar is cached by."""
        import json as json_mod

        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json_mod.dumps(self.json,
                                                                               sort_keys=True)
            return "json", spec
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json_mod.dumps(self.choice)
        return "grammar", self.grammar


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (plus the prompt's)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    # Filled when the request is added (InputProcessor), from the tokenizer and the model.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict "
                             f"of its fields), got {type(self.structured_outputs).__name__}.")
        self._verify()
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def check(name: str, value, rng: str, ok, integer: bool = False) -> None:
            """value must be a finite number (an int when `integer`) for which ok(value)."""
            kinds = (int,) if integer else (int, float)
            valid = (isinstance(value, kinds) and not isinstance(value, bool)
                     and math.isfinite(value) and ok(value))
            if not valid:
                kind = "an integer" if integer else "a number"
                raise ValueError(f"{name} must be {kind} {rng}, got {value!r}.")

        check("n", self.n, ">= 1", lambda v: v >= 1, integer=True)
        check("presence_penalty", self.presence_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        check("frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        check("repetition_penalty", self.repetition_penalty, "> 0", lambda v: v > 0)
        check("temperature", self.temperature, ">= 0", lambda v: v >= 0)
        check("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        check("top_k", self.top_k, ">= 1, or 0 / -1 (disabled)", lambda v: v >= 0, integer=True)
        check("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            check("seed", self.seed, "(or None)", lambda v: True, integer=True)
        if self.max_tokens is not None:
            check("max_tokens", self.max_tokens, ">= 1 (or None)", lambda v: v >= 1,
                  integer=True)
        check("min_tokens", self.min_tokens, ">= 0", lambda v: v >= 0, integer=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got "
                             f"{self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check(name, getattr(self, name), ">= 0 (or None)", lambda v: v >= 0,
                      integer=True)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True: pass detokenize=True, or "
                             "use stop_token_ids.")
        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name) or []:
                check(f"each of {name}", t, ">= 0", lambda v: v >= 0, integer=True)
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_outputs: the "
                             "grammar decides where the output ends; pass min_tokens=0.")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty: pass None to allow every "
                             "token.")
        for tok, bias in (self.logit_bias or {}).items():
            check(f"logit_bias[{tok}]", bias, "(finite)", lambda v: True)
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must hold non-empty strings, got {w!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus the model's EOS (unless ignore_eos), set when the request is
        added: what `min_tokens` masks."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self) -> SamplingParams:
        """A copy that can be changed (filled per request) without touching the caller's."""
        new = copy.copy(self)
        new._all_stop_token_ids = set(self._all_stop_token_ids)
        new._bad_words_token_ids = list(self._bad_words_token_ids)
        return new
