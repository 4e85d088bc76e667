"""Executor.get_class (every branch), the default backend, and UniProcExecutor.collective_rpc.

collective_rpc is tested on a UniProcExecutor built with object.__new__ around a fake worker, so
no model is loaded; one real LLM checks the object graph the engine core reaches through it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import ClassVar

import pytest

from keel import LLM, SamplingParams
from keel.config import EngineConfig, ModelConfig, ParallelConfig
from keel.executor.abstract import Executor
from keel.executor.multiproc import MultiprocExecutor
from keel.executor.ray_executor import RayDistributedExecutor
from keel.executor.uniproc import ExecutorWithExternalLauncher, UniProcExecutor
from keel.worker.input_batch import InputBatch
from keel.worker.model_runner import ModelRunner
from keel.worker.worker import Worker


@pytest.fixture(scope="module")
def model_config(hf_model_dir):
    return ModelConfig(hf_model_dir("llama"), dtype="float32", device="cpu", max_model_len=64)


def engine_config(model_config, backend=None, tp=1, pp=1) -> EngineConfig:
    return EngineConfig(
        model_config,
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp,
            distributed_executor_backend=backend,
        ),
    )


class MyExecutor(UniProcExecutor):
    pass


class NotAnExecutor:
    pass


# ---- the default, decided in EngineConfig.__post_init__ --------------------------------------


def test_default_backend_is_uni_at_world_size_one(model_config):
    cfg = engine_config(model_config)
    assert cfg.parallel_config.distributed_executor_backend == "uni"
    assert Executor.get_class(cfg) is UniProcExecutor


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_default_backend_is_mp_above_world_size_one(model_config, tp, pp):
    cfg = engine_config(model_config, tp=tp, pp=pp)
    assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert Executor.get_class(cfg) is MultiprocExecutor


def test_explicit_backend_is_kept(model_config):
    cfg = engine_config(model_config, backend="uni", tp=2)
    assert cfg.parallel_config.distributed_executor_backend == "uni"


def test_uni_refuses_more_than_one_rank(model_config):
    """It would run one unsharded worker and silently ignore the requested parallelism."""
    cfg = engine_config(model_config, backend="uni", tp=2)
    with pytest.raises(ValueError, match="runs one worker"):
        Executor.get_class(cfg)(cfg)


# ---- get_class, branch by branch -------------------------------------------------------------


def test_executor_subclass_type_is_used_as_is(model_config):
    assert Executor.get_class(engine_config(model_config, MyExecutor)) is MyExecutor


def test_non_executor_type_is_a_type_error(model_config):
    with pytest.raises(TypeError, match="must be a subclass of Executor"):
        Executor.get_class(engine_config(model_config, NotAnExecutor))


@pytest.mark.parametrize("backend,cls", [
    ("uni", UniProcExecutor),
    ("mp", MultiprocExecutor),
    ("ray", RayDistributedExecutor),
    ("external_launcher", ExecutorWithExternalLauncher),
])
def test_named_backends(model_config, backend, cls):
    resolved = Executor.get_class(engine_config(model_config, backend))
    assert resolved is cls
    assert issubclass(resolved, Executor)


def test_external_launcher_fails_clearly_at_construction(model_config):
    cfg = engine_config(model_config, "external_launcher")
    with pytest.raises(NotImplementedError) as exc:
        Executor.get_class(cfg)(cfg)
    msg = str(exc.value)
    assert "'external_launcher'" in msg and "not" in msg and "'mp'" in msg


class CountingExecutor(UniProcExecutor):
    """A user's own executor: every call still goes through collective_rpc."""

    calls: ClassVar[list] = []

    def collective_rpc(self, method, *args, **kwargs):
        CountingExecutor.calls.append(method if isinstance(method, str) else "<callable>")
        return super().collective_rpc(method, *args, **kwargs)


@pytest.mark.parametrize("backend", [CountingExecutor, f"{__name__}.CountingExecutor"])
def test_llm_uses_a_custom_executor_given_as_class_or_qualified_name(hf_model_dir, backend):
    CountingExecutor.calls.clear()
    llm = LLM(hf_model_dir("llama"), dtype="float32", distributed_executor_backend=backend)
    assert type(llm.engine_core.model_executor) is CountingExecutor
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert CountingExecutor.calls[:2] == ["init_device", "load_model"]
    assert CountingExecutor.calls.count("execute_model") == 3
    assert CountingExecutor.calls.count("sample_tokens") == 3


def test_qualified_name_resolves_to_executor_subclass(model_config):
    cfg = engine_config(model_config, "keel.executor.uniproc.UniProcExecutor")
    assert Executor.get_class(cfg) is UniProcExecutor
    cfg = engine_config(model_config, f"{__name__}.MyExecutor")
    assert Executor.get_class(cfg) is MyExecutor


