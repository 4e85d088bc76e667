"""The OpenAI API's bodies, without a server or a model: every malformed request is a
ValidationError that names its field, good ones become the right SamplingParams, and the
logprob helpers turn keel's per-position dicts into OpenAI's shapes."""

from __future__ import annotations

import json

import pydantic
import pytest

from keel.entrypoints.openai.protocol import (
    LOGPROB_FLOOR,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseFormat,
    UsageInfo,
)
from keel.entrypoints.openai.responses import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    chat_logprobs,
    completion_logprobs,
)
from keel.outputs import Logprob
from keel.sampling_params import RequestOutputKind

MSGS = [{"role": "user", "content": "hi"}]

# (extra fields on top of a valid body, the field the error must name)
BAD_COMMON = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),  # a string is not a number
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.1}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": "2"}, "n"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": "yes"}, "stream"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
]

BAD_COMPLETION = BAD_COMMON + [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"echo": "true"}, "echo"),
]

BAD_CHAT = BAD_COMMON + [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"messages": [{"content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 5}, "logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("extra", "field"), BAD_COMPLETION, ids=lambda x: str(x)[:60])
def test_bad_completion_request_names_field(extra, field):
    with pytest.raises(pydantic.ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": "hello", **extra})
    assert field in str(exc.value)


@pytest.mark.parametrize(("extra", "field"), BAD_CHAT, ids=lambda x: str(x)[:60])
def test_bad_chat_request_names_field(extra, field):
    with pytest.raises(pydantic.ValidationError) as exc:
        ChatCompletionRequest.model_validate({"messages": MSGS, **extra})
    assert field in str(exc.value)


def test_json_body_errors_too():
    with pytest.raises(pydantic.ValidationError, match="temperature"):
        CompletionRequest.model_validate_json('{"prompt": "a", "temperature": "hot"}')
    req = CompletionRequest.model_validate_json('{"prompt": "a", "temperature": 1}')
    assert req.temperature == 1.0  # an integer is a number


# ---- good requests -> SamplingParams ------------------------------------------------------------


def test_completion_defaults_are_openais():
    sp = CompletionRequest.model_validate({"prompt": "hi", "some_new_openai_field": 1}) \
        .to_sampling_params(default_max_tokens=100)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (sp.n, sp.logprobs, sp.prompt_logprobs, sp.structured_outputs) == (1, None, None, None)
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY
    assert sp.skip_special_tokens and not sp.include_stop_str_in_output


def test_completion_fields_reach_sampling_params():
    req = CompletionRequest.model_validate({
        "prompt": [[1, 2], [3]], "max_tokens": None, "temperature": 0, "top_p": 0.9,
        "top_k": -1, "min_p": 0.05, "n": 2, "best_of": 2, "stream": True,
        "stream_options": {"include_usage": True}, "stop": "\n", "stop_token_ids": [7],
        "seed": 42, "logprobs": 3, "echo": True, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logit_bias": {"50256": -100},
        "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False,
        "include_stop_str_in_output": True})
    sp = req.to_sampling_params(default_max_tokens=77)
    assert sp.max_tokens == 77  # null max_tokens: the server's default
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.n) == (0, 0.9, 0, 0.05, 2)
    assert sp.output_kind == RequestOutputKind.DELTA
    assert (sp.stop, sp.stop_token_ids, sp.seed) == (["\n"], [7], 42)
    assert (sp.logprobs, sp.prompt_logprobs) == (3, 3)  # echo scores the prompt too
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.1)
    assert sp.logit_bias == {50256: -100.0}
    assert all(isinstance(k, int) for k in sp.logit_bias)
    assert sp.ignore_eos and sp.min_tokens == 2
    assert not sp.skip_special_tokens and sp.include_stop_str_in_output


def test_response_formats_become_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}}
    so = ChatCompletionRequest.model_validate(body).to_sampling_params(10).structured_outputs
    assert so.json == schema and not so.json_object
    fmt = ChatCompletionRequest.model_validate(body).response_format
    assert fmt.model_dump()["json_schema"]["schema"] == schema  # the wire name, both ways

    body["response_format"] = {"type": "json_object"}
    so = ChatCompletionRequest.model_validate(body).to_sampling_params(10).structured_outputs
    assert so.json_object and so.json is None

    body["response_format"] = {"type": "text"}
    assert ChatCompletionRequest.model_validate(body).to_sampling_params(10) \
        .structured_outputs is None
    assert ResponseFormat(type="text").structured_outputs() is None


