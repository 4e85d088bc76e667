"""Automatic prefix caching at the scheduler: block hashes, hits, the token left to compute,
partial blocks, n > 1 children, and reset_prefix_cache preempting the running requests."""

from __future__ import annotations

from keel.core.kv_cache_utils import hash_block_tokens, update_block_hashes
from keel.request import Request, RequestStatus
from keel.sampling_params import SamplingParams
from tests.core.test_scheduler import BLOCK, GREEDY, fake_step, free_blocks, make_scheduler


def req(req_id, prompt, max_tokens=4, sp=GREEDY) -> Request:
    return Request(req_id, list(prompt), sp, max_tokens=max_tokens)


def run_to_end(sched, limit=100):
    for _ in range(limit):
        if not sched.has_requests():
            return
        fake_step(sched)
    raise AssertionError("requests did not finish")


def test_block_hashes_chain_over_parents_and_cover_full_blocks_only():
    r = req("a", range(10))  # 2 full blocks of 4, 2 tokens left over
    update_block_hashes(r, BLOCK)
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert r.block_hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]
    r.output_token_ids += [10, 11]  # the third block fills up with output tokens
    update_block_hashes(r, BLOCK)
    assert r.block_hashes[2] == hash_block_tokens(r.block_hashes[1], [8, 9, 10, 11])
    # Same tokens under a different parent: a different hash.
    assert hash_block_tokens(b"x" * 32, [0, 1, 2, 3]) != h0


def test_second_request_computes_only_its_suffix():
    sched = make_scheduler(caching=True, max_model_len=128)
    shared = list(range(100, 140))  # 10 full blocks
    sched.add_request(req("a", shared + [1, 2, 3]))
    run_to_end(sched)  # a finished: its blocks are free but still cached
    sched.add_request(req("b", shared + [7, 8]))
    so, _ = fake_step(sched)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 40 and so.num_scheduled_tokens["b"] == 2
    assert sched.requests["b"].num_cached_tokens == 40
    stats = sched.make_stats()
    assert stats.prefix_cache_hits == 40 and stats.prefix_cache_queries == 43 + 42


def test_at_least_one_token_is_computed_and_partial_blocks_are_not_shared():
    sched = make_scheduler(caching=True)
    sched.add_request(req("a", range(12)))  # exactly 3 blocks
    run_to_end(sched)
    sched.add_request(req("b", range(12)))  # the same prompt: 2 blocks hit, last block redone
    so, _ = fake_step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens["b"] == 4
    run_to_end(sched)
    sched.add_request(req("c", range(6)))  # 1 full block + 2 tokens: only the full one
    so, _ = fake_step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4


def test_requests_in_the_same_step_share_blocks_and_prompt_logprobs_opt_out():
    sched = make_scheduler(caching=True)
    prompt = list(range(50, 63))  # 3 full blocks + 1
    sched.add_request(req("a", prompt))
    sched.add_request(req("b", prompt))  # like two children of an n=2 request
    sched.add_request(req("c", prompt, sp=SamplingParams(temperature=0, prompt_logprobs=1)))
    so, _ = fake_step(sched)
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    assert computed == {"a": 0, "b": 12, "c": 0}
    blocks = {r.req_id: r.block_ids[0] for r in so.scheduled_new_reqs}
    assert blocks["b"][:3] == blocks["a"][:3] and blocks["b"][3] != blocks["a"][3]
    assert not set(blocks["c"]) & set(blocks["a"])


def test_eviction_takes_the_least_recently_freed_block_and_tail_first():
    sched = make_scheduler(caching=True, num_blocks=8)
    kv = sched.kv_cache_manager

    def cached_tokens(prompt):
        probe = req("probe", prompt)
        update_block_hashes(probe, BLOCK)
        return kv.get_computed_blocks(probe)[1]

    sched.add_request(req("a", range(12), max_tokens=1))  # 3 full blocks
    run_to_end(sched)
    sched.add_request(req("b", range(100, 112), max_tokens=1))
    run_to_end(sched)
    # Free queue: the 2 never-used blocks, then a's (tail first), then b's (tail first).
    assert cached_tokens(list(range(12)) + [1]) == 12
    sched.add_request(req("c", range(200, 215), max_tokens=5))  # 4 blocks: 2 evictions
    fake_step(sched)
    # a's tail went first: its head block is still cached; b (freed later) is untouched.
    assert cached_tokens(list(range(12)) + [1]) == 4
    assert cached_tokens(list(range(100, 112)) + [1]) == 12
    # c's blocks are held: a hit on them does not free them, and nothing hands them out.
    held = set(kv.get_block_ids("c"))
    assert len(held) == 4 and not held & set(kv.block_pool.free_block_queue)


def test_reset_prefix_cache_preempts_running_requests_which_resume():
    sched = make_scheduler(caching=True)
    sched.add_request(req("a", range(20), max_tokens=10))
    sched.add_request(req("b", range(30, 45), max_tokens=10))
    fake_step(sched)
    fake_step(sched)
    assert sched.reset_prefix_cache() is False  # running requests hold blocks
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert not sched.running and all(r.status == RequestStatus.PREEMPTED
                                      for r in sched.waiting)
    assert free_blocks(sched) == sched.kv_cache_manager.block_pool.num_blocks
    assert not sched.kv_cache_manager.block_pool.cached_block_hash_to_block
    so, _ = fake_step(sched)
    assert so.scheduled_cached_reqs.resumed_req_ids == {"a", "b"}
    assert [r for r in so.scheduled_cached_reqs.num_computed_tokens] == [0, 0]  # recomputed
    run_to_end(sched)
    assert not sched.requests
