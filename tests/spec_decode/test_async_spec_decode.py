"""Async scheduling with speculative decoding: the scheduler plans each step with draft
placeholders and counts every draft of the step in flight as accepted; the runner fills in
its own drafts, runs the forward pass on the real counts, and applies the deferred state
corrections after launching it (the seed's `deferred_state_corrections_fn`).

An oracle drafter (drafts taken from transformers' greedy output, with a wrong token put in on
purpose) makes acceptance and rejection certain on random models."""

from __future__ import annotations

import numpy as np
import pytest

from keel import LLM, SamplingParams
from tests.spec_decode.conftest import MAX_TOKENS

K = 3


def oracle_drafts(runner, expected_by_prompt):
    """Replace the n-gram drafter: each row's drafts are the true continuation, cut at a
    wrong token whose place depends on the step, so some passes accept all drafts, some
    part, some none."""

    def propose_for_batch(batch, rows):
        out = [[] for _ in range(batch.num_reqs)]
        for row in rows.tolist():
            state = runner.requests[batch.req_ids[row]]
            n = len(state.output_token_ids)
            truth = expected_by_prompt[tuple(state.prompt_token_ids)][n : n + K]
            cut = n % (K + 1)  # 0..K correct drafts, then one wrong one (if room)
            drafts = list(truth[:cut])
            if cut < len(truth):
                drafts.append((truth[cut] + 1) % 64)
            out[row] = drafts[:K]
        return out

    runner.spec_decode.drafter.propose_for_batch = propose_for_batch


def spec_llm(folder, **kwargs):
    return LLM(folder, dtype="float32", async_scheduling=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}, **kwargs)


def drain(core):
    while core.batch_queue or core.scheduler.has_requests():
        core.step_fn()


@pytest.mark.parametrize("arch,setting", [
    ("llama", {}), ("qwen2", {}), ("qwen3", dict(max_num_batched_tokens=24)),
    ("mistral", dict(max_model_len=128, num_gpu_blocks_override=9)),
])
def test_accepted_and_rejected_drafts_with_a_step_in_flight(reference, arch, setting):
    folder, prompts, expected = reference(arch)
    llm = spec_llm(folder, **setting)
    core = llm.engine_core
    runner = core.model_executor.driver_worker.model_runner
    oracle_drafts(runner, {tuple(p): e for p, e in zip(prompts, expected)})

    # Spy on every pass: the first scheduled position of each row is its last real token,
    # whatever the scheduler's optimistic count said, and its slot is that position's slot.
    checked = {"rows": 0, "corrected": 0}
    prepare = runner._prepare_inputs

    def spy_prepare(scheduler_output, num_scheduled):
        out = prepare(scheduler_output, num_scheduled)
        batch = runner.input_batch
        n = batch.num_reqs
        starts = runner.query_start_loc.np[:n]
        first_pos = runner.positions.np[starts]
        spec = runner.spec_decode
        decoding = batch.num_computed_tokens_cpu[:n] - spec.corrections_np[:n] \
            == batch.num_tokens[:n] - 1
        if spec.has_corrections:
            checked["corrected"] += int(spec.corrections_np[:n].astype(bool).sum())
        for row in np.flatnonzero(decoding):
            assert first_pos[row] == batch.num_tokens[row] - 1
            blocks = runner.requests[batch.req_ids[row]].block_ids[0]
            p = int(first_pos[row])
            slot = blocks[p // runner.block_size] * runner.block_size + p % runner.block_size
            assert batch.block_table.slot_mapping.np[starts[row]] == slot
            checked["rows"] += 1
        return out

    runner._prepare_inputs = spy_prepare
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = core.scheduler.make_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos[K - 1] > 0  # some passes accepted every draft
    assert checked["rows"] > 0 and checked["corrected"] > 0
    if "num_gpu_blocks_override" in setting:
        assert core.scheduler.num_preemptions > 0
    drain(core)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks and not core.scheduler.requests


def test_deferred_corrections_run_after_the_forward_pass_is_launched(reference):
    """An instrumented runner records the order of the diff, the forward pass and the
    corrections; during the forward pass the long-lived record still holds the scheduler's
    optimistic count, and the correction brings it to the real one."""
    folder, prompts, expected = reference("llama")
    llm = spec_llm(folder)
    runner = llm.engine_core.model_executor.driver_worker.model_runner
    oracle_drafts(runner, {tuple(p): e for p, e in zip(prompts, expected)})
    events = []
    update, forward = runner._update_states, runner.model.forward
    correct = runner.spec_decode.correct_counts

    def spy_update(so):
        fn = update(so)
        events.append(("diff", fn is not None))
        return fn

    def spy_forward(*a, **kw):
        events.append(("forward", None))
        return forward(*a, **kw)

    def spy_correct(batch, seq_lens, deferred):
        before = [(s.num_computed_tokens, c) for _, c, s in deferred]
        correct(batch, seq_lens, deferred)
        after = [s.num_computed_tokens for _, _, s in deferred]
        events.append(("correct", (before, after)))

    runner._update_states, runner.model.forward = spy_update, spy_forward
    runner.spec_decode.correct_counts = spy_correct
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    kinds = [k for k, _ in events]
    num_corrected = 0
    for i, (kind, value) in enumerate(events):
        if kind == "diff" and value:  # a pass with corrections: diff, forward, correct
            assert kinds[i + 1 : i + 3] == ["forward", "correct"]
            (before, after) = events[i + 2][1]
            assert all(b - c == a and c > 0 for (b, c), a in zip(before, after))
            num_corrected += 1
        if kind == "correct":
            assert kinds[i - 1] == "forward"
    assert num_corrected > 0


def test_stop_inside_an_accepted_run_and_seeded_sampling(reference):
    """Every oracle draft is right, so a stop token arrives inside a run of accepted drafts
    while the next step is already planned; the request ends there, its extra step is
    dropped and its blocks are freed once. Seeded random sampling repeats exactly."""
    folder, prompts, expected = reference("qwen3")
    llm = spec_llm(folder)
    core = llm.engine_core
    runner = core.model_executor.driver_worker.model_runner
    truth = {tuple(p): e for p, e in zip(prompts, expected)}

    def all_right(batch, rows):
        out = [[] for _ in range(batch.num_reqs)]
        for row in rows.tolist():
            state = runner.requests[batch.req_ids[row]]
            n = len(state.output_token_ids)
            out[row] = list(truth[tuple(state.prompt_token_ids)][n : n + K])
        return out

    runner.spec_decode.drafter.propose_for_batch = all_right
    stops = [e[7] for e in expected]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[s])
              for s in stops]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, exp, stop in zip(outs, expected, stops):
        cut = exp.index(stop) + 1
        assert out.outputs[0].token_ids == exp[:cut]
        assert out.outputs[0].finish_reason == "stop"
    assert core.scheduler.make_stats().spec_accepted_per_pos[K - 1] > 0
    drain(core)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks and not core.scheduler.requests
    assert not runner.requests  # the runner heard of every finished request

    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    fresh = spec_llm(folder)
    a = fresh.generate([{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)
    b = fresh.generate([{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
