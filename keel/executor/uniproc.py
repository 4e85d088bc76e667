"""UniProcExecutor: a function call wearing an RPC's clothes."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from keel.executor.abstract import Executor
from keel.worker.worker import Worker


def run_method(obj: Any, method: str | Callable, args: tuple, kwargs: dict) -> Any:
    """Call `method` on `obj`: by name if a string, else as a function taking obj first."""
    if isinstance(method, str):
        func = getattr(obj, method)
        return func(*args, **kwargs)
    return method(obj, *args, **kwargs)


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        world_size = self.config.parallel_config.world_size
        if world_size != 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker, but tensor x pipeline "
                f"parallel size is {world_size}: use distributed_executor_backend='mp' (the "
                "default above world size 1)."
            )
        self.driver_worker = Worker(self.config, local_rank=0, rank=0, is_driver_worker=True)
        # With async scheduling, non-blocking calls run on one worker thread, in call order,
        # so the engine thread can schedule the next step meanwhile (torch releases the GIL
        # inside its ops). Without it, a non-blocking call is done before its future exists.
        self._thread = None
        if self.max_concurrent_batches > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-worker")
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
    ) -> Any:
        if kwargs is None:
            kwargs = {}

        if getattr(self, "_thread", None) is not None:
            def call():
                result = run_method(self.driver_worker, method, args, kwargs)
                return result if single_value else [result]

            future = self._thread.submit(call)
            return future if non_block else future.result()
        if not non_block:
            result = run_method(self.driver_worker, method, args, kwargs)
            return result if single_value else [result]

        # Already done by the time the future exists; an exception goes into the future so
        # that future.result() raises in the engine loop, where a worker process's would.
        try:
            result = run_method(self.driver_worker, method, args, kwargs)
            future = Future[Any]()
            future.set_result(result if single_value else [result])
        except Exception as e:  # noqa: BLE001 - every failure must surface at future.result()
            future = Future[Any]()
            future.set_exception(e)
        return future

    def shutdown(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self._thread.shutdown(wait=True)
        if getattr(self, "driver_worker", None) is not None:
            self.driver_worker.shutdown()


class ExecutorWithExternalLauncher(UniProcExecutor):
    """One engine per rank, all started by an outside launcher (torchrun), outputs broadcast
    from the last pipeline rank. Not built yet."""

    def _init_executor(self) -> None:
        raise NotImplementedError(
            "distributed_executor_backend='external_launcher' (one engine per rank under "
            "torchrun) is not implemented in keel yet; use 'mp' for several workers, or 'uni'."
        )
