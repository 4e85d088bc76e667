"""EngineCoreClient: the front end's handle on an engine core running in its own process.

The engine process is started with spawn and reports ready (or why it could not start) over a
pipe. Requests go to it over one ZMQ PUSH socket (IPC); outputs come back on a PULL socket,
read by a thread that hands each message to the caller's callback and watches the process:
when it dies, `on_dead` is called once with the reason.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from keel.config import EngineConfig
from keel.engine.core import EngineCoreOutputType, EngineCoreProc, EngineCoreRequestType
from keel.request import Request

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the output thread checks that the engine process is alive
STARTUP_TIMEOUT_S = 600.0


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more can be served."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig, on_outputs: Callable[[Any], None],
                 on_dead: Callable[[str], None]) -> None:
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self.dead_reason: str | None = None
        self._ctx = zmq.Context()
        self._ipc_dir = tempfile.mkdtemp(prefix="keel-engine-")
        input_addr = f"ipc://{self._ipc_dir}/input"
        output_addr = f"ipc://{self._ipc_dir}/output"
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(output_addr)
        self._send_lock = threading.Lock()
        self._utility_ids = itertools.count()
        self._utility_futures: dict[int, Future] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []  # joined before the sockets close

        spawn = multiprocessing.get_context("spawn")
        ready_reader, ready_writer = spawn.Pipe(duplex=False)
        # Not a daemon: the engine may start worker processes of its own (the mp executor).
        self.proc = spawn.Process(
            target=EngineCoreProc.run_engine_core, name="keel-engine-core",
            args=(config, input_addr, output_addr, ready_writer, os.getpid()),
        )
        self.proc.start()
        ready_writer.close()
        self._finalizer = weakref.finalize(self, _stop_engine, self.proc, self._ctx,
                                           [self._input, self._output], self._ipc_dir,
                                           self._stopping, self._threads)
        try:
            self.ready_info = self._wait_ready(ready_reader)
        except BaseException:
            self.shutdown()
            raise
        self._thread = threading.Thread(target=self._output_loop, daemon=True,
                                        name="keel-engine-outputs")
        self._thread.start()
        self._threads.append(self._thread)

    def _wait_ready(self, reader) -> dict:
        """Block until the engine has loaded the model (or failed to)."""
        waited = 0.0
        while not reader.poll(0.1):
            waited += 0.1
            if not self.proc.is_alive():
                raise RuntimeError(
                    f"The engine process exited during start-up (exit code {self.proc.exitcode});"
                    " see its log above.")
            if waited > STARTUP_TIMEOUT_S:
                raise TimeoutError(f"The engine did not start within {STARTUP_TIMEOUT_S:.0f} s.")
        try:
            status, info = reader.recv()
        except EOFError:
            raise RuntimeError("The engine process exited during start-up; see its log above."
                               ) from None
        if status != "ready":
            raise RuntimeError(f"The engine could not start: {info}")
        return info

    # ---- front end -> engine ------------------------------------------------------------------

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        message = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:  # callers may be on several threads
            self._input.send(message)

    def add_request(self, request: Request) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Future:
        """Call an EngineCoreProc method by name in the engine process; a Future of its
        result (a RuntimeError with the engine's message if it raised)."""
        call_id = next(self._utility_ids)
        future: Future = Future()
        self._utility_futures[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, args))
        return future

    # ---- engine -> front end ------------------------------------------------------------------

    def _output_loop(self) -> None:
        sock = self._output
        while not self._stopping.is_set():
            try:
                ready = sock.poll(_POLL_MS)
                if not ready:
                    if not self.proc.is_alive():
                        self._engine_died(f"the engine process died (exit code "
                                          f"{self.proc.exitcode})")
                        return
                    continue
                kind, payload = pickle.loads(sock.recv())
            except zmq.ZMQError:
                return  # closed at shutdown
            if kind == EngineCoreOutputType.OUTPUTS:
                self._on_outputs(payload)
            elif kind == EngineCoreOutputType.UTILITY:
                call_id, ok, result = payload
                future = self._utility_futures.pop(call_id, None)
                if future is not None:
                    if ok:
                        future.set_result(result)
                    else:
                        future.set_exception(RuntimeError(result))

    def _engine_died(self, reason: str) -> None:
        if self._stopping.is_set() or self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("Engine core failed: %s", reason)
        for future in self._utility_futures.values():
            future.set_exception(EngineDeadError(reason))
        self._utility_futures.clear()
        self._on_dead(reason)

    def shutdown(self) -> None:
        if self.proc.is_alive() and self.dead_reason is None:
            try:
                with self._send_lock:
                    self._input.send(pickle.dumps((EngineCoreRequestType.SHUTDOWN, None)),
                                     zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._finalizer()


def _stop_engine(proc, ctx, sockets, ipc_dir: str, stopping: threading.Event,
                 threads: list[threading.Thread]) -> None:
    """Give the engine a moment to stop its workers, then terminate, then kill it."""
    stopping.set()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=2)
    proc.join(timeout=5)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
    for name in os.listdir(ipc_dir) if os.path.isdir(ipc_dir) else ():
        os.unlink(os.path.join(ipc_dir, name))
    if os.path.isdir(ipc_dir):
        os.rmdir(ipc_dir)
