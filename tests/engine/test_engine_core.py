"""EngineCore.step: the seed's loop body, observed from outside.

One engine core per module, with a deliberately small KV cache (10 blocks of 4 tokens) and a
16-token budget, so that concurrent requests are chunked and preempted.
"""

from __future__ import annotations

import gc
import inspect
from collections import Counter, defaultdict

import pytest

import keel.engine.core
from keel.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from keel.engine.core import EngineCore, EngineCoreProc
from keel.outputs import EngineCoreOutputs
from keel.request import Request
from keel.sampling_params import SamplingParams

NUM_BLOCKS = 10
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def core(hf_model_dir):
    config = EngineConfig(
        ModelConfig(hf_model_dir("llama"), dtype="float32", device="cpu", max_model_len=32),
        CacheConfig(block_size=4, num_gpu_blocks_override=NUM_BLOCKS),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
    )
    core = EngineCore(config)
    yield core
    core.shutdown()


@pytest.fixture
def idle_core(core):
    """The shared core, checked idle before and drained after each test."""
    assert not core.scheduler.has_requests()
    yield core
    drain(core)
    assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS


def runner_of(core: EngineCore):
    # Tests may reach the runner; the engine core itself never does.
    return core.model_executor.driver_worker.model_runner


def request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(req_id, list(prompt), GREEDY, eos_token_id=None, max_tokens=max_tokens)


def prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 300 + 2 for i in range(n)]


def drain(core: EngineCore, limit: int = 500) -> list[dict]:
    steps = []
    for _ in range(limit):
        out, busy = core.step()
        if out == {} and not busy:
            return steps
        steps.append(out)
    raise AssertionError("engine did not go idle")


