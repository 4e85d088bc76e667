"""End to end against transformers, float32, small random models: greedy LLM.generate equals
transformers' generate token for token for 24 prompts of mixed lengths, and stays identical
when chunked prefill, queueing (max_num_seqs) and preemption (few KV blocks) kick in."""

from __future__ import annotations

import pytest

from keel import LLM, SamplingParams
from tests.engine.conftest import MAX_TOKENS
from tests.hf_models import ARCHS
from tests.model_executor.test_models import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# Engine settings that change how the work is split, but must not change a single token.
SETTINGS = {
    "default": {},
    "chunked_prefill": dict(max_num_batched_tokens=32),
    "queueing": dict(max_num_seqs=5),
    "preemption": dict(max_model_len=128, num_gpu_blocks_override=24),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, setting, reference):
    folder, prompts, expected = reference(arch)
    llm = LLM(folder, dtype="float32", **SETTINGS[setting])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order
    for out, exp in zip(outputs, expected):
        assert out.outputs[0].token_ids == exp
        assert out.outputs[0].finish_reason == "length"
    scheduler = llm.engine_core.scheduler
    if setting == "preemption":
        assert scheduler.num_preemptions > 0
    else:
        assert scheduler.num_preemptions == 0
    # Everything was returned: no request or block is left behind.
    assert not scheduler.has_unfinished_requests()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_chunked_prefill_really_chunks(reference):
    """With a 32-token budget, a 66-token prompt must take several steps, sharing them with
    decodes of other requests."""
    folder, prompts, _ = reference("llama")
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=32)
    core = llm.engine_core
    for i, p in enumerate([prompts[1], prompts[8]]):  # 7 and 66 tokens
        req, _ = llm.input_processor.process(f"r{i}", {"prompt_token_ids": p}, GREEDY)
        core.add_request(req)
    seen_mixed = False
    steps_with_long_prefill = 0
    while core.scheduler.has_requests():
        so = core.scheduler.schedule()
        long_tokens = so.num_scheduled_tokens.get("r1", 0)
        if long_tokens > 1:
            steps_with_long_prefill += 1
            assert so.total_num_scheduled_tokens <= 32
            seen_mixed |= so.num_scheduled_tokens.get("r0") == 1
        future = core.model_executor.execute_model(so, non_block=True)
        out = future.result() or core.model_executor.sample_tokens(None)
        core.scheduler.update_from_output(so, out)
    assert steps_with_long_prefill >= 3
    assert seen_mixed  # a decode of r0 shared a step with r1's prefill chunk


def test_string_prompts_and_sampling(hf_model_dir):
    """String prompts through the tokenizer; a seeded sampled request is reproducible and
    independent of what else is in the batch; greedy and sampled rows share a batch."""
    llm = LLM(hf_model_dir("qwen2"), dtype="float32")
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=12, seed=7,
                             ignore_eos=True)
    a = llm.generate(["Hello world!"], sampled, use_tqdm=False)[0]
    b = llm.generate(["The quick brown fox", "Hello world!"], [GREEDY, sampled],
                     use_tqdm=False)
    assert a.prompt == "Hello world!"
    assert a.prompt_token_ids == llm.tokenizer.encode("Hello world!")
    assert b[1].outputs[0].token_ids == a.outputs[0].token_ids
    assert len(b[0].outputs[0].token_ids) == MAX_TOKENS
    assert a.outputs[0].text == llm.tokenizer.decode(a.outputs[0].token_ids,
                                                     skip_special_tokens=True)


def test_stop_conditions(hf_model_dir, reference):
    folder, prompts, expected = reference("llama")
    llm = LLM(folder, dtype="float32")
    stop_tok = expected[0][5]
    first = expected[0].index(stop_tok)
    out = llm.generate({"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                      stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[0][: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    out = llm.generate({"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[0][:4] and out.finish_reason == "length"


def test_seeded_sampling_independent_of_chunking(hf_model_dir):
    """A seeded request gives the same tokens whether its prompt is prefilled in one pass or
    in chunks (discarded rows must not advance its generator)."""
    folder = hf_model_dir("llama")
    prompt = {"prompt_token_ids": random_prompt(40, seed=9)}
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    whole = LLM(folder, dtype="float32").generate(prompt, params, use_tqdm=False)
    chunked = LLM(folder, dtype="float32", max_num_batched_tokens=16).generate(
        prompt, params, use_tqdm=False)
    assert whole[0].outputs[0].token_ids == chunked[0].outputs[0].token_ids


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_long_prompt_chunks_beside_decodes(hf_model_dir, arch):
    """Chunks longer than the CPU kernel's limit (a whole prompt, then a chunk after context)
    run in the same passes as decodes and short chunks: each long chunk goes to SDPA alone,
    the rest to the kernel. Greedy tokens equal transformers' (mistral: sliding window)."""
    from tests.hf_models import hf_reference
    from tests.model_executor.test_models import hf_greedy

    folder = hf_model_dir(arch)
    prompts = [random_prompt(n, seed=70 + n) for n in (9, 420, 14, 290, 5)]
    hf = hf_reference(folder)
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=320)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
