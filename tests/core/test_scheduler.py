"""The Scheduler alone (no model): ModelRunnerOutputs are built by hand.

`fake_step` plays the runner: every scheduled request whose computed count reaches its token
count after this pass gets one sampled token; requests still prefilling get an empty list.
"""

from __future__ import annotations

import pytest

from keel.config import CacheConfig, SchedulerConfig
from keel.core.scheduler import Scheduler
from keel.outputs import ModelRunnerOutput
from keel.request import Request, RequestStatus
from keel.sampling_params import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                   caching=False):
    """Prefix caching off by default: these prompts share their tokens (range(10, ...)), and
    the tests count blocks as if every request computed its own (test_prefix_caching.py has
    the cache's)."""
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=caching),
        num_blocks,
    )


def req(req_id, n_prompt, max_tokens=16, sp=GREEDY, eos=None) -> Request:
    return Request(req_id, list(range(10, 10 + n_prompt)), sp, eos_token_id=eos,
                   max_tokens=max_tokens)


def runner_output(sched: Scheduler, so, token=1) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests[rid]
        # schedule() already advanced num_computed_tokens past this pass.
        sampled.append([token(rid) if callable(token) else token]
                       if r.num_computed_tokens >= r.num_tokens else [])
    return ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, sampled)


def fake_step(sched: Scheduler, token=1):
    so = sched.schedule()
    out = sched.update_from_output(so, runner_output(sched, so, token))
    return so, out[0]


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


# ---- chunked prefill and ordering -------------------------------------------------------------


def test_chunked_prefill_spreads_a_long_prompt_and_shares_steps_with_decodes():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(req("a", 3, max_tokens=10))
    so, _ = fake_step(sched)
    assert so.num_scheduled_tokens == {"a": 3}
    sched.add_request(req("b", 20, max_tokens=2))
    chunks, computed_sent = [], []
    while "b" not in sched.requests or sched.requests["b"].num_computed_tokens < 20:
        so, out = fake_step(sched)
        assert so.total_num_scheduled_tokens <= 8
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.num_scheduled_tokens["a"] == 1  # the decode rides along every step
        chunks.append(so.num_scheduled_tokens["b"])
        if so.scheduled_new_reqs:
            computed_sent.append(so.scheduled_new_reqs[0].num_computed_tokens)
        else:
            i = so.scheduled_cached_reqs.req_ids.index("b")
            computed_sent.append(so.scheduled_cached_reqs.num_computed_tokens[i])
        new_tokens = {o.request_id: o.new_token_ids for o in out.outputs}
        # b gets no token until its prompt is complete.
        assert ("b" in new_tokens) == (sum(chunks) == 20)
    assert chunks == [7, 7, 6]
    assert computed_sent == [0, 7, 14]  # the runner gets the pre-step count
    assert sum(chunks) == 20
    # Blocks follow the chunks: b holds exactly what its computed tokens need.
    assert len(sched.kv_cache_manager.get_block_ids("b")) == 5


def test_running_requests_are_scheduled_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(req("a", 4))
    fake_step(sched)
    sched.add_request(req("b", 10))
    so, _ = fake_step(sched)
    # a's decode (1 token) first; b gets the rest of the budget, not all of it.
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    for rid, n in (("a", 2), ("b", 5), ("c", 3)):
        sched.add_request(req(rid, 4, max_tokens=n))
    so, _ = fake_step(sched)
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in sched.waiting] == ["c"]
    so, out = fake_step(sched)  # a finishes (2 tokens)
    assert out.finished_requests == {"a"}
    assert "c" not in so.num_scheduled_tokens
    so, _ = fake_step(sched)
    assert so.finished_req_ids == {"a"}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["c"]
    assert len(sched.running) == 2


# ---- preemption by recompute --------------------------------------------------------------------


