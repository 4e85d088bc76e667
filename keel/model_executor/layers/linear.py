"""Linear layers written for tensor parallelism (vLLM's shapes), used at world size 1 today.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies the
HF tensor (or this rank's slice of it) into the right rows. Merged layers (`qkv_proj`,
`gate_up_proj`) are loaded from the separate HF tensors through `shard_id`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from keel.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"Shape mismatch for {what}: checkpoint has {tuple(loaded.shape)}, "
            f"the model expects {tuple(param.shape)} (does config.json match the weights?)."
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    _check_shape(param, loaded, name or "a parameter")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype=None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks: rank r holds rows [r * out/tp, (r+1) * out/tp)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype=None):
        tp = get_tensor_model_parallel_world_size()
        assert output_size % tp == 0, f"{output_size} not divisible by tp={tp}"
        super().__init__(input_size, output_size // tp, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = param.shape[0]
        loaded = loaded.narrow(0, self.tp_rank * shard, shard) if self.tp_size > 1 else loaded
        default_weight_loader(param, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul, e.g. gate_up_proj = [gate; up]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, dtype=None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is not None, "merged layers load one shard at a time"
        sizes = [s // self.tp_size for s in self.output_sizes]
        offset, size = sum(sizes[:shard_id]), sizes[shard_id]
        loaded = loaded.narrow(0, self.tp_rank * size, size) if self.tp_size > 1 else loaded
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, loaded, f"shard {shard_id}")
        dst.copy_(loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj in one matmul. Output rows: [q | k | v]."""

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
        bias: bool = False, dtype=None,
    ):
        tp = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.num_heads = num_heads // tp
        # With more ranks than KV heads, KV heads are replicated (vLLM does the same).
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.num_kv_replicas = max(1, tp // num_kv_heads)
        out = (num_heads + 2 * self.num_kv_heads * tp) * head_size
        super().__init__(hidden_size, out, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q = self.num_heads * self.head_size
        kv = self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_replicas
        if self.tp_size > 1:
            loaded = loaded.narrow(0, rank * size, size)
        dst = param.data.narrow(0, offset, size)
        _check_shape(dst, loaded, f"{shard_id}_proj")
        dst.copy_(loaded)


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype=None):
        tp = get_tensor_model_parallel_world_size()
        assert input_size % tp == 0, f"{input_size} not divisible by tp={tp}"
        super().__init__(input_size // tp, output_size, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 2 and self.tp_size > 1:
            shard = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * shard, shard)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        if self.bias is not None:  # added once, after the reduction
            out = out + self.bias
        return out