@pytest.mark.parametrize(("limits", "expected"), [
    ({"max_tokens": 5, "max_completion_tokens": 9}, 9),
    ({"max_tokens": 5}, 5),
    ({"max_completion_tokens": 9}, 9),
    ({}, 123),
])
def test_chat_max_completion_tokens_preferred(limits, expected):
    req = ChatCompletionRequest.model_validate({"messages": MSGS, **limits})
    assert req.to_sampling_params(default_max_tokens=123).max_tokens == expected


@pytest.mark.parametrize(("flags", "expected"), [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 4}, 4),
])
def test_chat_logprobs_flags(flags, expected):
    req = ChatCompletionRequest.model_validate({"messages": MSGS, **flags})
    sp = req.to_sampling_params(None)
    assert sp.logprobs == expected and sp.prompt_logprobs is None
    assert sp.max_tokens is None  # no limit and no default: up to max_model_len


def test_chat_stream_is_delta_and_text_parts_join():
    req = ChatCompletionRequest.model_validate({
        "stream": True, "add_generation_prompt": False, "chat_template_kwargs": {"x": 1},
        "messages": [{"role": "system", "content": None},
                     {"role": "user", "name": "bob", "content": [
                         {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]})
    assert req.to_sampling_params(8).output_kind == RequestOutputKind.DELTA
    assert [m.text() for m in req.messages] == ["", "one\ntwo"]
    assert not req.add_generation_prompt and req.chat_template_kwargs == {"x": 1}
    assert ChatMessage(role="assistant", content="ok").text() == "ok"


def test_min_tokens_above_server_default_is_value_error():
    req = ChatCompletionRequest.model_validate({"messages": MSGS, "min_tokens": 20})
    with pytest.raises(ValueError, match="min_tokens"):
        req.to_sampling_params(default_max_tokens=10)


# ---- responses ----------------------------------------------------------------------------------


def test_responses_have_openai_shape():
    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    cmpl = CompletionResponse(model="m", usage=usage, choices=[CompletionResponseChoice(
        index=0, text="hi", finish_reason="stop", stop_reason="\n")])
    chat = ChatCompletionResponse(model="m", usage=usage, choices=[ChatCompletionResponseChoice(
        index=0, message=ChatResponseMessage(content="hi"), finish_reason="length")])
    chunk = ChatCompletionStreamResponse(model="m", choices=[ChatCompletionStreamChoice(
        index=0, delta=DeltaMessage(role="assistant", content="h"))])
    assert cmpl.id.startswith("cmpl-") and chat.id.startswith("chatcmpl-")
    assert chunk.id.startswith("chatcmpl-") and chunk.id != chat.id
    assert isinstance(cmpl.created, int) and cmpl.created > 1_600_000_000
    assert (cmpl.object, chat.object, chunk.object) == (
        "text_completion", "chat.completion", "chat.completion.chunk")
    assert CompletionStreamResponse(model="m", choices=[]).usage is None
    assert json.loads(chat.model_dump_json())["choices"][0]["message"]["role"] == "assistant"
    err = ErrorResponse(error=ErrorInfo(message="bad", type="BadRequestError", code=400))
    assert err.model_dump() == {"error": {"message": "bad", "type": "BadRequestError",
                                          "param": None, "code": 400}}
    models = ModelList(data=[ModelCard(id="m", max_model_len=2048)]).model_dump()
    assert models["object"] == "list" and models["data"][0]["owned_by"] == "keel"

    # What OpenAI's own client parses these bodies into.
    openai_types = pytest.importorskip("openai.types")
    openai_chat = pytest.importorskip("openai.types.chat")
    assert openai_types.Completion.model_validate(cmpl.model_dump()).choices[0].text == "hi"
    assert openai_chat.ChatCompletion.model_validate(chat.model_dump()) \
        .choices[0].message.content == "hi"
    assert openai_chat.ChatCompletionChunk.model_validate(chunk.model_dump()) \
        .choices[0].delta.content == "h"
    assert openai_types.Model.model_validate(models["data"][0]).id == "m"


# ---- logprob helpers ----------------------------------------------------------------------------


VOCAB = {0: "<s>", 1: "Hel", 2: "lo", 3: "!", 4: " world", 5: "é"}


class FakeTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids)


def test_completion_logprobs_shape():
    # Position 0: sampled "Hel" is rank 1 (also the top-1); position 1: sampled "lo" ranks 5,
    # outside the top 2; position 2: decoded_token None -> the tokenizer decodes.
    positions = [
        {1: Logprob(-0.1, 1, "Hel"), 4: Logprob(-2.5, 2, " world")},
        {2: Logprob(-3.0, 5, "lo"), 3: Logprob(-0.5, 1, "!"), 4: Logprob(-1.0, 2, " world")},
        {3: Logprob(float("-inf"), 9, None), 5: Logprob(-0.2, 1, None)},
    ]
    out = completion_logprobs([1, 2, 3], positions, FakeTokenizer(), initial_text_offset=5)
    assert out.tokens == ["Hel", "lo", "!"]
    assert out.text_offset == [5, 8, 10]
    assert out.token_logprobs == [-0.1, -3.0, LOGPROB_FLOOR]
    assert out.top_logprobs == [
        {"Hel": -0.1, " world": -2.5},
        {"!": -0.5, " world": -1.0, "lo": -3.0},
        {"é": -0.2, "!": LOGPROB_FLOOR},
    ]
    assert list(out.top_logprobs[1]) == ["!", " world", "lo"]  # most likely first
    json.loads(out.model_dump_json())  # no infinities on the wire


def test_completion_logprobs_echoed_prompt_first_token_is_none():
    out = completion_logprobs([0, 1], [None, {1: Logprob(-0.3, 1, "Hel")}], FakeTokenizer(), 0)
    assert out.tokens == ["<s>", "Hel"]
    assert out.text_offset == [0, 3]
    assert out.token_logprobs == [None, -0.3]
    assert out.top_logprobs == [None, {"Hel": -0.3}]


def test_chat_logprobs_shape():
    positions = [
        {2: Logprob(-3.0, 5, "lo"), 3: Logprob(-0.5, 1, "!"), 4: Logprob(-1.0, 2, " world")},
        {5: Logprob(-0.2, 1, None), 3: Logprob(-2.0, 2, "!")},
    ]
    out = chat_logprobs([2, 5], positions, FakeTokenizer(), top_logprobs=2)
    first, second = out.content
    assert (first.token, first.logprob, first.bytes) == ("lo", -3.0, [108, 111])
    # The sampled token ranks 5th: not among the top 2.
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("!", -0.5), (" world", -1.0)]
    assert (second.token, second.bytes) == ("é", [0xC3, 0xA9])
    assert [t.token for t in second.top_logprobs] == ["é", "!"]
    assert second.top_logprobs[0].bytes == [0xC3, 0xA9]

    none_top = chat_logprobs([2], positions[:1], FakeTokenizer(), top_logprobs=0)
    assert none_top.content[0].top_logprobs == [] and none_top.content[0].logprob == -3.0


def test_logprobs_parse_in_openai_client():
    openai_types = pytest.importorskip("openai.types")
    openai_chat = pytest.importorskip("openai.types.chat")
    positions = [{1: Logprob(-0.1, 1, "Hel"), 4: Logprob(-2.5, 2, " world")}]
    cmpl = CompletionResponse(model="m", usage=UsageInfo(), choices=[CompletionResponseChoice(
        index=0, text="Hel", finish_reason="length",
        logprobs=completion_logprobs([1], positions, FakeTokenizer(), 0))])
    parsed = openai_types.Completion.model_validate(cmpl.model_dump())
    assert parsed.choices[0].logprobs.top_logprobs == [{"Hel": -0.1, " world": -2.5}]
    chat = ChatCompletionResponse(model="m", usage=UsageInfo(), choices=[
        ChatCompletionResponseChoice(index=0, message=ChatResponseMessage(content="Hel"),
                                     finish_reason="length",
                                     logprobs=chat_logprobs([1], positions, FakeTokenizer(), 2))])
    content = openai_chat.ChatCompletion.model_validate(chat.model_dump()) \
        .choices[0].logprobs.content
    assert [t.token for t in content[0].top_logprobs] == ["Hel", " world"]
