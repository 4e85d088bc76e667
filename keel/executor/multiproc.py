"""MultiprocExecutor: the same string, over a message queue.

One `WorkerProc` per rank (spawned), each with its own `Worker`. A call is one message
`(method, args, kwargs, output_rank)`, serialised once and sent to every worker over ZMQ IPC
sockets; each worker resolves the method with `getattr(self.worker, method)` and, if it is the
output rank (or every rank answers), sends back `(status, result)`. Only the response sockets
of `unique_reply_rank` are read when it is set. A worker's failure becomes an exception when
the future is resolved, not at the call. A monitor thread watches the worker processes: one
that dies marks the executor failed, and every pending and later call raises.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import tempfile
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import wait as wait_for_processes
from typing import Any

import cloudpickle
import zmq

from keel.config import EngineConfig
from keel.executor.abstract import Executor

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting call checks whether a worker died
# How long a worker's error waits for a dead peer to show (_fail_if_a_worker_died).
_DEATH_GRACE_S = 0.5


class ResponseStatus(enum.IntEnum):
    SUCCESS = 0
    FAILURE = 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_shares(world_size: int) -> list[list[int]]:
    """Split the cores this process may use into one share per rank, so that the ranks'
    OpenMP threads do not fight (two spinning torch processes on the same cores slow each
    other down ~40x). E.g. cores [0, 1, 2, 3], 2 ranks -> [[0, 1], [2, 3]]; with fewer cores
    than ranks, ranks share cores round-robin, one thread each."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world_size:
        return [[cores[r % len(cores)]] for r in range(world_size)]
    per = len(cores) // world_size
    return [cores[r * per : (r + 1) * per] for r in range(world_size)]


def prepare_call(executor, method: str | Callable, single_value: bool,
                 unique_reply_rank: int | None) -> tuple[str | bytes, int | None]:
    """What every multi-worker collective_rpc does first: refuse once failed, pick the rank
    that replies (the output rank for execute_model / sample_tokens), and serialise a callable
    with cloudpickle (a string is sent as is)."""
    if executor.is_failed:
        raise RuntimeError("Executor failed.")
    if single_value and unique_reply_rank is None:
        unique_reply_rank = executor.output_rank
    if isinstance(method, str):
        return method, unique_reply_rank
    return cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL), unique_reply_rank


