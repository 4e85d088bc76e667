"""AsyncLLM: the asyncio front end of a server. The engine core runs its busy loop in its own
process (EngineCoreClient); this process tokenizes, detokenizes (the same OutputProcessor as
`LLM`) and hands each request's outputs to whoever awaits them.

    async for output in engine.generate(prompt, params, request_id):
        ...  # RequestOutput: deltas when params.output_kind is DELTA

    output = await engine.encode(prompt, PoolingParams(), request_id)  # a pooling model

A caller that stops iterating (a client that disconnects, a cancelled task) aborts its
request: the engine stops generating for it and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from keel.config import EngineConfig
from keel.engine.arg_utils import EngineArgs
from keel.engine.core_client import EngineCoreClient, EngineDeadError
from keel.engine.input_processor import InputProcessor, ProcessedPrompt
from keel.engine.llm import load_tokenizer
from keel.engine.output_processor import OutputProcessor
from keel.outputs import EngineCoreOutputs, PoolingRequestOutput, RequestOutput, SchedulerStats
from keel.pooling_params import PoolingParams
from keel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: list[Any] | None = None) -> None:
        self.config = config
        self.model_config = config.model_config
        # The front end never spins OpenMP threads: the engine process owns the cores.
        import torch

        torch.set_num_threads(1)
        self.tokenizer = load_tokenizer(config.model_config.model_path,
                                        config.model_config.hf_config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers or [])
        self.scheduler_stats = SchedulerStats()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._request_counter = itertools.count()
        self.engine_core = EngineCoreClient(config, self._outputs_from_thread,
                                            self._dead_from_thread)
        logger.info("Engine core ready in process %d (%s)", self.engine_core.proc.pid,
                    self.engine_core.ready_info)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: str = "engine_context",
                         **kwargs: Any) -> AsyncLLM:
        return cls(engine_args.create_engine_config(usage_context), **kwargs)

    # ---- state --------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self.engine_core.dead_reason is not None

    def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(self.engine_core.dead_reason)

    def get_num_unfinished_requests(self) -> int:
        return len(self._queues)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, prompt: str | dict, sampling_params: SamplingParams,
                    request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Check and add a request now (bad input raises ValueError/TypeError here, before
        anything reaches the engine); returns the iterator of its RequestOutputs. Closing the
        iterator before the request finished aborts it."""
        request_id = self._new_request_id(request_id)
        processed = self.input_processor.process_prompt(request_id, prompt, sampling_params)
        return self._submit(processed)

    def add_pooling_request(self, prompt: str | dict, pooling_params: PoolingParams,
                            request_id: str | None = None
                            ) -> AsyncIterator[PoolingRequestOutput]:
        """`add_request` for a pooling model: checked now (ValueError/TypeError before anything
        reaches the engine); the iterator yields the one, final PoolingRequestOutput."""
        request_id = self._new_request_id(request_id)
        processed = self.input_processor.process_pooling(request_id, prompt, pooling_params)
        return self._submit(processed)

    def _new_request_id(self, request_id: str | None) -> str:
        self._loop = asyncio.get_running_loop()
        self.check_health()
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        if request_id in self._queues:
            raise ValueError(f"Request id {request_id!r} is already running.")
        return request_id

    def _submit(self, processed: ProcessedPrompt
                ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[processed.request_id] = queue
        now = time.monotonic()
        for index, request in enumerate(processed.requests):
            self.output_processor.add_request(request, processed.prompt, processed.parent, index)
            for stat_logger in self.stat_loggers:
                stat_logger.record_request_added(request.request_id,
                                                 len(request.prompt_token_ids), now)
            self.engine_core.add_request(request)
        return self._outputs_of(processed.request_id, queue)

    async def _outputs_of(self, request_id: str, queue: asyncio.Queue
                          ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the caller went away (disconnect, cancel) or the engine died
                self.abort(request_id)

    async def generate(self, prompt: str | dict, sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its RequestOutputs until it finishes."""
        outputs = self.add_request(prompt, sampling_params, request_id)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()

    async def encode(self, prompt: str | dict, pooling_params: PoolingParams,
                     request_id: str | None = None) -> PoolingRequestOutput:
        """Embed one prompt with a pooling model: its PoolingRequestOutput (`outputs.data`, a
        tensor). A bad request raises ValueError/TypeError before it reaches the engine."""
        outputs = self.add_pooling_request(prompt, pooling_params, request_id)
        final = None
        try:
            async for output in outputs:
                final = output
        finally:
            await outputs.aclose()
        assert final is not None and final.finished
        return final

    def abort(self, request_id: str) -> None:
        """Stop a request (its children too, for n > 1); unknown or finished ids are ignored."""
        engine_ids = self.output_processor.abort_requests([request_id])
        if not engine_ids:
            return
        for stat_logger in self.stat_loggers:
            stat_logger.record_aborted(engine_ids)
        if not self.errored:
            self.engine_core.abort_requests(engine_ids)
        logger.info("Aborted request %s", request_id)

    async def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache (running requests are preempted and resume)."""
        return await asyncio.wrap_future(self.engine_core.call_utility("reset_prefix_cache"))

    async def get_stats(self) -> SchedulerStats:
        """The engine's scheduler state, asked of the engine process now."""
        return await asyncio.wrap_future(self.engine_core.call_utility("get_stats"))

    # ---- outputs, on the event loop -----------------------------------------------------------

    def _outputs_from_thread(self, outputs: EngineCoreOutputs) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            self._process_outputs(outputs)  # nobody awaits: bookkeeping only
            return
        loop.call_soon_threadsafe(self._process_outputs, outputs)

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.monotonic()
        result = self.output_processor.process_outputs(outputs.outputs)
        for request_output in result.request_outputs:
            queue = self._queues.get(request_output.request_id)
            if queue is not None:
                queue.put_nowait(request_output)
        if result.reqs_to_abort:  # a stop string ended them here: free them in the engine
            self.engine_core.abort_requests(result.reqs_to_abort)
        if outputs.scheduler_stats is not None:
            self.scheduler_stats = outputs.scheduler_stats
        for stat_logger in self.stat_loggers:
            stat_logger.record_outputs(outputs, result.reqs_to_abort, now)

    def _dead_from_thread(self, reason: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._fail_all, reason)

    def _fail_all(self, reason: str) -> None:
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(f"The engine failed: {reason}"))

    def shutdown(self) -> None:
        self.engine_core.shutdown()
