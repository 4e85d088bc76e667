"""Speculative decoding end to end (float32, random models): greedy output equals
transformers' with n-gram drafts of k = 1, 3, 5, on every architecture, with chunked prefill
and preemption; a stop token inside an accepted run of drafts ends the request there; seeded
random sampling repeats; a rejected draft's KV slot is rewritten in the next step."""

from __future__ import annotations

import pytest

from keel import LLM, SamplingParams
from tests.hf_models import ARCHS
from tests.spec_decode.conftest import MAX_TOKENS, prompts_with_repeats

CASES = [(arch, 3, "default") for arch in ARCHS] + [
    ("llama", 1, "default"), ("qwen3", 5, "default"),
    ("llama", 3, "chunked_prefill"), ("qwen2", 5, "preemption"),
]
# Async scheduling on top: the scheduler plans with draft placeholders and optimistic counts,
# the runner corrects them after launching the next pass.
ASYNC_CASES = [(arch, 3, "async") for arch in ARCHS] + [
    ("llama", 1, "async"), ("qwen3", 5, "async"),
    ("mistral", 3, "async_chunked_prefill"), ("qwen2", 5, "async_preemption"),
    ("llama", 3, "async_preemption"),
]
SETTINGS = {"default": {}, "chunked_prefill": dict(max_num_batched_tokens=24),
            "preemption": dict(max_model_len=128, num_gpu_blocks_override=9)}
SETTINGS.update({"async": dict(async_scheduling=True)} | {
    f"async_{name}": dict(SETTINGS[name], async_scheduling=True)
    for name in ("chunked_prefill", "preemption")})


@pytest.mark.parametrize("arch,k,setting", CASES + ASYNC_CASES)
def test_greedy_equals_transformers_with_drafts(reference, arch, k, setting):
    folder, prompts, expected = reference(arch)
    llm = LLM(folder, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}, **SETTINGS[setting])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    sched = llm.engine_core.scheduler
    stats = sched.make_stats()
    assert stats.spec_num_draft_tokens > 0
    if not setting.startswith("async"):  # with async, acceptance is tested with an oracle
        assert stats.spec_num_accepted_tokens > 0
    assert len(stats.spec_accepted_per_pos) == k
    if setting.endswith("preemption"):
        assert sched.num_preemptions > 0
    core = llm.engine_core
    while core.batch_queue or sched.has_requests():  # drain a step still in flight
        core.step_fn()
    assert not sched.has_unfinished_requests() and not sched.requests
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == \
        sched.kv_cache_manager.block_pool.num_blocks


def test_stop_token_inside_accepted_drafts(reference):
    folder, prompts, expected = reference("llama")
    # A token that the greedy output reaches after a few steps, as a stop token.
    row = max(range(len(expected)), key=lambda i: len(set(expected[i][:10])))
    stop = expected[row][6]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop])
    plain = LLM(folder, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    spec = LLM(folder, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1}).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert spec[row].outputs[0].token_ids[-1] == stop


def test_seeded_random_sampling_repeats_with_drafts(hf_model_dir):
    folder = hf_model_dir("qwen3")
    llm = LLM(folder, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompts = [{"prompt_token_ids": p} for p in prompts_with_repeats()]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    a = llm.generate(prompts, params, use_tqdm=False)
    b = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_bad_speculative_config_is_refused(hf_model_dir):
    with pytest.raises(NotImplementedError, match="method 'eagle'"):
        LLM(hf_model_dir("llama"), speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(hf_model_dir("llama"), speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="Unknown speculative_config key"):
        LLM(hf_model_dir("llama"), speculative_config={"k": 3})
