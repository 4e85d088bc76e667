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


def is_first_pp_rank() -> bool:
    return _STATE.pp_rank == 0


def is_last_pp_rank() -> bool:
    return _STATE.pp_rank == _STATE.pp_size - 1


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers [start, end) of one pipeline stage. Layers are shared out evenly; the
    remainder goes to the stages before the last (which also computes the logits), as vLLM
    does. E.g. 30 layers, 4 stages -> 7, 8, 8, 7."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} must be between 1 and the model's "
            f"{num_layers} layers.")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def _pp_peer(stage_offset: int) -> int:
    """The global rank of this TP rank's counterpart in the stage `stage_offset` away."""
    return (_STATE.pp_rank + stage_offset) * _STATE.tp_size + _STATE.tp_rank


def send_tensor_dict(tensors: dict[str, torch.Tensor]) -> None:
    """Send a stage's outputs to the next stage (each TP rank to its counterpart; after the
    row-parallel all-reduce every TP rank holds the whole hidden state). Keys in sorted order,
    shapes known on both sides from the SchedulerOutput."""
    dst = _pp_peer(+1)
    for key in sorted(tensors):
        dist.send(tensors[key].contiguous(), dst=dst)


def recv_tensor_dict(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Receive what the previous stage's `send_tensor_dict` sent."""
    src = _pp_peer(-1)
    out = {}
    for key in sorted(shapes):
        shape, dtype = shapes[key]
        out[key] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out[key], src=src)
    return out


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