def collect(steps: list[dict]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = defaultdict(list)
    for out in steps:
        for o in out[0].outputs:
            tokens[o.request_id] += o.new_token_ids
    return dict(tokens)


def alone(core: EngineCore, prompt_ids: list[int], max_tokens: int, tag: str) -> list[int]:
    core.add_request(request(f"alone-{tag}", prompt_ids, max_tokens))
    return collect(drain(core))[f"alone-{tag}"]


def test_step_without_requests(idle_core):
    assert idle_core.step() == ({}, False)


def test_step_with_requests(idle_core):
    idle_core.add_request(request("a", prompt(5, 1), 3))
    idle_core.add_request(request("b", prompt(4, 2), 3))
    out, busy = idle_core.step()
    assert busy is True
    assert list(out) == [0]
    assert isinstance(out[0], EngineCoreOutputs)
    assert {o.request_id: len(o.new_token_ids) for o in out[0].outputs} == {"a": 1, "b": 1}
    assert all(o.finish_reason is None for o in out[0].outputs)
    assert out[0].finished_requests == set()


def test_finished_requests_reported_exactly_once(idle_core):
    lengths = {"a": 2, "b": 4, "c": 6}
    for i, (rid, n) in enumerate(lengths.items()):
        idle_core.add_request(request(rid, prompt(3 + i, 10 * i), n))
    steps = drain(idle_core)
    finishes: Counter[str] = Counter()
    seen_after_finish = []
    done: set[str] = set()
    for out in steps:
        outs = out[0].outputs
        seen_after_finish += [o.request_id for o in outs if o.request_id in done]
        finished_here = {o.request_id for o in outs if o.finish_reason is not None}
        assert out[0].finished_requests == finished_here
        finishes.update(finished_here)
        done |= finished_here
    assert finishes == Counter({"a": 1, "b": 1, "c": 1})
    assert seen_after_finish == []
    assert {rid: len(t) for rid, t in collect(steps).items()} == lengths
    # The last step only sent the last finished id down to the runner: it scheduled nothing.
    assert steps[-1][0].outputs == []
    runner = runner_of(idle_core)
    assert runner.requests == {} and runner.input_batch.num_reqs == 0


def test_abort_frees_blocks_and_the_runner_drops_the_request(idle_core, monkeypatch):
    core = idle_core
    pool = core.scheduler.kv_cache_manager.block_pool
    ex = core.model_executor
    sent = []
    real_execute = ex.execute_model

    def recording(scheduler_output, non_block=False):
        sent.append(scheduler_output)
        return real_execute(scheduler_output, non_block=non_block)

    monkeypatch.setattr(ex, "execute_model", recording)
    pa, pb = prompt(6, 3), prompt(5, 4)
    core.add_request(request("a", pa, 10))
    core.add_request(request("b", pb, 6))
    core.step()
    core.step()
    runner = runner_of(core)
    assert {"a", "b"} <= runner.input_batch.req_id_to_index.keys()
    held_by_b = len(core.scheduler.kv_cache_manager.get_block_ids("b"))

    core.abort_requests(["a"])
    assert "a" not in core.scheduler.requests
    assert pool.get_num_free_blocks() == NUM_BLOCKS - held_by_b
    assert "a" in runner.requests  # the runner learns on the next pass, not before

    out, busy = core.step()
    assert busy
    assert sent[-1].finished_req_ids == {"a"}
    assert "a" not in sent[-1].num_scheduled_tokens
    assert "a" not in runner.requests and "a" not in runner.input_batch.req_id_to_index
    assert [o.request_id for o in out[0].outputs] == ["b"]
    rest = drain(core)
    assert "a" not in collect(rest)
    assert all(not so.finished_req_ids & {"a"} for so in sent[-len(rest):])  # sent once
    assert pool.get_num_free_blocks() == NUM_BLOCKS
    monkeypatch.undo()
    # b was not disturbed by a's abort.
    b_tokens = [*collect([out])["b"], *collect(rest)["b"]]
    assert len(b_tokens) == 4  # two tokens came in the first two steps
    assert alone(core, pb, 6, "b")[2:] == b_tokens


def test_abort_arriving_during_a_step(idle_core):
    core = idle_core
    core.add_request(request("a", prompt(5, 5), 8))
    core.add_request(request("b", prompt(5, 6), 3))
    core.step()
    # Queued from "another thread"; processed after the forward pass, before the outputs.
    core.aborts_queue.put(["a"])
    out, busy = core.step()
    assert busy
    assert [o.request_id for o in out[0].outputs] == ["b"]
    assert "a" not in core.scheduler.requests
    core.step()
    assert "a" not in runner_of(core).requests


def test_cleanup_only_step_after_aborting_the_last_request(idle_core):
    core = idle_core
    core.add_request(request("a", prompt(5, 7), 8))
    core.step()
    core.abort_requests(["a"])
    assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS
    core.abort_requests(["a"])  # already finished: ignored
    assert core.scheduler.has_requests()  # its id still has to reach the runner
    out, busy = core.step()  # schedules nothing, runs no model, cleans the batch
    assert busy is False
    assert out == {0: EngineCoreOutputs([], set())}
    assert runner_of(core).requests == {}
    assert core.step() == ({}, False)


def test_preemption_and_chunking_do_not_change_outputs(idle_core):
    core = idle_core
    prompts = {f"r{i}": prompt(10, 20 + i) for i in range(3)}
    refs = {rid: alone(core, p, 12, rid) for rid, p in prompts.items()}
    preemptions_before = core.scheduler.num_preemptions
    for rid, p in prompts.items():
        core.add_request(request(rid, p, 12))
    tokens = collect(drain(core))
    # 3 x 6 blocks needed, 10 in the pool: someone was preempted and recomputed.
    assert core.scheduler.num_preemptions > preemptions_before
    assert tokens == refs


def test_seeded_request_keeps_its_generator_when_its_row_moves(idle_core):
    core = idle_core
    px = prompt(5, 30)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    core.add_request(Request("x-alone", px, seeded, max_tokens=6))
    ref = collect(drain(core))["x-alone"]
    # o takes row 0 and finishes first; condense then moves x (and its generator) to row 0.
    core.add_request(request("o", prompt(5, 31), 2))
    core.add_request(Request("x", px, SamplingParams(temperature=1.0, seed=1234), max_tokens=6))
    runner = runner_of(core)
    steps = [core.step()[0]]
    assert runner.input_batch.req_id_to_index == {"o": 0, "x": 1}
    steps += [core.step()[0]]  # o's last token
    steps += [core.step()[0]]  # o is dropped from the batch: x moves down
    assert runner.input_batch.req_id_to_index == {"x": 0}
    assert 0 in runner.input_batch.generators and 1 not in runner.input_batch.generators
    steps += drain(core)
    assert collect(steps)["x"] == ref
    greedy = alone(core, px, 6, "x-greedy")
    assert ref != greedy  # the seed, not argmax, decided these tokens


def test_engine_core_never_names_the_model_runner():
    source = inspect.getsource(keel.engine.core)
    assert "model_runner" not in source
    assert "ModelRunner" not in source


def test_engine_core_process_freezes_its_start_up_heap(hf_model_dir):
    """The engine core's own process (`keel serve`) moves its start-up heap into Python's
    permanent generation, so that a full collection does not walk the model's objects; an
    in-process EngineCore (an `LLM` a user may drop) does not."""
    def config() -> EngineConfig:
        return EngineConfig(
            ModelConfig(hf_model_dir("llama"), dtype="float32", device="cpu", max_model_len=32),
            CacheConfig(block_size=4, num_gpu_blocks_override=NUM_BLOCKS),
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        )

    gc.unfreeze()
    plain = EngineCore(config())
    try:
        assert gc.get_freeze_count() == 0
    finally:
        plain.shutdown()
    engine = EngineCoreProc(config(), "inproc://keel-test-in", "inproc://keel-test-out")
    try:
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()  # the rest of the suite runs in this process
        engine.shutdown()
