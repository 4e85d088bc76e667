"""Async scheduling: the engine plans step N+1 while step N runs (two steps in flight); the
tokens must be exactly those of the plain engine (and of transformers), with chunked prefill,
preemption, stop tokens, aborts, structured outputs and seeded sampling."""

from __future__ import annotations

import threading

import pytest

from keel import LLM, SamplingParams
from keel.sampling_params import StructuredOutputsParams
from tests.engine.conftest import PROMPT_LENS
from tests.engine.test_llm_e2e import GREEDY, SETTINGS
from tests.model_executor.test_models import random_prompt


@pytest.mark.parametrize("setting", ["default", "chunked_prefill", "preemption"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_greedy_equals_transformers_with_async_scheduling(reference, arch, setting):
    folder, prompts, expected = reference(arch)
    llm = LLM(folder, dtype="float32", async_scheduling=True, **SETTINGS[setting])
    core = llm.engine_core
    assert core.batch_queue is not None and core.model_executor.max_concurrent_batches == 2
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if setting == "preemption":
        assert core.scheduler.num_preemptions > 0
    # Drain the step still in flight: nothing is left behind.
    while core.batch_queue or core.scheduler.has_requests():
        core.step_fn()
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not core.scheduler.requests


def test_stops_seeds_and_grammars_match_the_plain_engine(hf_model_dir):
    folder = hf_model_dir("qwen2")
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in PROMPT_LENS[:8]]
    plain = LLM(folder, dtype="float32")
    first = plain.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first[3]]),
        SamplingParams(temperature=0.9, top_p=0.8, seed=4, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(
            choice=["alpha", "beta", "gamma"])),
    ] * 2
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = LLM(folder, dtype="float32", async_scheduling=True).generate(prompts, params,
                                                                       use_tqdm=False)
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert got[0].outputs[0].token_ids[-1] == first[3]


def test_abort_with_a_step_in_flight(hf_model_dir):
    llm = LLM(hf_model_dir("llama"), dtype="float32", async_scheduling=True)
    core = llm.engine_core
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, n in enumerate((9, 14, 21)):
        request, _ = llm.input_processor.process(str(i), {"prompt_token_ids":
                                                          random_prompt(n, seed=i)}, params)
        core.add_request(request)
    for _ in range(6):
        core.step_fn()
    assert core.batch_queue  # a step is in flight
    core.abort_requests(["1"])
    finished = {}
    while core.batch_queue or core.scheduler.has_requests():
        outputs, _ = core.step_fn()
        for o in outputs.get(0).outputs if outputs else ():
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert finished == {"0": "length", "2": "length"}
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_the_next_step_is_scheduled_while_the_previous_one_runs(hf_model_dir):
    """The worker call runs on its own thread: schedule() of step N+1 starts before
    sample_tokens of step N has finished."""
    llm = LLM(hf_model_dir("llama"), dtype="float32", async_scheduling=True)
    core = llm.engine_core
    runner = core.model_executor.driver_worker.model_runner
    events = []
    lock = threading.Lock()
    schedule, sample = core.scheduler.schedule, runner.sample_tokens

    def spy_schedule(*a):
        with lock:
            events.append(("schedule", threading.current_thread().name))
        return schedule(*a)

    def spy_sample(*a):
        out = sample(*a)
        with lock:
            events.append(("sampled", threading.current_thread().name))
        return out

    core.scheduler.schedule, runner.sample_tokens = spy_schedule, spy_sample
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=6,
                                                                   ignore_eos=True),
                 use_tqdm=False)
    kinds = [k for k, _ in events]
    # Two schedules before the first sample is known: step 2 planned with step 1 in flight.
    assert kinds[:2] == ["schedule", "schedule"]
    assert {t for k, t in events if k == "sampled"} != {t for k, t in events if k == "schedule"}
