"""Tensor/pipeline parallel state: which rank this process is, and the collectives the model
layers call. gloo on the CPU, nccl on CUDA, through torch.distributed.

Layers ask these functions for their shard instead of assuming the whole weight; in a single
process (the `uni` executor) nothing is initialised and every call is the identity at world
size 1. Ranks are laid out TP-major: rank = pp_rank * tp_size + tp_rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: object = None  # a torch.distributed ProcessGroup when tp_size > 1


_STATE = _ParallelState()


def init_distributed_environment(world_size: int, rank: int, init_method: str,
                                 backend: str) -> None:
    """Join the process group of all ranks (called by each worker process before loading)."""
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method,
                                world_size=world_size, rank=rank)


def initialize_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Create one TP group per pipeline stage (every rank must create every group)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    state = _ParallelState(tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=pp)
    if tp > 1:
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == state.pp_rank:
                state.tp_group = group
    _STATE.__dict__.update(state.__dict__)


def destroy_model_parallel() -> None:
    _STATE.__dict__.update(_ParallelState().__dict__)
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tensor_model_parallel_rank() -> int:
    return _STATE.tp_rank


def get_tensor_model_parallel_world_size() -> int:
    return _STATE.tp_size


def get_pipeline_model_parallel_rank() -> int:
    return _STATE.pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return _STATE.pp_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP ranks, in place (the partial outputs of a row-parallel layer)."""
    if _STATE.tp_size == 1:
        return x
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's x along the last dimension, in rank order (vocab shards)."""
    if _STATE.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x, group=_STATE.tp_group)
    return torch.cat(parts, dim=-1)
