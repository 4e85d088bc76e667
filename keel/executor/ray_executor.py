"""RayDistributedExecutor: workers as Ray actors, the way past one machine.

One `RayWorkerWrapper` actor per rank, each placed on one bundle of a placement group, each
holding its own `Worker`. The contract is MultiprocExecutor's: a call goes to every actor as
`(method, args, kwargs, output_rank)`, a callable travels by cloudpickle, only the ranks that
reply send a result back, and a worker's failure becomes an exception when the future is
resolved. An actor that dies (killed, crashed, its node lost) fails the executor: the call in
flight raises as soon as Ray reports the death, and every later call raises at once.

Runs on a Ray cluster unchanged: with `RAY_ADDRESS` set (or `ray.init` already called) keel
joins that cluster; otherwise it starts a local Ray instance with this machine's cores and
stops it again at shutdown. `ray` is an optional extra: `pip install keel-llm[ray]`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import cloudpickle

from keel.config import EngineConfig
from keel.executor.abstract import Executor
from keel.executor.multiproc import (
    FutureWrapper,
    ResponseStatus,
    _free_port,
    core_shares,
    prepare_call,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a waiting call checks the other ranks for a dead actor
_DEATH_GRACE_S = 3.0  # how long a failed call waits for Ray to report a dead peer
_LOCAL_OBJECT_STORE_BYTES = 256 << 20  # keel's messages are small; the default is 30% of RAM


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'keel-llm[ray]' "
            "(or use 'mp' for several workers on this machine)."
        ) from e
    return ray


class RayWorkerWrapper:
    """The body of one actor: makes the Worker, then runs whatever collective_rpc sends."""

    def __init__(self) -> None:
        self.worker = None
        self.rank = -1

    def node_info(self) -> tuple[str, str]:
        """(node id, node IP): the driver groups ranks by node to share out each node's cores."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return _free_port()

    def init_worker(self, config: EngineConfig, rank: int, local_rank: int, local_world: int,
                    init_method: str) -> None:
        from keel.worker.worker import Worker

        cores = core_shares(local_world)[local_rank]  # this rank's share of its node
        os.sched_setaffinity(0, cores)
        if config.threads is None:
            config.threads = len(cores)
        self.rank = rank
        import ray

        # On CUDA Ray shows each actor only its own GPU, which is then device 0.
        device_index = 0 if ray.get_gpu_ids() else local_rank
        self.worker = Worker(config, local_rank=device_index, rank=rank,
                             is_driver_worker=rank == 0, distributed_init_method=init_method,
                             own_process=True)

    def execute_method(self, method: str | bytes, args: tuple, kwargs: dict,
                       output_rank: int | None) -> tuple[ResponseStatus, Any]:
        try:
            if isinstance(method, bytes):
                output = cloudpickle.loads(method)(self.worker, *args, **kwargs)
            else:
                output = getattr(self.worker, method)(*args, **kwargs)
            status = ResponseStatus.SUCCESS
        except Exception as e:  # noqa: BLE001 - reported to the caller, the actor goes on
            import traceback

            traceback.print_exc()
            status, output = ResponseStatus.FAILURE, f"{type(e).__name__}: {e}"
        if output_rank not in (None, self.rank) and status == ResponseStatus.SUCCESS:
            output = None  # only the output rank's result crosses the network
        return status, output


