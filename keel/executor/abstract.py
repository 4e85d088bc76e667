"""Executor: how a method call reaches the workers. It holds no model and decides nothing
about what is computed; `get_class` picks one, once, at start-up."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from keel.config import EngineConfig
from keel.core.sched_output import SchedulerOutput
from keel.outputs import ModelRunnerOutput
from keel.utils import resolve_obj_by_qualname


class Executor(ABC):
    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        executor_class: type[Executor]
        parallel_config = config.parallel_config
        # The default ("uni" at world size 1, else "mp") is set in EngineConfig.__post_init__.
        distributed_executor_backend = parallel_config.distributed_executor_backend

        if isinstance(distributed_executor_backend, type):
            if not issubclass(distributed_executor_backend, Executor):
                raise TypeError(
                    "distributed_executor_backend must be a subclass of Executor. "
                    f"Got {distributed_executor_backend}."
                )
            executor_class = distributed_executor_backend
        elif distributed_executor_backend == "ray":
            from keel.executor.ray_executor import RayDistributedExecutor

            executor_class = RayDistributedExecutor
        elif distributed_executor_backend == "mp":
            from keel.executor.multiproc import MultiprocExecutor

            executor_class = MultiprocExecutor
        elif distributed_executor_backend == "uni":
            from keel.executor.uniproc import UniProcExecutor

            executor_class = UniProcExecutor
        elif distributed_executor_backend == "external_launcher":
            from keel.executor.uniproc import ExecutorWithExternalLauncher

            executor_class = ExecutorWithExternalLauncher
        elif isinstance(distributed_executor_backend, str):
            executor_class = resolve_obj_by_qualname(distributed_executor_backend)
            if not (isinstance(executor_class, type) and issubclass(executor_class, Executor)):
                raise TypeError(
                    "distributed_executor_backend must be a subclass of Executor. "
                    f"Got {executor_class}."
                )
        else:
            raise ValueError(
                f"Unknown distributed executor backend: {distributed_executor_backend}"
            )
        return executor_class

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        single_value: bool = False,
    ) -> Any: ...

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may keep in flight: 2 with async scheduling (the next step is
        planned while this one runs), else 1."""
        return 2 if self.config.scheduler_config.async_scheduling else 1

    def initialize_kv_cache(self) -> int:
        """Size the KV cache (the smallest any worker can hold), allocate it everywhere."""
        num_blocks = min(self.collective_rpc("determine_num_blocks"))
        self.collective_rpc("initialize_kv_cache", args=(num_blocks,))
        return num_blocks

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future:
        return self.collective_rpc(
            "execute_model", args=(scheduler_output,), non_block=non_block, single_value=True
        )

    def sample_tokens(
        self, grammar_output: Any, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future:
        return self.collective_rpc(
            "sample_tokens", args=(grammar_output,), non_block=non_block, single_value=True
        )

    def shutdown(self) -> None:
        pass
