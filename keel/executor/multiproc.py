"""MultiprocExecutor: worker processes reached through a broadcast message queue."""

from __future__ import annotations

from keel.executor.abstract import Executor


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        raise NotImplementedError(
            "distributed_executor_backend='mp' (worker processes over a message queue) is not "
            "implemented in keel yet; use 'uni' (the default at world size 1)."
        )

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False,
                       single_value=False):
        raise NotImplementedError("MultiprocExecutor is not implemented yet")
