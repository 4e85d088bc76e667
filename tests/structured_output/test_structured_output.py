"""Structured outputs through the whole engine, with a small random-weight model (the worst
case: it wants nothing the grammar allows) at temperature 1 and many seeds. xgrammar decides
what a grammar allows; jsonschema, re.fullmatch and a small parser check what came out."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import ClassVar

import jsonschema
import pytest

from keel import LLM, SamplingParams
from keel.executor.uniproc import UniProcExecutor
from keel.sampling_params import StructuredOutputsParams
from tests.model_executor.test_models import random_prompt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "id", "age", "role", "tags", "address"],
}

# Arithmetic over small integers (at most three terms of at most two factors, so a random
# model reaches the end); check_arith() below is its parser.
ARITH = """
root ::= expr
expr ::= term (("+" | "-") term){0, 2}
term ::= factor (("*" | "/") factor)?
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""


def check_arith(text: str) -> bool:
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while pos < len(text) and text[pos] in "*/":
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        m = re.match(r"[1-9][0-9]?", text[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    return expr() and pos == len(text)


def constrained(seed: int, max_tokens: int = 400, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    return LLM(hf_model_dir("llama"), dtype="float32")


def texts(outputs) -> list[str]:
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), \
        [(o.outputs[0].finish_reason, o.outputs[0].text) for o in outputs]
    return [o.outputs[0].text for o in outputs]


def test_json_schema_outputs_parse_and_validate(llm):
    seeds = range(24)
    outs = llm.generate([{"prompt_token_ids": random_prompt(6 + s % 5, seed=s)} for s in seeds],
                        [constrained(s, json=SCHEMA) for s in seeds], use_tqdm=False)
    for text in texts(outs):
        jsonschema.validate(json.loads(text), SCHEMA)  # raw control characters would not parse
    assert len(set(texts(outs))) > 20  # really sampled


def test_json_object_regex_choice_and_grammar(llm):
    prompts = [{"prompt_token_ids": random_prompt(8, seed=s)} for s in range(12)]
    # Any JSON object: keys and strings have no length bound, and a random model inside a
    # string picks the closing quote about 1 time in 200, so one may run out of tokens; every
    # object that finished is valid JSON.
    outs = llm.generate(prompts, [constrained(s, max_tokens=None, json_object=True)
                                  for s in range(12)], use_tqdm=False)
    finished = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 9
    assert all(isinstance(json.loads(text), dict) for text in finished)
    pattern = r"(cat|dog)-[0-9]{2,4}(\.[a-f]+)?"
    for text in texts(llm.generate(prompts, [constrained(s, regex=pattern) for s in range(12)],
                                   use_tqdm=False)):
        assert re.fullmatch(pattern, text), text
    choices = ["yes", "no", "maybe \"so\"", "日本"]
    got = texts(llm.generate(prompts, [constrained(s, choice=choices) for s in range(12)],
                             use_tqdm=False))
    assert set(got) <= set(choices) and len(set(got)) > 1
    for text in texts(llm.generate(prompts, [constrained(s, grammar=ARITH) for s in range(12)],
                                   use_tqdm=False)):
        assert check_arith(text), text


def test_disable_any_whitespace_is_the_default(llm):
    spec = dict(json={"type": "object", "properties": {"a": {"type": "integer"}},
                      "required": ["a"]})
    outs = llm.generate([{"prompt_token_ids": [5, 6]}] * 8,
                        [constrained(s, **spec) for s in range(8)], use_tqdm=False)
    for text in texts(outs):
        assert re.fullmatch(r'\{"a": -?[0-9]+\}', text), text  # no free whitespace anywhere


@pytest.mark.parametrize("spec, message", [
    (dict(regex="[a-"), r"Invalid regex in structured_outputs: Regex parsing error .*Unclosed"),
    (dict(json={"type": "strange"}), r"Invalid JSON schema .*Unsupported type \"strange\""),
    (dict(json='{"type": '), r"Invalid JSON schema in structured_outputs: Expecting value"),
    (dict(grammar='root ::= "a'), r"Invalid grammar in structured_outputs: EBNF lexer error"),
    (dict(grammar='rule ::= "a"'), r"Invalid grammar .*root rule"),
])
def test_invalid_spec_fails_that_request_alone(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_token_ids": [5, 6]}, constrained(0, **spec), use_tqdm=False)
    assert not llm.engine_core.scheduler.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [5, 6]}, constrained(1, regex="[0-9]{3}"),
                       use_tqdm=False)
    assert re.fullmatch("[0-9]{3}", texts(out)[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of json, json_object, regex, choice or grammar; got none"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(json=3), "must be a JSON schema"),
])
def test_structured_outputs_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_mixed_batch_with_chunking_and_churn(hf_model_dir, monkeypatch):
    """Constrained and free requests share a batch whose prompts are prefilled in chunks and
    whose requests finish at different times, so condense moves constrained rows: every
    constrained output is valid, and the free requests' greedy outputs are exactly those of a
    run without the constrained ones."""
    from keel.worker.model_runner import ModelRunner

    folder = hf_model_dir("llama")
    free_prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (9, 40, 23, 57, 14)]
    free_params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                   for m in (5, 30, 12, 20, 8)]
    alone = LLM(folder, dtype="float32", max_num_batched_tokens=32)
    expected = [o.outputs[0].token_ids for o in alone.generate(free_prompts, free_params,
                                                               use_tqdm=False)]

    rows_seen: dict[str, set[int]] = {}
    real_apply = ModelRunner._apply_grammar_bitmask

    def record(self, logits, grammar_output):
        for req_id in grammar_output.structured_output_request_ids:
            rows_seen.setdefault(req_id, set()).add(self.input_batch.req_id_to_index[req_id])
        return real_apply(self, logits, grammar_output)

    monkeypatch.setattr(ModelRunner, "_apply_grammar_bitmask", record)
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=32)
    con_prompts = [{"prompt_token_ids": random_prompt(n, seed=100 + n)} for n in (35, 6, 18)]
    con_params = [constrained(1, json=SCHEMA), constrained(2, regex=r"[a-z]{3,9}"),
                  constrained(3, grammar=ARITH)]
    prompts = [p for pair in zip(free_prompts, con_prompts) for p in pair] + free_prompts[3:]
    params = [p for pair in zip(free_params, con_params) for p in pair] + free_params[3:]
    outs = llm.generate(prompts, params, use_tqdm=False)
    free = [outs[i] for i in (0, 2, 4, 6, 7)]
    con = [outs[i] for i in (1, 3, 5)]
    assert [o.outputs[0].token_ids for o in free] == expected
    json_text, word, expr = texts(con)
    jsonschema.validate(json.loads(json_text), SCHEMA)
    assert re.fullmatch(r"[a-z]{3,9}", word) and check_arith(expr)
    assert any(len(rows) > 1 for rows in rows_seen.values()), rows_seen  # a row moved


