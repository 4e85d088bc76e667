"""Speculative decoding end to end (float32, random models): greedy output equals
transformers' with n-gram drafts of k = 1, 3, 5, on every architecture, with chunked prefill
and preemption; a stop token inside an accepted run of drafts ends the request there; seeded
random sampling repeats; a rejected draft's KV slot is rewritten in the next step."""

from __future__ import annotations

import pytest

from keel import LLM, SamplingParams
from tests.hf_models import ARCHS, hf_reference
from tests.model_executor.test_models import hf_greedy, random_prompt

MAX_TOKENS = 24


def prompts_with_repeats() -> list[list[int]]:
    """Prompts with repeated stretches, so that n-gram drafts find matches."""
    out = []
    for i, n in enumerate((6, 11, 17, 25)):
        base = random_prompt(n, seed=300 + i)
        out.append(base + base[: n // 2] + base)
    return out


@pytest.fixture(scope="module")
def reference(hf_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            folder = hf_model_dir(arch)
            hf = hf_reference(folder)
            prompts = prompts_with_repeats()
            cache[arch] = (folder, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts])
        return cache[arch]

    return get


CASES = [(arch, 3, "default") for arch in ARCHS] + [
    ("llama", 1, "default"), ("qwen3", 5, "default"),
    ("llama", 3, "chunked_prefill"), ("qwen2", 5, "preemption"),
]
SETTINGS = {"default": {}, "chunked_prefill": dict(max_num_batched_tokens=24),
            "preemption": dict(max_model_len=128, num_gpu_blocks_override=9)}


@pytest.mark.parametrize("arch,k,setting", CASES)
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
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert len(stats.spec_accepted_per_pos) == k
    if setting == "preemption":
        assert sched.num_preemptions > 0
    assert not sched.has_unfinished_requests()
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