def test_preemption_by_recompute_and_resume_with_whole_block_list():
    sched = make_scheduler(num_blocks=6)
    sched.add_request(req("a", 7, max_tokens=4))
    sched.add_request(req("b", 3, max_tokens=20))
    sched.add_request(req("c", 7, max_tokens=20))  # latest: the victim
    fake_step(sched)  # 2 + 1 + 2 blocks used, 1 free
    assert free_blocks(sched) == 1
    fake_step(sched)  # a decodes at position 7 (fits), b at 3, c at 7
    assert free_blocks(sched) == 1
    # Now a needs a 3rd block (position 8) and b a 2nd one (position 4): only 1 free.
    sched.add_request(req("d", 2, max_tokens=1))  # waiting behind
    blocks_before = sched.kv_cache_manager.get_block_ids("c")[:]
    assert len(blocks_before) == 2
    so, _ = fake_step(sched)
    victim = sched.requests["c"]
    assert sched.num_preemptions == 1
    assert victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1
    assert victim.output_token_ids == [1, 1]  # outputs are kept: they are recomputed
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # front of the queue
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}  # nothing new right after a preemption
    assert sched.kv_cache_manager.get_block_ids("c") == []
    assert [r.request_id for r in sched.running] == ["a", "b"]

    # a finishes (4 tokens) and frees its 3 blocks; then c is resumed.
    so, out = fake_step(sched)
    assert out.finished_requests == {"a"}
    so, _ = fake_step(sched)
    cached = so.scheduled_cached_reqs
    assert cached.resumed_req_ids == {"c"}
    assert "c" in cached.req_ids
    i = cached.req_ids.index("c")
    assert cached.num_computed_tokens[i] == 0
    assert so.num_scheduled_tokens["c"] == 9  # prompt 7 + 2 outputs, recomputed
    assert cached.new_block_ids[i] == (sched.kv_cache_manager.get_block_ids("c"),)
    assert len(cached.new_block_ids[i][0]) == 3
    assert not cached.resumed_req_ids & {r.req_id for r in so.scheduled_new_reqs}
    assert victim.status == RequestStatus.RUNNING


def test_victim_is_the_latest_running_request():
    sched = make_scheduler(num_blocks=3)
    sched.add_request(req("a", 4, max_tokens=20))
    sched.add_request(req("b", 3, max_tokens=20))
    sched.add_request(req("c", 3, max_tokens=20))
    fake_step(sched)  # one block each, none free
    so, _ = fake_step(sched)  # a needs a 2nd block (position 4); b and c still fit in theirs
    assert sched.requests["c"].status == RequestStatus.PREEMPTED  # the latest, not b
    assert sched.requests["b"].status == RequestStatus.RUNNING
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert sched.kv_cache_manager.get_block_ids("a") == [0, 2]  # c's freed block


def test_a_request_that_cannot_grow_preempts_itself_last():
    sched = make_scheduler(num_blocks=3)
    for rid in ("a", "b", "c"):
        sched.add_request(req(rid, 4, max_tokens=20))
    fake_step(sched)  # one block each, none free
    # Every request needs a 2nd block: c goes for a, then b (now the latest) for itself.
    so, _ = fake_step(sched)
    assert so.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.running] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.num_preemptions == 2


# ---- stopping -----------------------------------------------------------------------------------


def run_one(sched: Scheduler, request: Request, tokens: list[int]):
    sched.add_request(request)
    it = iter(tokens)
    outs = []
    while request.request_id in sched.requests:
        _, out = fake_step(sched, token=lambda rid: next(it))
        outs += out.outputs
    return outs


def test_stop_on_eos():
    sched = make_scheduler()
    outs = run_one(sched, req("a", 3, max_tokens=10, eos=2), [5, 6, 2, 7, 8])
    assert [t for o in outs for t in o.new_token_ids] == [5, 6, 2]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None
    assert sum(o.finished for o in outs) == 1
    assert free_blocks(sched) == 64
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()  # sent once


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    sp = SamplingParams(temperature=0.0, ignore_eos=True)
    outs = run_one(sched, req("a", 3, max_tokens=4, sp=sp, eos=2), [2, 2, 2, 2, 2, 2])
    assert [t for o in outs for t in o.new_token_ids] == [2, 2, 2, 2]
    assert outs[-1].finish_reason == "length"


def test_stop_token_ids():
    sched = make_scheduler()
    sp = SamplingParams(temperature=0.0, stop_token_ids=[7, 9])
    outs = run_one(sched, req("a", 3, max_tokens=10, sp=sp), [5, 9, 7])
    assert [t for o in outs for t in o.new_token_ids] == [5, 9]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == 9


def test_max_tokens_and_max_model_len():
    sched = make_scheduler()
    outs = run_one(sched, req("a", 3, max_tokens=3), [4] * 10)
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1]
    assert [o.finish_reason for o in outs] == [None, None, "length"]
    sched = make_scheduler(max_model_len=8)
    outs = run_one(sched, req("b", 5, max_tokens=100), [4] * 10)
    assert len(outs) == 3 and outs[-1].finish_reason == "length"


def test_abort_of_running_and_waiting_requests():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(req("a", 4))
    sched.add_request(req("b", 4))
    fake_step(sched)
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.has_requests()  # the finished ids still have to reach the runner
    assert free_blocks(sched) == 64
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.total_num_scheduled_tokens == 0
    assert not sched.has_requests()


def test_an_unresolved_block_size_is_refused():
    """CacheConfig leaves block_size to EngineConfig (config.default_block_size); a scheduler
    built from one it has not resolved (its KVCacheManager) says so instead of failing in the
    block arithmetic."""
    with pytest.raises(ValueError, match="block_size is unset"):
        Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                  CacheConfig(), 16)