class FutureWrapper(Future):
    """Resolved lazily: result() reads the responses. Futures are resolved in the order their
    calls were made, since responses arrive in that order on each socket."""

    def __init__(self, pending: deque, get_response: Callable[[], Any]) -> None:
        super().__init__()
        self._pending = pending
        self._get_response = get_response
        pending.append(self)

    def result(self, timeout: float | None = None) -> Any:
        while not self.done():
            head = self._pending.popleft()
            try:
                head.set_result(head._get_response())
            except BaseException as e:  # noqa: BLE001 - delivered to whoever waits on it
                head.set_exception(e)
        return super().result(timeout)


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        self.is_failed = False
        self._stopping = threading.Event()  # set before workers are stopped on purpose
        # execute_model's reply comes from TP rank 0 of the last PP stage.
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        self._ctx = zmq.Context()
        self._ipc_dir = tempfile.mkdtemp(prefix="keel-mp-")
        self._request_socks, self._response_socks = [], []
        self._pending: deque[FutureWrapper] = deque()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        shares = core_shares(self.world_size)
        spawn = multiprocessing.get_context("spawn")
        self.processes = []
        for rank in range(self.world_size):
            req_addr = f"ipc://{self._ipc_dir}/req-{rank}"
            resp_addr = f"ipc://{self._ipc_dir}/resp-{rank}"
            req = self._ctx.socket(zmq.PUSH)
            req.bind(req_addr)
            resp = self._ctx.socket(zmq.PULL)
            resp.bind(resp_addr)
            self._request_socks.append(req)
            self._response_socks.append(resp)
            proc = spawn.Process(
                target=WorkerProc.worker_main, name=f"keel-worker-{rank}", daemon=True,
                args=(self.config, rank, init_method, req_addr, resp_addr, shares[rank],
                      os.getpid()),
            )
            proc.start()
            self.processes.append(proc)
        # Stops the workers when the executor is shut down, garbage-collected or at exit.
        self._finalizer = weakref.finalize(self, _stop_processes, self.processes, self._ipc_dir,
                                           self._stopping, self._ctx,
                                           [*self._request_socks, *self._response_socks])
        # The monitor holds only a weak reference, so it does not keep the executor alive.
        threading.Thread(target=_monitor_workers, daemon=True, name="keel-worker-monitor",
                         args=(weakref.ref(self), self.processes, self._stopping)).start()
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        single_value: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        send_method, output_rank = prepare_call(self, method, single_value, unique_reply_rank)
        message = pickle.dumps((send_method, args, kwargs or {}, output_rank),
                               protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._request_socks:  # one message, to every worker
            self._send(sock, message)

        response_socks = self._response_socks
        if output_rank is not None:
            response_socks = [response_socks[output_rank]]

        def get_response():
            responses = []
            for sock in response_socks:
                status, result = self._receive(sock, timeout)
                if status != ResponseStatus.SUCCESS:
                    self._fail_if_a_worker_died()
                    raise RuntimeError(
                        f"Worker failed with error '{result}', please check the"
                        " stack trace above for the root cause"
                    )
                responses.append(result)
            return responses[0] if output_rank is not None else responses

        future = FutureWrapper(self._pending, get_response)
        return future if non_block else future.result()

    def _fail_if_a_worker_died(self) -> None:
        """A worker's error can be a peer's death seen first through the collective (its
        connection reset before the monitor thread wakes on the dead process): wait up to
        _DEATH_GRACE_S for a worker to have exited and mark the executor failed as the monitor
        does, so that the caller sees the same state whichever noticed first. An error with
        every worker alive (a call that raised) leaves the executor serving."""
        dead = wait_for_processes([p.sentinel for p in self.processes], timeout=_DEATH_GRACE_S)
        if dead and not self._stopping.is_set():
            _mark_failed(self, next(p for p in self.processes if p.sentinel == dead[0]))

    def _send(self, sock, message: bytes) -> None:
        """Send without blocking forever: a worker that is not there (yet, or any more)
        would stall a blocking PUSH."""
        while True:
            try:
                sock.send(message, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if self.is_failed:
                    raise RuntimeError("Executor failed.") from None
                sock.poll(_POLL_MS, zmq.POLLOUT)

    def _receive(self, sock, timeout: float | None):
        waited = 0.0
        while not sock.poll(_POLL_MS):
            waited += _POLL_MS / 1000
            if self.is_failed:
                raise RuntimeError(
                    f"Worker failed with error '{getattr(self, '_death', 'a worker died')}', "
                    "please check the stack trace above for the root cause")
            if timeout is not None and waited >= timeout:
                raise TimeoutError(f"No response from a worker within {timeout} s")
        return pickle.loads(sock.recv())

    def shutdown(self) -> None:
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()


def _monitor_workers(executor_ref, processes, stopping: threading.Event) -> None:
    """Wait for any worker to exit; unless the executor is stopping them, mark it failed."""
    sentinels = {p.sentinel: p for p in processes}
    dead = wait_for_processes(list(sentinels))
    executor = executor_ref()
    if stopping.is_set() or executor is None:
        return
    _mark_failed(executor, sentinels[dead[0]])


def _mark_failed(executor, proc) -> None:
    """A worker process died: the executor refuses every later call (once, logged once)."""
    if executor.is_failed:
        return
    executor._death = f"worker process {proc.name} died (exit code {proc.exitcode})"
    executor.is_failed = True
    logger.error("Worker process %s (pid %s) died with exit code %s; the executor has failed.",
                 proc.name, proc.pid, proc.exitcode)


def _stop_processes(processes, ipc_dir: str, stopping: threading.Event, ctx, sockets) -> None:
    """Terminate, then kill, every worker; close the sockets and the context; remove the
    socket folder. (weakref.finalize runs it at most once.)"""
    stopping.set()
    for sock in sockets:  # every one, explicitly: term() waits for sockets left open
        sock.close(linger=0)
    ctx.term()
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=3)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=3)
    for name in os.listdir(ipc_dir) if os.path.isdir(ipc_dir) else ():
        os.unlink(os.path.join(ipc_dir, name))
    if os.path.isdir(ipc_dir):
        os.rmdir(ipc_dir)


class WorkerProc:
    """The loop of one worker process: receive a call, run it on the Worker, maybe reply."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str, req_addr: str,
                 resp_addr: str) -> None:
        from keel.worker.worker import Worker

        self.rank = rank
        self.worker = Worker(config, local_rank=rank, rank=rank, is_driver_worker=rank == 0,
                             distributed_init_method=init_method, own_process=True)
        self.ctx = zmq.Context()
        self.requests = self.ctx.socket(zmq.PULL)
        self.requests.connect(req_addr)
        self.responses = self.ctx.socket(zmq.PUSH)
        self.responses.connect(resp_addr)

    @staticmethod
    def worker_main(config: EngineConfig, rank: int, init_method: str, req_addr: str,
                    resp_addr: str, cores: list[int], parent_pid: int) -> None:
        _die_with_parent(parent_pid)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        os.sched_setaffinity(0, cores)
        if config.threads is None:
            config.threads = len(cores)  # this rank's share of the cores
        WorkerProc(config, rank, init_method, req_addr, resp_addr).busy_loop()

    def busy_loop(self) -> None:
        while True:
            method, args, kwargs, output_rank = pickle.loads(self.requests.recv())
            try:
                if isinstance(method, bytes):
                    func = cloudpickle.loads(method)
                    output = func(self.worker, *args, **kwargs)
                else:
                    output = getattr(self.worker, method)(*args, **kwargs)
                reply = (ResponseStatus.SUCCESS, output)
            except Exception as e:  # noqa: BLE001 - reported to the caller, the loop goes on
                traceback.print_exc()
                reply = (ResponseStatus.FAILURE, f"{type(e).__name__}: {e}")
            if output_rank is None or output_rank == self.rank:
                self.responses.send(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when its parent dies (no orphans if the engine is
    killed); elsewhere, a thread notices the parent is gone."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        import time

        while os.getppid() == parent_pid:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
