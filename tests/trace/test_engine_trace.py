"""Tracing a real engine run: LLM(trace_path=...) and `keel generate --trace`. The trace must
agree with what the engine returned, under chunked prefill, preemption and async scheduling,
and tracing must not change a single token."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict

import pytest

from keel import LLM, SamplingParams
from keel.entrypoints.cli import main
from keel.trace.recorder import read_trace
from tests.model_executor.test_models import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=300 + i) for i, n in enumerate([5, 41, 17, 60, 9, 33])]
# Few KV blocks and a small token budget: prompts are chunked and requests preempted.
TIGHT = dict(max_model_len=80, num_gpu_blocks_override=20, max_num_batched_tokens=32,
             block_size=4)


def generate(folder, **kwargs):
    llm = LLM(folder, dtype="float32", **TIGHT, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    preemptions = llm.engine_core.scheduler.num_preemptions
    llm.engine_core.shutdown()
    return outs, preemptions


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_trace_agrees_with_the_outputs(hf_model_dir, tmp_path, async_scheduling):
    folder = hf_model_dir("llama")
    plain, _ = generate(folder, async_scheduling=async_scheduling)
    path = tmp_path / "run.jsonl"
    traced, preemptions = generate(folder, async_scheduling=async_scheduling,
                                   trace_path=str(path))
    assert [o.outputs[0].token_ids for o in traced] == [o.outputs[0].token_ids for o in plain]
    assert preemptions > 0

    meta, steps = read_trace(path)
    assert meta["block_size"] == 4 and meta["async_scheduling"] == async_scheduling
    kept: dict[str, list[int]] = defaultdict(list)
    preempted, resumed, chunked = set(), set(), False
    for step in steps:
        so = step["scheduler_output"]
        preempted |= set(so["preempted"])
        resumed |= set(so["resumed"])
        assert next(p["name"] for p in step["phases"]) == "schedule"
        if step["batch"] is None:
            assert so["total_num_scheduled_tokens"] == 0
            continue
        rows = step["batch"]["rows"]
        # The batch after the diff is exactly the requests this pass schedules.
        assert {r["req_id"] for r in rows} == set(so["num_scheduled_tokens"])
        layout = step["layout"]
        assert layout["num_tokens"] == so["total_num_scheduled_tokens"]
        qsl = layout["query_start_loc"]
        assert [b - a for a, b in itertools.pairwise(qsl)] == [r["num_scheduled_tokens"] for r in rows]
        for row, tokens in zip(rows, step["sampled_token_ids"]):
            kept[row["req_id"]].extend(tokens)
        chunked |= any(layout["discard_request_mask"])
    assert preempted and resumed <= preempted and resumed
    assert chunked
    # Every kept token of every pass, in order, is the request's output (a preempted
    # request's tokens are not sampled again: it recomputes them).
    for out in traced:
        assert kept[out.request_id] == out.outputs[0].token_ids


def test_keel_generate_trace_then_view_and_chrome(hf_model_dir, tmp_path, capsys):
    folder = hf_model_dir("llama")
    path = tmp_path / "cli.jsonl"
    assert main(["generate", "--model", folder, "--dtype", "float32", "--max-tokens", "4",
                 "--no-chat", "--trace", str(path), "hello", "world"]) == 0
    _, steps = read_trace(path)
    assert sum(len(t) for s in steps for t in (s["sampled_token_ids"] or ())) == 8
    capsys.readouterr()
    assert main(["trace", "view", str(path), "-o", str(tmp_path / "v.html")]) == 0
    html = (tmp_path / "v.html").read_text()
    assert capsys.readouterr().out.strip() == str(tmp_path / "v.html")
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html
    assert main(["trace", "chrome", str(path)]) == 0
    chrome = json.loads(path.with_suffix(".chrome.json").read_text())
    assert sum(e["name"].startswith("step ") for e in chrome["traceEvents"]) == len(steps)


def test_trace_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "x.jsonl"
    bad.write_text("hello\n")
    assert main(["trace", "view", str(bad)]) == 2
    assert "x.jsonl:1 is not JSON" in capsys.readouterr().err
    assert main(["trace", "chrome", str(tmp_path / "none.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
