"""The server under load and under failure: 256 concurrent streams, a client that leaves
mid-stream, a fuzzer reading the server's own OpenAPI document, and a killed engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx2 as httpx

from keel.trace.recorder import read_trace
from tests.entrypoints.openai.conftest import MODEL_NAME, start_server, stop_server


def _body(i: int, stream: bool, max_tokens: int = 16) -> dict:
    return {"model": MODEL_NAME, "prompt": [(7 * i) % 300 + 1, 11, 12], "max_tokens": max_tokens,
            "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": stream}


async def _stream_text(client: httpx.AsyncClient, body: dict) -> str:
    text = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += [c["text"] for c in chunk["choices"]]
    return "".join(text)


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_256_concurrent_streams_equal_non_streamed_and_free_the_cache(server):
    async def run():
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                     limits=limits, timeout=300) as client:
            streamed = await asyncio.gather(*(_stream_text(client, _body(i, True))
                                              for i in range(256)))
            full = await asyncio.gather(*(client.post("/v1/completions", json=_body(i, False))
                                          for i in range(256)))
        return streamed, [r.json()["choices"][0]["text"] for r in full]

    streamed, full = asyncio.run(run())
    assert len(streamed) == 256 and streamed == full
    assert len(set(full)) > 200  # 256 different seeds: different texts
    _wait_for(lambda: server.metric("keel:kv_cache_usage_perc") == 0.0)
    assert server.metric("keel:num_requests_running") == 0.0


def test_client_that_disconnects_is_aborted_and_others_finish(server):
    aborts = 'keel:request_success_total{finished_reason="abort"'
    before = server.metric(aborts)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                     timeout=120) as client:
            other = asyncio.create_task(client.post("/v1/completions",
                                                    json=_body(1, False, max_tokens=200)))
            async with client.stream("POST", "/v1/completions",
                                     json=_body(2, True, max_tokens=400)) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 3:
                        break  # leave mid-stream: the response is closed here
            return await other

    other = asyncio.run(run())
    assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 200
    _wait_for(lambda: server.metric(aborts) == before + 1)
    _wait_for(lambda: server.metric("keel:kv_cache_usage_perc") == 0.0)
    assert server.metric("keel:num_requests_running") == 0.0


def test_schemathesis_finds_no_server_error(server, tmp_path):
    """Fuzz every operation of /openapi.json (bounded): no 5xx, no hang, schema-conformant."""
    cli = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    cmd = [cli, "run", f"{server.url}/openapi.json", "--checks",
           "not_a_server_error,status_code_conformance",
           "--max-examples", "15", "--max-time", "60", "--request-timeout", "30",
           "--seed", "1", "-H", f"Authorization: {server.headers['Authorization']}",
           "--workers", "1", "--suppress-health-check", "all", "--no-shrink"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_killed_engine_fails_requests_and_health(hf_model_dir):
    server = start_server(hf_model_dir("llama"), api_key=None)
    try:
        engine_pid = server.engine_pid()

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                non_stream = asyncio.create_task(client.post(
                    "/v1/completions", json=_body(3, False, max_tokens=450)))
                events = []
                async with client.stream("POST", "/v1/completions",
                                         json=_body(4, True, max_tokens=450)) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 3:
                                os.kill(engine_pid, signal.SIGKILL)
                return events, await non_stream

        start = time.monotonic()
        events, non_stream = asyncio.run(run())
        assert time.monotonic() - start < 30
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert non_stream.status_code == 503 and "engine" in non_stream.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        later = httpx.post(f"{server.url}/v1/completions", json=_body(5, False))
        assert later.status_code == 503
    finally:
        stop_server(server)


def test_async_scheduling_and_drafts_serve_the_same_tokens(server, hf_model_dir, tmp_path):
    """`keel serve --async-scheduling` and `--speculative-config`, apart and together, give the
    greedy tokens of the plain server, streamed or not, and go idle with the cache free. The
    last one also records a trace (`--trace`)."""
    body = {"model": MODEL_NAME, "prompt": [9, 8, 7, 9, 8, 7, 9, 8], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    expected = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers,
                          timeout=60).json()["choices"][0]["text"]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    for extra in (["--async-scheduling"], ["--speculative-config", spec],
                  ["--async-scheduling", "--speculative-config", spec,
                   "--trace", str(tmp_path / "serve.jsonl")]):
        other = start_server(hf_model_dir("llama"), *extra, api_key=None)
        try:
            got = httpx.post(f"{other.url}/v1/completions", json=body, timeout=60).json()
            assert got["choices"][0]["text"] == expected, extra

            async def stream(url):
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    return await _stream_text(client, {**body, "stream": True})

            assert asyncio.run(stream(other.url)) == expected, extra
            _wait_for(lambda srv=other: srv.metric("keel:kv_cache_usage_perc") == 0.0)
        finally:
            stop_server(other)
    _, steps = read_trace(tmp_path / "serve.jsonl")
    kept = [t for s in steps for row in (s["sampled_token_ids"] or ()) for t in row]
    assert len(kept) == 2 * body["max_tokens"]  # the two requests, every token once
    assert any(s["scheduler_output"]["spec_decode_tokens"] for s in steps)