class _ThreadedExecutor(UniProcExecutor):
    """Runs execute_model in a background thread (as a GPU or a worker process would run the
    forward pass) and records when things happen. The forward pass waits, up to 10 s, for
    the bitmask to be built, so the test fails by timing out if the engine asks for the
    bitmask only after the forward pass."""

    events: ClassVar[list[str]] = []
    bitmask_built = threading.Event()

    def execute_model(self, scheduler_output, non_block=False):
        from concurrent.futures import ThreadPoolExecutor

        type(self).bitmask_built.clear()

        def forward():
            self.events.append("forward:start")
            waited = type(self).bitmask_built.wait(timeout=10)
            result = super(_ThreadedExecutor, self).execute_model(scheduler_output)
            self.events.append("forward:end" if waited else "forward:end (timed out)")
            return result

        pool = ThreadPoolExecutor(max_workers=1)
        future = pool.submit(forward)
        pool.shutdown(wait=False)
        return future if non_block else future.result()

    def sample_tokens(self, grammar_output, non_block=False):
        self.events.append("sample_tokens:" + ("grammar" if grammar_output else "none"))
        return super().sample_tokens(grammar_output, non_block)


def test_bitmask_is_built_while_the_forward_pass_runs(hf_model_dir):
    llm = LLM(hf_model_dir("llama"), dtype="float32", distributed_executor_backend=_ThreadedExecutor)
    scheduler = llm.engine_core.scheduler
    real = scheduler.get_grammar_bitmask

    def recorded(scheduler_output):
        _ThreadedExecutor.events.append("bitmask:start")
        out = real(scheduler_output)
        _ThreadedExecutor.events.append("bitmask:end")
        _ThreadedExecutor.bitmask_built.set()
        return out

    scheduler.get_grammar_bitmask = recorded
    _ThreadedExecutor.events.clear()
    t0 = time.monotonic()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, constrained(0, regex="[0-9]{4}"),
                       use_tqdm=False)
    assert re.fullmatch("[0-9]{4}", texts(out)[0])
    assert time.monotonic() - t0 < 10
    events = _ThreadedExecutor.events
    assert "forward:end (timed out)" not in events
    # Every step's bitmask is built before that step's forward pass ends (the forward pass
    # waited for it, and did not time out); then the second call gets it. One sampled token
    # per step: 4 digits and EOS. (A first step may schedule nothing while the grammar
    # compiles.)
    previous_end = -1
    for i, event in enumerate(events):
        if event.startswith("forward:end"):
            assert "bitmask:end" in events[previous_end + 1 : i]
            previous_end = i
    assert events.count("sample_tokens:grammar") == 5
    assert all(events[i - 1] == "forward:end"
               for i, e in enumerate(events) if e.startswith("sample_tokens"))


