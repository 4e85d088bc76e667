"""The mp executor on the CPU: worker processes with gloo, tensor parallelism across them, the
seed's collective_rpc contract, and no process left behind whatever happens."""

from __future__ import annotations

import gc
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
    # Each worker froze its start-up heap (gc.freeze) once its KV cache was made.
    frozen = executor.collective_rpc(lambda worker: gc.get_freeze_count())
    assert all(n > 10_000 for n in frozen), frozen
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


def kill_mid_generate_and_check(llm: LLM, pid: int) -> None:
    """SIGKILL `pid` at the third step of a long generate: the call must raise within 10 s
    of the kill, and the executor refuse every later call."""
    core = llm.engine_core
    real_step = core.step
    steps = {"n": 0}

    def step_then_kill():
        steps["n"] += 1
        if steps["n"] == 3:  # in the middle of generate
            os.kill(pid, signal.SIGKILL)
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


def test_killed_worker_fails_generate_quickly_and_leaves_nothing(hf_model_dir):
    llm = LLM(hf_model_dir("llama"), dtype="float32", tensor_parallel_size=2)
    pids = worker_pids(llm)
    kill_mid_generate_and_check(llm, pids[1])
    llm.close()
    assert_gone(pids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # 3 layers untied; 2 layers tied
def test_pipeline_parallel_outputs_equal_uni(hf_model_dir, arch):
    folder = hf_model_dir(arch)
    params = [GREEDY] * 3 + [SEEDED]
    # A small token budget: prompts are chunked, so a stage receives prefills that start
    # mid-prompt and decodes side by side with them.
    kwargs = dict(dtype="float32", max_num_batched_tokens=32)
    expected = LLM(folder, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(folder, pipeline_parallel_size=2, **kwargs)
    executor = llm.engine_core.model_executor
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    # The first stage never samples: it embeds each decode's token from the ids the
    # scheduler sends back in new_token_ids, so equal tokens show that path too.
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]

    def layout(worker):
        model = worker.model_runner.model
        has = [type(layer).__name__ != "PPMissingLayer" for layer in model.model.layers]
        return has, type(model.lm_head).__name__, len(worker.model_runner.kv_caches)

    layers = llm.config.model_config.hf_config.num_hidden_layers
    (first, head0, caches0), (last, head1, caches1) = executor.collective_rpc(layout)
    # Every layer on exactly one stage; the KV cache only for a stage's own layers; the
    # logits only on the last stage.
    assert [a != b for a, b in zip(first, last)] == [True] * layers and first[0] and last[-1]
    assert caches0 + caches1 == layers and caches0 == sum(first)
    assert (head0, head1) == ("PPMissingLayer", "ParallelLMHead")
    pids = worker_pids(llm)
    llm.close()
    assert_gone(pids)


def test_tensor_and_pipeline_parallel_together(hf_model_dir):
    """TP=2 x PP=2 (4 processes on 2 cores, one thread each): still the same tokens."""
    folder = hf_model_dir("llama")
    expected = LLM(folder, dtype="float32").generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2)
    got = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    ranks = llm.engine_core.model_executor.collective_rpc(
        lambda w: (w.rank, w.model_runner.model.model.layers[0].self_attn.num_heads
                   if w.rank < 2 else None))
    heads = llm.config.model_config.hf_config.num_attention_heads // 2
    assert ranks == [(0, heads), (1, heads), (2, None), (3, None)]
    pids = worker_pids(llm)
    llm.close()
    assert_gone(pids)


