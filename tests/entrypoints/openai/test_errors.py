"""Bad requests over plain HTTP: each a 4xx in OpenAI's error shape naming what to change, and
the server keeps serving (a long request running meanwhile is not disturbed)."""

from __future__ import annotations

import threading

import httpx2 as httpx
import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (route, body, status, a word the message or param must contain)
BAD_REQUESTS = [
    (C, {"model": MODEL_NAME}, 400, "prompt"),  # missing field
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [[]]}, 400, "prompt"),
    (C, {"prompt": [-1, 2]}, 400, "prompt"),
    (C, {"prompt": [10**9]}, 400, "vocabulary"),  # token id past the vocabulary
    (C, {"prompt": "hi", "max_tokens": "x"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),  # past max_model_len
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "hi", "top_k": 2**63}, 400, "top_k"),  # past int64: once crashed the engine
    (C, {"prompt": "hi", "min_tokens": 2**63}, 400, "min_tokens"),
    (C, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "n": 1000}, 400, "n"),
    (C, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "stop": 7}, 400, "stop"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    (C, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "hi", "model": "gpt-9"}, 404, "gpt-9"),
    (C, {"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    (C, {"prompt": "hi", "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (C, {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, 400, "schema"),
    (C, {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "x " * 2000}, 400, "too long"),  # longer than max_model_len
    (CHAT, {"model": MODEL_NAME}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                        "image_url": {"url": "x"}}]}]},
     400, "messages"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "nope"),
]


def _check_error(r: httpx.Response, status: int, word: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert word.lower() in (err["message"] + " " + str(err["param"])).lower(), err


def test_at_least_thirty_cases():
    assert len(BAD_REQUESTS) >= 30


def test_bad_requests_get_clear_errors_and_others_are_undisturbed(server):
    url = server.url
    body = {"model": MODEL_NAME, "prompt": [11, 12, 13], "max_tokens": 60, "temperature": 0,
            "ignore_eos": True}
    reference = httpx.post(url + C, json=body, headers=server.headers, timeout=60).json()
    result = {}
    # A long request runs while the bad ones arrive.
    runner = threading.Thread(target=lambda: result.update(httpx.post(
        url + C, json=body, headers=server.headers, timeout=120).json()))
    runner.start()
    for route, bad, status, word in BAD_REQUESTS:
        _check_error(httpx.post(url + route, json=bad, headers=server.headers, timeout=30),
                     status, word)
    runner.join()
    assert result["choices"][0]["text"] == reference["choices"][0]["text"]
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b'{"prompt": "hi",}'])
def test_malformed_json(server, raw):
    r = httpx.post(server.url + C, content=raw, timeout=30,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_api_key_is_required_on_v1_routes(server):
    for method, path in (("get", "/v1/models"), ("post", C), ("post", CHAT)):
        r = httpx.request(method, server.url + path, json={"prompt": "hi"}, timeout=30)
        _check_error(r, 401, "api key")
        r = httpx.request(method, server.url + path, json={"prompt": "hi"}, timeout=30,
                          headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # not a /v1 route


def test_oversized_body_is_413(server):
    huge = {"prompt": "x" * (11 << 20)}
    _check_error(httpx.post(server.url + C, json=huge, headers=server.headers, timeout=60),
                 413, "larger")

    def chunks():  # no Content-Length: the limit still holds
        yield b'{"prompt": "'
        for _ in range(12):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = httpx.post(server.url + C, content=chunks(), timeout=60,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_route_and_method(server):
    assert httpx.get(server.url + "/v1/nothing", headers=server.headers).status_code == 404
    r = httpx.get(server.url + C, headers=server.headers)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
