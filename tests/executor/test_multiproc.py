"""The mp executor on the CPU: worker processes with gloo, tensor parallelism across them, the
seed's collective_rpc contract, and no process left behind whatever happens."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from keel import LLM, SamplingParams
from tests.model_executor.test_models import random_prompt

PROMPTS = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (5, 17, 33, 48)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine_core.model_executor.processes]


def assert_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"worker processes still running: {alive}")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tensor_parallel_outputs_equal_uni(hf_model_dir, arch):
    folder = hf_model_dir(arch)
    expected = LLM(folder, dtype="float32").generate(PROMPTS, [GREEDY] * 3 + [SEEDED],
                                                     use_tqdm=False)
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2)
    executor = llm.engine_core.model_executor
    assert type(executor).__name__ == "MultiprocExecutor" and len(executor.processes) == 2
    got = llm.generate(PROMPTS, [GREEDY] * 3 + [SEEDED], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    # Each rank holds half of the attention heads (a callable travels by cloudpickle).
    heads = executor.collective_rpc(
        lambda worker: worker.model_runner.model.model.layers[0].self_attn.num_heads)
    assert heads == [llm.config.model_config.hf_config.num_attention_heads // 2] * 2
    pids = worker_pids(llm)
    llm.close()
    assert_gone(pids)


def test_worker_exception_surfaces_at_future_result(hf_model_dir):
    llm = LLM(hf_model_dir("llama"), dtype="float32", tensor_parallel_size=2)
    executor = llm.engine_core.model_executor

    def boom(worker):
        raise ValueError(f"boom on rank {worker.rank}")

    future = executor.collective_rpc(boom, non_block=True, unique_reply_rank=1)
    with pytest.raises(RuntimeError, match=r"Worker failed with error 'ValueError: boom on "
                                           r"rank 1', please check the stack trace above"):
        future.result()
    # The workers go on serving.
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16
    assert executor.collective_rpc(lambda worker: worker.rank) == [0, 1]
    pids = worker_pids(llm)
    del llm, executor, out, future
    import gc

    gc.collect()
    assert_gone(pids)


def test_killed_worker_fails_generate_quickly_and_leaves_nothing(hf_model_dir):
    llm = LLM(hf_model_dir("llama"), dtype="float32", tensor_parallel_size=2)
    pids = worker_pids(llm)
    core = llm.engine_core
    real_step = core.step
    steps = {"n": 0}

    def step_then_kill():
        steps["n"] += 1
        if steps["n"] == 3:  # in the middle of generate
            os.kill(pids[1], signal.SIGKILL)
            steps["killed_at"] = time.monotonic()
        return real_step()

    core.step = step_then_kill
    with pytest.raises(RuntimeError, match="Worker failed|Executor failed"):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                     use_tqdm=False)
    assert time.monotonic() - steps["killed_at"] < 10
    assert core.model_executor.is_failed
    with pytest.raises(RuntimeError, match="Executor failed"):
        core.model_executor.collective_rpc("determine_num_blocks")
    llm.close()
    assert_gone(pids)


def test_pipeline_parallel_is_refused_before_starting_anything(hf_model_dir):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size > 1"):
        LLM(hf_model_dir("llama"), dtype="float32", pipeline_parallel_size=2)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before