@pytest.mark.parametrize("qualname", [
    "collections.OrderedDict",  # a class, not an Executor
    "keel.utils.configure_threads",  # not a class at all
    f"{__name__}.NotAnExecutor",
])
def test_qualified_name_of_non_executor_is_a_type_error(model_config, qualname):
    with pytest.raises(TypeError, match="must be a subclass of Executor"):
        Executor.get_class(engine_config(model_config, qualname))


def test_unqualified_unknown_name_is_a_value_error(model_config):
    # A string that is none of the named backends is read as a qualified name.
    with pytest.raises(ValueError, match="not a qualified name"):
        Executor.get_class(engine_config(model_config, "uniproc"))


@pytest.mark.parametrize("backend", [42, 3.5, ("uni",)])
def test_anything_else_is_a_value_error(model_config, backend):
    with pytest.raises(ValueError) as exc:
        Executor.get_class(engine_config(model_config, backend))
    assert str(exc.value) == f"Unknown distributed executor backend: {backend}"


# ---- UniProcExecutor.collective_rpc ----------------------------------------------------------


class FakeWorker:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.num_blocks = None

    def echo(self, a, b=0):
        self.calls.append(("echo", a, b))
        return (a, b)

    def boom(self):
        self.calls.append(("boom",))
        raise ValueError("worker exploded")

    def execute_model(self, scheduler_output):
        self.calls.append(("execute_model", scheduler_output))

    def sample_tokens(self, grammar_output):
        self.calls.append(("sample_tokens", grammar_output))
        return "tokens"

    def determine_num_blocks(self):
        return 123

    def initialize_kv_cache(self, num_blocks):
        self.num_blocks = num_blocks


@pytest.fixture
def executor():
    ex = object.__new__(UniProcExecutor)
    ex.config = None
    ex.driver_worker = FakeWorker()
    return ex


def test_blocking_call_returns_list_or_single_value(executor):
    assert executor.collective_rpc("echo", args=(1,), kwargs={"b": 2}) == [(1, 2)]
    assert executor.collective_rpc("echo", args=(3,), single_value=True) == (3, 0)
    assert executor.driver_worker.calls == [("echo", 1, 2), ("echo", 3, 0)]


def test_non_block_returns_done_future(executor):
    fut = executor.collective_rpc("echo", args=(5,), non_block=True, single_value=True)
    assert isinstance(fut, Future)
    assert fut.done()  # resolved before it is returned: the call already ran
    assert executor.driver_worker.calls == [("echo", 5, 0)]
    assert fut.result() == (5, 0)
    fut = executor.collective_rpc("echo", args=(6,), non_block=True)
    assert fut.result() == [(6, 0)]


def test_non_block_puts_exception_into_future(executor):
    fut = executor.collective_rpc("boom", non_block=True)  # does not raise here
    assert fut.done()
    assert isinstance(fut.exception(), ValueError)
    with pytest.raises(ValueError, match="worker exploded"):
        fut.result()
    # A blocking call raises at the call.
    with pytest.raises(ValueError, match="worker exploded"):
        executor.collective_rpc("boom")


def test_callable_method_gets_the_worker_first(executor):
    out = executor.collective_rpc(lambda w, x: (type(w).__name__, x), args=(9,))
    assert out == [("FakeWorker", 9)]


def test_execute_model_and_sample_tokens_are_single_valued(executor):
    fut = executor.execute_model("sched-out", non_block=True)
    assert fut.result() is None  # not [None]: the engine tests `is None`
    assert executor.sample_tokens("mask") == "tokens"
    assert executor.driver_worker.calls == [
        ("execute_model", "sched-out"), ("sample_tokens", "mask"),
    ]


def test_initialize_kv_cache_sizes_then_allocates(executor):
    assert executor.initialize_kv_cache() == 123
    assert executor.driver_worker.num_blocks == 123


# ---- one real engine --------------------------------------------------------------------------


def test_llm_reaches_the_runner_through_the_uniproc_executor(hf_model_dir):
    llm = LLM(hf_model_dir("llama"), dtype="float32", device="cpu", max_model_len=64,
              block_size=4, num_gpu_blocks_override=32, max_num_seqs=4)
    ex = llm.engine_core.model_executor
    assert type(ex) is UniProcExecutor
    assert isinstance(ex.driver_worker, Worker)
    runner = ex.driver_worker.model_runner
    assert isinstance(runner, ModelRunner)
    assert isinstance(runner.input_batch, InputBatch)
    assert runner.input_batch.max_num_reqs == 4
    assert llm.engine_core.scheduler.kv_cache_manager.block_pool.num_blocks == 32
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16
    # The batch outlived the pass: the finished request is cleaned on the next pass only.
    assert llm.engine_core.scheduler.has_requests()
    llm.engine_core.step()
    assert runner.input_batch.num_reqs == 0 and runner.requests == {}
    llm.shutdown()
