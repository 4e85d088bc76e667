"""EngineCore: the loop. One `step()` is the seed's body, line for line; it never names the
model runner, only the executor."""

from __future__ import annotations

import logging
import queue
import time

from keel.config import EngineConfig
from keel.core.scheduler import Scheduler
from keel.executor.abstract import Executor
from keel.outputs import EngineCoreOutputs
from keel.request import Request, RequestStatus
from keel.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None):
        self.config = config
        if executor_class is None:
            executor_class = Executor.get_class(config)  # once, at start-up
        self.model_executor = executor_class(config)
        num_blocks = self.model_executor.initialize_kv_cache()
        config.cache_config.num_blocks = num_blocks
        self.structured_output_manager = StructuredOutputManager(config)
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, num_blocks,
            self.structured_output_manager,
            pipeline_parallel=config.parallel_config.pipeline_parallel_size > 1,
        )
        # Aborts that arrive from another thread while a step runs (a server's input thread).
        self.aborts_queue: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self.first_token_time: float | None = None  # time.monotonic() of the first sample

    def add_request(self, request: Request) -> None:
        if request.use_structured_output:
            self.structured_output_manager.grammar_init(request)  # compiles in the background
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _process_aborts_queue(self) -> None:
        while True:
            try:
                ids = self.aborts_queue.get_nowait()
            except queue.Empty:
                return
            self.abort_requests(ids)

    def _should_throttle_prefills(self) -> bool:
        return False

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        if not self.scheduler.has_requests():
            return {}, False
        scheduler_output = self.scheduler.schedule(self._should_throttle_prefills())
        future = self.model_executor.execute_model(scheduler_output, non_block=True)
        grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)

        model_output = future.result()
        if model_output is None:
            model_output = self.model_executor.sample_tokens(grammar_output)

        self._process_aborts_queue()
        engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.first_token_time is None and any(model_output.sampled_token_ids):
            self.first_token_time = time.monotonic()
        return engine_core_outputs, scheduler_output.total_num_scheduled_tokens > 0

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
