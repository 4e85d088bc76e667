"""The Ray executor on a local Ray instance: one actor per rank in a placement group, the same
collective_rpc contract as mp, the same tokens as uni, and nothing left running after it."""

from __future__ import annotations

import gc
import os
import signal
import time

import psutil
import pytest

from keel import LLM
from tests.executor.test_multiproc import GREEDY, PROMPTS, SEEDED, kill_mid_generate_and_check


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE}


def assert_no_new_processes(before: set[int], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        left = descendants() - before
        if not left:
            return
        time.sleep(0.2)
    names = [psutil.Process(p).name() for p in left if psutil.pid_exists(p)]
    raise AssertionError(f"processes left behind: {names}")


def actor_pids(llm: LLM) -> list[int]:
    return llm.engine_core.model_executor.collective_rpc(lambda worker: os.getpid())


def test_ray_tensor_parallel_equals_uni_and_surfaces_worker_errors(hf_model_dir):
    folder = hf_model_dir("llama")
    params = [GREEDY] * 3 + [SEEDED]
    expected = LLM(folder, dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    before = descendants()
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="ray")
    executor = llm.engine_core.model_executor
    assert type(executor).__name__ == "RayDistributedExecutor"
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    pids = actor_pids(llm)
    assert len(set(pids)) == 2 and os.getpid() not in pids  # two actor processes
    # Each actor froze its start-up heap (gc.freeze) once its KV cache was made.
    frozen = executor.collective_rpc(lambda worker: gc.get_freeze_count())
    assert all(n > 10_000 for n in frozen), frozen

    def boom(worker):
        raise ValueError(f"boom on rank {worker.rank}")

    future = executor.collective_rpc(boom, non_block=True, unique_reply_rank=1)
    with pytest.raises(RuntimeError, match=r"Worker failed with error 'ValueError: boom on "
                                           r"rank 1', please check the stack trace above"):
        future.result()
    assert executor.collective_rpc("get_rank") == [0, 1]  # and they go on serving

    def fail_as_peer_dies(worker):
        # Rank 0 fails first, as in a collective whose peer is gone; Ray reports rank 1's
        # death only later. The call must still blame the death and fail the executor.
        if worker.rank == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        raise ConnectionError("peer closed the connection")

    with pytest.raises(RuntimeError, match="Ray actor of rank 1 died"):
        executor.collective_rpc(fail_as_peer_dies)
    assert executor.is_failed
    llm.close()
    assert_no_new_processes(before)


def test_killed_ray_actor_fails_generate_quickly_and_leaves_nothing(hf_model_dir):
    before = descendants()
    llm = LLM(hf_model_dir("llama"), dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="ray")
    kill_mid_generate_and_check(llm, actor_pids(llm)[1])
    llm.close()
    assert_no_new_processes(before)
