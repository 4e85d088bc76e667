"""Structured outputs with xgrammar.

A request's grammar is compiled in a thread pool when it is added (`grammar_init`); until it
is ready the request waits in WAITING_FOR_FSM and is not scheduled. Each step the scheduler
fills one bitmask row per constrained request from its `GrammarMatcher`
(`grammar_bitmask`), in the gap between `execute_model` and `sample_tokens` -- the reason the
seed splits those two calls -- and the runner masks the logits with it. After the step each
matcher accepts the request's new token.

xgrammar is imported only when a request asks for structured output, and the model's tokenizer
is read for it only then."""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from keel.request import Request, RequestStatus
from keel.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from keel.config import EngineConfig

logger = logging.getLogger(__name__)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - installed by make / scripts/install.sh
        raise ValueError("structured outputs need the xgrammar package: pip install --no-deps "
                         "xgrammar apache-tvm-ffi (as scripts/install.sh does).") from e
    return xgrammar


def grammar_source(params: StructuredOutputsParams) -> tuple[str, Any]:
    """(kind, source) to compile: 'json' with a schema, 'regex', or 'ebnf'. json_object is the
    schema {"type": "object"} and a choice is an EBNF alternation of its strings, as in vLLM."""
    if params.json is not None:
        return "json", params.json
    if params.json_object:
        return "json", {"type": "object"}
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        # JSON string escapes (\" \\ \n \uXXXX) are also EBNF string escapes.
        return "ebnf", "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
    return "ebnf", params.grammar


# Two places where xgrammar allows bytes that do not decode to the text the grammar describes:
# - a JSON string with minLength / maxLength repeats the class below, which lets raw control
#   characters (U+0000-U+001F) through, and JSON forbids them in strings;
# - every negated class (`[^"]`) and any-character (`.`, printed `[\0-\U0010ffff]`) accepts
#   UTF-8-encoded surrogates (ED A0..BF xx), which no decoder turns into text: each byte comes
#   out as U+FFFD, so a string grows longer than its maxLength and a regex no longer matches.
# keel compiles every grammar from EBNF text with both closed.
_LENGTH_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_ANY_CHAR = r"[\0-\U0010ffff]"
_SURROGATES = r"\ud800-\udfff"


def _close_utf8_holes(ebnf: str) -> str:
    """Add the surrogate range to every negated character class and turn any-character into
    "anything but a surrogate", outside string literals. E.g. `[^a-c]` -> `[^\ud800-\udfff
    a-c]`, `[\0-\U0010ffff]` -> `[^\ud800-\udfff]`."""
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c == '"':  # a string literal (or a Regex("...") macro's argument): copy as is
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i : j + 1])
            i = j + 1
        elif ebnf.startswith(_ANY_CHAR, i):
            out.append(f"[^{_SURROGATES}]")
            i += len(_ANY_CHAR)
        elif ebnf.startswith("[^", i):
            out.append("[^" + _SURROGATES)
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def json_schema_ebnf(schema: str | dict, any_whitespace: bool) -> str:
    """The schema's grammar as EBNF text, every string character a valid JSON one."""
    grammar = _xgrammar().Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    return _close_utf8_holes(str(grammar).replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))


def grammar_ebnf(params: StructuredOutputsParams) -> str:
    """The request's grammar as EBNF text, what keel compiles (see _close_utf8_holes). A regex
    is converted by xgrammar; a JSON schema's `pattern` stays a regex inside it."""
    xgr = _xgrammar()
    kind, source = grammar_source(params)
    if kind == "json":
        if isinstance(source, str):
            json.loads(source)  # a clearer message than the compiler's for broken JSON
        return json_schema_ebnf(source, any_whitespace=not params.disable_any_whitespace)
    if kind == "regex":
        return _close_utf8_holes(str(xgr.Grammar.from_regex(source)))
    xgr.Grammar.from_ebnf(source)  # the user's own text first: errors point into it
    return _close_utf8_holes(source)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Build the grammar (no tokenizer needed, milliseconds) so a bad one is refused when the
    request is added, with the compiler's message; compilation proper happens later."""
    xgr = _xgrammar()
    kind, _ = grammar_source(params)
    try:
        xgr.Grammar.from_ebnf(grammar_ebnf(params))
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError
        what = {"json": "JSON schema", "regex": "regex", "ebnf": "grammar"}[kind]
        # "[04:30:22] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> the message
        message = re.sub(r"^\[[^\]]*\]\s+\S+:\d+:\s*", "", str(e).strip()) or type(e).__name__
        raise ValueError(f"Invalid {what} in structured_outputs: {message}") from None


class StructuredOutputRequest:
    """One request's compiled grammar (a future until ready) and its matcher."""

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self.matcher: Any = None

    def ready(self) -> bool:
        """True once the grammar compiled (and the matcher exists); raises if it failed."""
        if self.matcher is None:
            if not self._compiled.done():
                return False
            self.matcher = _xgrammar().GrammarMatcher(self._compiled.result())
        return True

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(self, config: EngineConfig) -> None:
        self.model_config = config.model_config
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self._compiler: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._cache: dict[tuple, Future] = {}  # (kind, spec, whitespace) -> compiled grammar
        self._bitmask: torch.Tensor | None = None  # [max_num_reqs, ceil(vocab / 32)] int32

    def _init_compiler(self) -> None:
        """The tokenizer information xgrammar needs (which bytes each token decodes to), with
        the model's vocabulary size, which can exceed the tokenizer's."""
        from transformers import AutoTokenizer

        xgr = _xgrammar()
        tokenizer = AutoTokenizer.from_pretrained(str(self.model_config.model_path))
        vocab_size = self.model_config.vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        logger.info("Structured outputs: xgrammar with a %s vocabulary of %d tokens",
                    info.vocab_type.name.lower(), vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-grammar")
        self._bitmask = xgr.allocate_token_bitmask(self.max_num_reqs, vocab_size)

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits in WAITING_FOR_FSM until ready."""
        if self._compiler is None:
            self._init_compiler()
        params = request.sampling_params.structured_outputs
        key = (*params.key, params.disable_any_whitespace)
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
        request.structured_output_request = StructuredOutputRequest(future)
        request.status = RequestStatus.WAITING_FOR_FSM

    def _compile(self, params: StructuredOutputsParams):
        return self._compiler.compile_grammar(grammar_ebnf(params))

    def grammar_bitmask(self, requests: list[Request]) -> torch.Tensor:
        """[len(requests), ceil(vocab / 32)] int32, row i = what requests[i] may emit next.
        A view of a buffer made once; valid until the next call."""
        bitmask = self._bitmask
        for i, request in enumerate(requests):
            request.structured_output_request.matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask[: len(requests)]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