class RayDistributedExecutor(Executor):
    def _init_executor(self) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_placement_group = remove_placement_group
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        self.is_failed = False
        self._death: str | None = None
        self._pending: deque[FutureWrapper] = deque()
        self.workers: list[Any] = []
        self.placement_group = None

        self._owns_ray = False
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init()  # join the cluster the user points at
            else:
                ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False,
                         object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
                         logging_level=logging.WARNING, configure_logging=False)
                self._owns_ray = True

        on_cuda = self.config.model_config.torch_device.type == "cuda"
        if on_cuda:
            bundle = {"GPU": 1, "CPU": 1}
        else:
            # One core per rank where there are enough; a share of them where there are not
            # (the actors then split what there is, like mp's core shares).
            cpus = ray.cluster_resources().get("CPU", 1)
            bundle = {"CPU": min(1.0, cpus / self.world_size)}
        try:
            self.placement_group = placement_group([bundle] * self.world_size, strategy="PACK")
            ray.get(self.placement_group.ready(), timeout=60)
        except Exception as e:
            self.shutdown()
            raise RuntimeError(
                f"Ray could not place {self.world_size} workers of {bundle} each (cluster "
                f"resources: {ray.cluster_resources()}): add nodes or lower "
                f"tensor_parallel_size x pipeline_parallel_size."
            ) from e

        actor_cls = ray.remote(RayWorkerWrapper)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank)
            self.workers.append(actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=strategy, max_restarts=0,
            ).remote())
        nodes = ray.get([w.node_info.remote() for w in self.workers])
        # torch.distributed meets at rank 0's node.
        init_method = f"tcp://{nodes[0][1]}:{ray.get(self.workers[0].free_port.remote())}"
        per_node: dict[str, int] = {}
        local_ranks = []
        for node_id, _ in nodes:
            local_ranks.append(per_node.get(node_id, 0))
            per_node[node_id] = local_ranks[-1] + 1
        local_worlds = [per_node[node_id] for node_id, _ in nodes]
        ray.get([
            w.init_worker.remote(self.config, rank, local_ranks[rank], local_worlds[rank],
                                 init_method)
            for rank, w in enumerate(self.workers)
        ])
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
        kwargs = kwargs or {}
        refs = [w.execute_method.remote(send_method, args, kwargs, output_rank)
                for w in self.workers]
        reply_ranks = [output_rank] if output_rank is not None else range(self.world_size)

        def get_response():
            results = self._wait(refs, reply_ranks, timeout)
            return results[output_rank] if output_rank is not None else results

        future = FutureWrapper(self._pending, get_response)
        return future if non_block else future.result()

    def _wait(self, refs: list, reply_ranks, timeout: float | None) -> list:
        """Wait for the replying ranks; meanwhile watch every rank's call, so that an actor
        that died (while its peers wait for it in a collective) fails the call at once."""
        ray = self._ray
        results: list[Any] = [None] * len(refs)
        waiting = dict(enumerate(refs))
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(rank in waiting for rank in reply_ranks):
            ready, _ = ray.wait(list(waiting.values()), num_returns=1, timeout=_POLL_S)
            for ref in ready:
                rank = refs.index(ref)
                del waiting[rank]
                try:
                    status, result = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"Ray actor of rank {rank} died: {e.__class__.__name__}")
                    raise RuntimeError(
                        f"Worker failed with error '{self._death}', please check the stack "
                        "trace above for the root cause") from None
                if status != ResponseStatus.SUCCESS and rank in reply_ranks:
                    # A rank whose peer died fails in the collective it waited in, often
                    # before Ray reports the death: look for the dead actor first, so the
                    # executor is marked failed instead of left to hang on the next call.
                    self._find_dead_actor(refs, waiting)
                    raise RuntimeError(
                        f"Worker failed with error '{result}', please check the"
                        " stack trace above for the root cause")
                results[rank] = result
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"No response from a worker within {timeout} s")
        return results

    def _find_dead_actor(self, refs: list, waiting: dict[int, Any]) -> None:
        """Wait up to _DEATH_GRACE_S for the calls still out; any that resolve to a dead
        actor fail the executor and raise. Calls that finish normally are left alone."""
        ray = self._ray
        deadline = time.monotonic() + _DEATH_GRACE_S
        pending = list(waiting.values())
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"Ray actor of rank {refs.index(ref)} died: "
                               f"{e.__class__.__name__}")
                    raise RuntimeError(
                        f"Worker failed with error '{self._death}', please check the stack "
                        "trace above for the root cause") from None

    def _fail(self, why: str) -> None:
        if not self.is_failed:
            self.is_failed = True
            self._death = why
            logger.error("%s; the executor has failed.", why)

    def shutdown(self) -> None:
        if getattr(self, "_ray", None) is None:
            return
        ray, self._ray = self._ray, None
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.placement_group is not None:
            self._remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._owns_ray:
            # Stop the local Ray instance keel started (its raylet, GCS and worker processes).
            ray.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001, S110 - interpreter teardown
            pass