def _byte_token_ids(tok) -> dict[int, int]:
    """byte -> the byte-level BPE token that is exactly that byte (GPT-2's byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256)
                                                       if b not in chars)})
    return {b: tok.convert_tokens_to_ids(c) for b, c in chars.items()}


@pytest.mark.parametrize("spec", [
    dict(json={"type": "string"}),
    dict(json={"type": "string", "maxLength": 6}),
    dict(regex='"[^x]{1,4}"'),
    dict(regex='".{1,4}"'),
    dict(grammar='root ::= "\\"" [^"]* "\\""'),
])
def test_grammars_only_allow_bytes_that_decode_to_their_text(llm, spec):
    """xgrammar, left alone, lets raw control characters into a length-bounded JSON string
    and UTF-8-encoded surrogates (ED A0 80) into any negated class or any-character; neither
    decodes to the text the grammar describes (invalid JSON, U+FFFD). keel's grammars refuse
    both, byte by byte, and still take real multi-byte characters."""
    import xgrammar as xgr

    from keel.structured_output import grammar_ebnf

    tok = llm.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=llm.config.model_config.vocab_size)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL  # what the tokenizer really is
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(
        grammar_ebnf(StructuredOutputsParams(**spec)))
    byte_token = _byte_token_ids(tok)

    def accepts(content: bytes) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(byte_token[b]) for b in b'"' + content + b'"') \
            and matcher.is_completed()

    assert accepts(b"ab") and accepts("漢".encode()) and accepts("😀".encode())
    assert not accepts(b"\xed\xa0\x80")  # a surrogate
    if "json" in spec:
        assert not accepts(b"a\x01")  # a raw control character


def test_default_model_answers_a_json_schema_request(monkeypatch, tmp_path):
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"]}
    llm = LLM(kv_cache_memory_gib=0.5)
    out = llm.chat([{"role": "user", "content": "Invent a person. Answer in JSON with their "
                                                "name and age."}],
                   SamplingParams(temperature=0, max_tokens=60,
                                  structured_outputs=StructuredOutputsParams(json=schema)),
                   use_tqdm=False)
    text = texts(out)[0]
    data = json.loads(text)
    jsonschema.validate(data, schema)
    assert data["name"].strip()


def test_rejected_token_or_failed_compile_ends_that_request_with_an_error(llm, monkeypatch,
                                                                        caplog):
    """Neither should happen (the bitmask allows only what the matcher accepts; the grammar
    was checked when added), but if it does the request ends with "error", the reason is
    logged, and the other requests finish normally."""
    from keel.structured_output import StructuredOutputManager, StructuredOutputRequest

    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    real_accept = StructuredOutputRequest.accept_token
    calls = {"n": 0}

    def flaky_accept(self, token_id):
        calls["n"] += 1
        return calls["n"] < 3 and real_accept(self, token_id)

    monkeypatch.setattr(StructuredOutputRequest, "accept_token", flaky_accept)
    outs = llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}],
                        [constrained(0, regex="[a-z]{10}"), free], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert len(outs[0].outputs[0].token_ids) == 3
    assert len(outs[1].outputs[0].token_ids) == 6 and outs[1].outputs[0].finish_reason == "length"
    assert "rejected sampled token" in caplog.text
    monkeypatch.undo()

    def broken_compile(self, params):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(StructuredOutputManager, "_compile", broken_compile)
    outs = llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}],
                        [constrained(0, regex="[0-9]{7}"), free], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    assert len(outs[1].outputs[0].token_ids) == 6
    assert "compiler exploded" in caplog.text
    scheduler = llm.engine_core.scheduler
    assert not scheduler.has_unfinished_requests() and not scheduler.structured_req_ids
