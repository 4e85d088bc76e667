"""RayDistributedExecutor: workers as Ray actors, the way past one machine."""

from __future__ import annotations

from keel.executor.abstract import Executor


class RayDistributedExecutor(Executor):
    def _init_executor(self) -> None:
        raise NotImplementedError(
            "distributed_executor_backend='ray' is not implemented in keel yet; use 'uni'."
        )

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False,
                       single_value=False):
        raise NotImplementedError("RayDistributedExecutor is not implemented yet")
