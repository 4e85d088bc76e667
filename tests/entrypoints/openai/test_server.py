"""`keel serve` through the official openai client (sync and async), and the routes around it."""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY, MODEL_NAME


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def async_client(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_with_usage(client):
    out = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=7,
                                    temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 7 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_token_id_prompts_and_batch_of_prompts(client):
    out = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 8
    # The same prompt alone gives the same greedy text.
    alone = client.completions.create(model=MODEL_NAME, prompt=[8, 9], max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert alone.choices[0].text == out.choices[1].text


def test_echo_returns_the_prompt_first(client):
    out = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=3,
                                    temperature=0, echo=True)
    assert out.choices[0].text.startswith("hello world")


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_too(client, stream):
    kwargs = dict(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0,
                  echo=True, logprobs=2, extra_body={"ignore_eos": True})
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)
                  if c.choices]
        tokens = [t for c in chunks for t in c.logprobs.tokens]
        token_logprobs = [t for c in chunks for t in c.logprobs.token_logprobs]
    else:
        lp = client.completions.create(**kwargs).choices[0].logprobs
        tokens, token_logprobs = lp.tokens, lp.token_logprobs
    assert len(tokens) == 4 + 3
    assert token_logprobs[0] is None  # the first prompt token has no context
    assert all(x is not None and x <= 0 for x in token_logprobs[1:])


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hi"}],
        max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 6


def test_streaming_equals_non_streaming_and_reports_usage(client):
    kwargs = dict(model=MODEL_NAME, prompt="the quick brown", max_tokens=12, temperature=0.8,
                  seed=3, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                  max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10


def test_n_choices(client):
    out = client.completions.create(model=MODEL_NAME, prompt="abc", n=2, max_tokens=5,
                                    temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 10
    chat = client.chat.completions.create(model=MODEL_NAME, n=2, max_tokens=4, temperature=1.0,
                                          messages=[{"role": "user", "content": "x"}], seed=2)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4,
                                    temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    # Greedy: the chosen token is the most likely one.
    assert all(lp.token_logprobs[i] >= max(lp.top_logprobs[i].values()) - 1e-4
               for i in range(4))
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_stop_string(client):
    base = client.completions.create(model=MODEL_NAME, prompt="once upon", max_tokens=20,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        stop = text[-3:]
    out = client.completions.create(model=MODEL_NAME, prompt="once upon", max_tokens=20,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "a person"}], max_tokens=60,
        temperature=0.7, seed=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    # Completions take response_format too (a vLLM extension); a schema that must close soon.
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    obj = client.completions.create(
        model=MODEL_NAME, prompt="{", max_tokens=40, temperature=0,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "ok", "schema": small}}})
    assert obj.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(obj.choices[0].text), small)


def test_async_client_concurrent(async_client, client):
    async def run():
        return await asyncio.gather(*(
            async_client.completions.create(model=MODEL_NAME, prompt=[i + 5, 7, 9],
                                            max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
            for i in range(8)))

    outs = asyncio.run(run())
    assert all(o.usage.completion_tokens == 6 for o in outs)
    again = client.completions.create(model=MODEL_NAME, prompt=[3 + 5, 7, 9], max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == outs[3].choices[0].text


def test_metrics_count_tokens_and_requests(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3, 4], max_tokens=5,
                              temperature=0, extra_body={"ignore_eos": True})
    after = server.metrics()

    def delta(prefix):
        return (sum(v for k, v in after.items() if k.startswith(prefix))
                - sum(v for k, v in before.items() if k.startswith(prefix)))

    assert delta("keel:generation_tokens_total") == 5
    assert delta("keel:prompt_tokens_total") == 4
    assert delta('keel:request_success_total{finished_reason="length"') == 1
    assert delta("keel:time_to_first_token_seconds_count") == 1
    assert delta("keel:inter_token_latency_seconds_count") == 4
    assert delta("keel:e2e_request_latency_seconds_count") == 1
    assert delta("keel:prefix_cache_queries_total") == 4
    assert server.metric("keel:kv_cache_usage_perc") == 0.0
    assert server.metric("keel:num_requests_running") == 0.0