def test_pipeline_larger_than_the_model_is_refused_before_starting_anything(hf_model_dir):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 is more than the model's 3"):
        LLM(hf_model_dir("llama"), dtype="float32", pipeline_parallel_size=4)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_gguf_kept_quantized_with_tensor_parallelism():
    """The default model's GGUF file, its 4-bit weights kept quantized and cut per rank
    (SmolLM2-135M has 9 heads: 3 ranks), continues a chat prompt as one process does."""
    from keel.model_executor.layers.quantization import Int4Weight

    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    sp = SamplingParams(temperature=0, max_tokens=12)
    single = LLM(max_num_seqs=1)
    expected = single.chat(prompt, sp, use_tqdm=False)[0].outputs[0]
    single.close()
    llm = LLM(max_num_seqs=1, tensor_parallel_size=3)
    executor = llm.engine_core.model_executor

    def qkv(worker):
        w = worker.model_runner.model.model.layers[0].self_attn.qkv_proj.quant
        return type(w).__name__, w.out_features, w.in_features

    got = llm.chat(prompt, sp, use_tqdm=False)[0].outputs[0]
    shapes = executor.collective_rpc(qkv)
    pids = worker_pids(llm)
    llm.close()
    assert_gone(pids)
    assert shapes == [(Int4Weight.__name__, (9 + 2 * 3) * 64 // 3, 576)] * 3
    assert got.token_ids == expected.token_ids
    assert "Paris" in got.text


def test_float16_gemms_with_tensor_parallelism(hf_model_dir, monkeypatch):
    """dtype="auto" for a float32 model on a CPU without AMX (as ModelConfig decides it, carried
    to the workers): with AVX512-FP16 (else AVX512-VNNI) each rank packs its own shard for
    fp16_gemm (else i16_gemm; the [gate; up] shard interleaved for the SiLU epilogue), and
    two ranks give one process's
    greedy tokens, their log-probabilities within the float16 roundings' little (each rank
    scales and rounds its own half of x and of the weights)."""
    from keel import dtypes
    from keel.model_executor.layers import gemm_choice

    monkeypatch.setattr(dtypes, "cpu_has_amx_bfloat16", lambda: False)
    # Each rank's process would time fp16_gemm against the float32 GEMM itself: on a noisy
    # host a rank could keep float32 (the engine's choice; not what this test is about).
    monkeypatch.setenv("KEEL_FP16_GEMM", "1")
    folder = hf_model_dir("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = {}
    for tp in (1, 2):
        llm = LLM(folder, dtype="auto", tensor_parallel_size=tp, kv_cache_memory_gib=0.0625)
        assert llm.config.model_config.float16_gemms
        packed = llm.engine_core.model_executor.collective_rpc(
            lambda worker: sorted({(m.packed_by, getattr(m, "fp16_silu", False)) for m in
                                   worker.model_runner.model.modules() if
                                   getattr(m, "packed_by", "")}))
        outs = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
        runs[tp] = [(list(o.outputs[0].token_ids),
                     [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                    for o in outs]
        llm.close()
        low = gemm_choice.low_precision_kind()  # fp16, else i16, else None
        if low is not None:
            assert packed == [[(low, False), (low, True)]] * tp, packed
        else:
            assert all(kind not in ("fp16", "i16") for p in packed for kind, _ in p), packed
    for (tok1, lp1), (tok2, lp2) in zip(runs[1], runs[2]):
        assert tok1 == tok2
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 0.05


def test_a_workers_error_with_a_dead_peer_marks_the_executor_failed():
    """A surviving worker can report its collective's error (the dead peer's connection reset)
    before the monitor thread sees the death: the error path itself then marks the executor
    failed, so the caller sees one state whichever noticed first. With every worker alive, an
    error leaves it serving."""
    import multiprocessing
    import threading
    import types

    from keel.executor.multiproc import MultiprocExecutor

    ctx = multiprocessing.get_context("spawn")
    done = ctx.Process(target=time.sleep, args=(0,), name="keel-worker-1")
    alive = ctx.Process(target=time.sleep, args=(30,), name="keel-worker-0")
    done.start()
    alive.start()
    try:
        done.join()
        fake = types.SimpleNamespace(processes=[alive], is_failed=False,
                                     _stopping=threading.Event())
        MultiprocExecutor._fail_if_a_worker_died(fake)  # every worker alive
        assert not fake.is_failed
        fake.processes = [alive, done]
        MultiprocExecutor._fail_if_a_worker_died(fake)
        assert fake.is_failed and "keel-worker-1" in fake._death
    finally:
        alive.kill()
        alive.join()
