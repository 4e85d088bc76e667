"""Tensor/pipeline parallel state. Single process for now: rank 0 of size 1.

Layers ask these functions for their shard instead of assuming the whole weight, so adding
tensor parallelism means filling in this module (gloo on CPU, nccl on CUDA), not rewriting models.
"""

from __future__ import annotations

import torch


def get_tensor_model_parallel_rank() -> int:
    return 0


def get_tensor_model_parallel_world_size() -> int:
    return 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return x  # identity at world size 1


def tensor_model_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    return x
