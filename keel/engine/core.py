"""EngineCore: the loop. One `step()` is the seed's body, line for line; it never names the
model runner, only the executor."""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections import deque
from typing import Any

from keel.config import EngineConfig
from keel.core.scheduler import Scheduler
from keel.executor.abstract import Executor
from keel.outputs import EngineCoreOutputs, SchedulerStats
from keel.request import Request, RequestStatus
from keel.structured_output import StructuredOutputManager
from keel.trace.recorder import TraceWriter, trace_meta
from keel.utils import freeze_startup_heap

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
            speculative_config=config.speculative_config,
        )
        # Async scheduling: up to max_concurrent_batches steps in flight, oldest last.
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        self.batch_queue: deque | None = deque() if self.batch_queue_size > 1 else None
        # Aborts that arrive from another thread while a step runs (a server's input thread).
        self.aborts_queue: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self.first_token_time: float | None = None  # time.monotonic() of the first sample
        # Tracing (keel/trace/): one JSON line per step, written around the scheduler's two
        # calls so that step() keeps the seed's shape; None when off (the default).
        self.trace = None
        if config.trace_path is not None:
            self.trace = TraceWriter(config.trace_path, trace_meta(config))
            self.trace.instrument(self.scheduler)

    def add_request(self, request: Request) -> None:
        if request.use_structured_output:
            self.structured_output_manager.grammar_init(request)  # compiles in the background
        self.scheduler.add_request(request)

    def reset_prefix_cache(self, reset_running_requests: bool = True) -> bool:
        """Empty the prefix cache, preempting running requests first (they resume later)."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

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

    def step_fn(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """What the loops call: `step` (the seed's body), or with async scheduling
        `step_with_batch_queue`. Chosen by configuration, not per step."""
        return self.step() if self.batch_queue is None else self.step_with_batch_queue()

    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Async scheduling: schedule and launch a step (execute_model and sample_tokens, both
        non-blocking) while the previous one may still run; return the outputs of the oldest
        step in flight once the queue is full or nothing more can be scheduled. The scheduler
        plans with placeholders for the tokens still in flight; the runner has them by the
        time the next pass runs (the worker takes calls in order)."""
        batch_queue = self.batch_queue
        scheduled = False
        if self.scheduler.has_requests() and len(batch_queue) < self.batch_queue_size:
            scheduler_output = self.scheduler.schedule(self._should_throttle_prefills())
            if scheduler_output.total_num_scheduled_tokens > 0 or not batch_queue:
                exec_future = self.model_executor.execute_model(scheduler_output, non_block=True)
                grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
                sample_future = self.model_executor.sample_tokens(grammar_output,
                                                                  non_block=True)
                batch_queue.appendleft((exec_future, sample_future, scheduler_output))
                scheduled = True
                if len(batch_queue) < self.batch_queue_size:
                    return {}, True  # plan the next step before waiting for this one
            else:
                # Nothing to run yet (the step in flight holds every request): the finished
                # ids this output carried go with the next one, or the runner never sees them.
                self.scheduler.finished_req_ids |= scheduler_output.finished_req_ids
        if not batch_queue:
            return {}, False
        exec_future, sample_future, scheduler_output = batch_queue.pop()
        model_output = exec_future.result()
        sampled = sample_future.result()
        if model_output is None:
            model_output = sampled
        self._process_aborts_queue()
        engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.first_token_time is None and any(model_output.sampled_token_ids):
            self.first_token_time = time.monotonic()
        return engine_core_outputs, scheduled

    def shutdown(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()


# ---- the engine core in its own process ---------------------------------------------------------


class EngineCoreRequestType(enum.Enum):
    """What the front end sends to the engine-core process: (type, payload), pickled."""

    ADD = "add"  # payload: Request
    ABORT = "abort"  # payload: list of request ids
    UTILITY = "utility"  # payload: (call_id, method name, args)
    SHUTDOWN = "shutdown"


class EngineCoreOutputType(enum.Enum):
    """What the engine-core process sends back: (type, payload), pickled."""

    OUTPUTS = "outputs"  # payload: EngineCoreOutputs with scheduler_stats
    UTILITY = "utility"  # payload: (call_id, ok, result or error message)


_IDLE_POLL_MS = 1000  # an idle engine wakes up this often (nothing else to do)
_WAITING_POLL_MS = 1  # requests wait (a grammar compiling) but nothing could be scheduled


class EngineCoreProc(EngineCore):
    """The engine core's busy loop in its own process: take input, `step()` while there is
    work, send outputs; block on input when idle. It only ever sees token ids: tokenizing and
    detokenizing stay in the front end (AsyncLLM)."""

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str) -> None:
        import zmq

        super().__init__(config)
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_addr)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.connect(output_addr)
        self._stats_dirty = False  # an abort changed the state, and no step reported it yet
        freeze_startup_heap()  # this process serves one engine until it exits

    @staticmethod
    def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                        ready_pipe, parent_pid: int) -> None:
        """The process's entry point: build the engine (load the model), report ready (or the
        error) over `ready_pipe`, then serve until told to shut down."""
        import signal
        import traceback

        from keel.executor.multiproc import _die_with_parent

        _die_with_parent(parent_pid)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        engine = None
        try:
            engine = EngineCoreProc(config, input_addr, output_addr)
            ready_pipe.send(("ready", {"num_blocks": config.cache_config.num_blocks}))
            ready_pipe.close()
            engine.run_busy_loop()
        except SystemExit:
            pass
        except BaseException as e:  # reported to the front end, then the process exits
            traceback.print_exc()
            if engine is None:
                ready_pipe.send(("failed", f"{type(e).__name__}: {e}"))
            raise
        finally:
            if engine is not None:
                engine.shutdown()

    def run_busy_loop(self) -> None:
        while True:
            # Idle only when nothing is scheduled and no step is in flight.
            busy = self.scheduler.has_requests() or bool(self.batch_queue)
            timeout = 0 if busy else _IDLE_POLL_MS
            if self._process_input(timeout):
                return  # shut down
            outputs, model_executed = self.step_fn()
            batch = outputs.get(0)
            if batch is not None or self._stats_dirty:
                batch = batch or EngineCoreOutputs()
                batch.scheduler_stats = self.scheduler.make_stats()
                self._send(EngineCoreOutputType.OUTPUTS, batch)
                self._stats_dirty = False
            if not model_executed and self.scheduler.has_unfinished_requests():
                # Waiting on something outside the model (a grammar compiling): don't spin.
                self._process_input(_WAITING_POLL_MS)

    def _process_input(self, timeout_ms: int) -> bool:
        """Handle every message waiting (waiting up to timeout_ms for the first one).
        Returns True on shutdown."""
        import pickle

        import zmq

        sock = self.input_socket
        if not sock.poll(timeout_ms):
            return False
        while True:
            try:
                kind, payload = pickle.loads(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return False
            if kind == EngineCoreRequestType.ADD:
                self.add_request(payload)
            elif kind == EngineCoreRequestType.ABORT:
                self.abort_requests(payload)
                self._stats_dirty = True
            elif kind == EngineCoreRequestType.UTILITY:
                call_id, method, args = payload
                try:
                    result = (True, getattr(self, method)(*args))
                except Exception as e:  # noqa: BLE001 - the caller gets the error
                    result = (False, f"{type(e).__name__}: {e}")
                self._send(EngineCoreOutputType.UTILITY, (call_id, *result))
            elif kind == EngineCoreRequestType.SHUTDOWN:
                return True

    def _send(self, kind: EngineCoreOutputType, payload: Any) -> None:
        import pickle

        self.output_socket.send(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    # Utility methods the front end may call by name.
    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        super().shutdown()
        for sock in (self.input_socket, self.output_socket):
            sock.close(linger=0)
        self.ctx.term()


def _exit_on_signal(*_: Any) -> None:
    raise SystemExit(0)  # unwinds the busy loop, so `finally` stops the workers
