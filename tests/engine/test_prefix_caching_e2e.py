"""Prefix caching end to end: the same greedy tokens with the cache on and off (every
architecture; shared prefixes of 0 tokens, part of a block, one block, many blocks; chunked
prefill; memory pressure that evicts and preempts), a visible hit, and reset_prefix_cache in
the middle of a run, down to the step where the runner's diff removes and re-adds a resumed
request that never left its persistent batch."""

from __future__ import annotations

import pytest

from keel import LLM, SamplingParams
from tests.hf_models import ARCHS
from tests.model_executor.test_models import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHARED = {"none": 0, "partial_block": 9, "one_block": 16, "many_blocks": 90}
SETTINGS = {
    "default": {},
    "chunked_prefill": dict(max_num_batched_tokens=32),
    "pressure": dict(max_model_len=128, num_gpu_blocks_override=8),
}


def workload(shared_len: int) -> list[list[int]]:
    prefix = random_prompt(shared_len, seed=7) if shared_len else []
    return [prefix + random_prompt(n, seed=50 + n) for n in (3, 11, 16, 20, 5, 27)]


def generate_twice(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Two waves: in the first, requests share blocks within a step; in the second, they
    find the first wave's blocks in the cache."""
    out = []
    for wave in (prompts[:3], prompts[3:]):
        res = llm.generate([{"prompt_token_ids": p} for p in wave], GREEDY, use_tqdm=False)
        out += [o.outputs[0].token_ids for o in res]
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_same_tokens_with_and_without_caching(hf_model_dir, arch, setting):
    folder = hf_model_dir(arch)
    kwargs = dict(dtype="float32", **SETTINGS[setting])
    on = LLM(folder, enable_prefix_caching=True, **kwargs)
    off = LLM(folder, enable_prefix_caching=False, **kwargs)
    for name, shared_len in SHARED.items():
        prompts = workload(shared_len)
        if setting == "pressure":
            prompts = [p[:60] for p in prompts]  # fit max_model_len, keep the shared prefix
        assert generate_twice(on, prompts) == generate_twice(off, prompts), name
    stats = on.engine_core.scheduler.make_stats()
    assert stats.prefix_cache_hits > 0
    assert off.engine_core.scheduler.make_stats().prefix_cache_hits == 0
    if setting == "pressure":
        assert on.engine_core.scheduler.num_preemptions > 0


def test_a_hit_computes_only_the_suffix(hf_model_dir):
    llm = LLM(hf_model_dir("llama"), dtype="float32")
    prefix = random_prompt(160, seed=1)  # 10 blocks of 16
    first = llm.generate([{"prompt_token_ids": prefix + [5, 6]}], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    scheduled = []
    schedule = llm.engine_core.scheduler.schedule

    def spy(*args):
        so = schedule(*args)
        scheduled.append(dict(so.num_scheduled_tokens))
        return so

    llm.engine_core.scheduler.schedule = spy
    second = llm.generate([{"prompt_token_ids": prefix + [9, 8, 7]}], GREEDY,
                          use_tqdm=False)[0]
    assert second.num_cached_tokens == 160
    assert next(iter(scheduled[0].values())) == 3  # the prefill: only the suffix


def test_reset_prefix_cache_mid_run_keeps_tokens_and_resumes_through_the_diff(hf_model_dir):
    folder = hf_model_dir("qwen3")
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (20, 35, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = LLM(folder, dtype="float32").generate(prompts, params, use_tqdm=False)

    llm = LLM(folder, dtype="float32")
    core = llm.engine_core
    runner = core.model_executor.driver_worker.model_runner
    seen = []
    update_states = runner._update_states

    def watch(so):
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        before = {r: r in runner.input_batch.req_id_to_index for r in resumed}
        old_blocks = {r: list(runner.requests[r].block_ids[0]) for r in resumed}
        result = update_states(so)
        for r in resumed:
            new_blocks = list(runner.requests[r].block_ids[0])
            seen.append((r, before[r], r in runner.input_batch.req_id_to_index,
                         old_blocks[r], new_blocks,
                         list(runner.input_batch.block_table.block_table.np[
                             runner.input_batch.req_id_to_index[r], : len(new_blocks)])))
        return result

    runner._update_states = watch
    step = core.step
    count = {"n": 0}

    def step_with_reset():
        count["n"] += 1
        if count["n"] == 4:  # mid-run: all three are decoding
            assert core.reset_prefix_cache() is True
        return step()

    core.step = step_with_reset
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert {r for r, *_ in seen} == {"0", "1", "2"}
    for _req_id, was_in_batch, is_in_batch, old, new, table_row in seen:
        # In the batch and resumed at once: removed, then re-added with its new block ids.
        assert was_in_batch and is_in_batch
        assert new != old and table_row == new
