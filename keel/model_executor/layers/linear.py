"""Linear layers written for tensor parallelism (vLLM's shapes), used at world size 1 today.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies the
HF tensor (or this rank's slice of it) into the right rows. Merged layers (`qkv_proj`,
`gate_up_proj`) are loaded from the separate HF tensors through `shard_id`.

On the CPU each weight is packed once for the GEMM that runs it: which GEMM is chosen in
gemm_choice.py (amx_choice.py for the AMX GEMM's copies); the packing and the call are in
packed_weights.py (`pack_for_cpu_gemm`, `cpu_gemm`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from keel.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from keel.model_executor.layers import amx_choice, gemm_choice
from keel.model_executor.layers.amx_choice import (  # noqa: F401 (re-exported)
    AMX_GEMM_MAX_ROWS,
    amx_gemm_chosen,
)
from keel.model_executor.layers.gemm_choice import (  # noqa: F401 (re-exported)
    bf16_gemm_in_float32,
    keel_gemm_chosen,
    onednn_gemm_supported,
    pack_weight,
    packed_linear,
)
from keel.model_executor.layers.packed_weights import (
    cpu_gemm,
    fp16_gemm_silu,
    pack_for_cpu_gemm,
)
from keel.model_executor.layers.quantization import (
    QuantizedWeight,
    quantized_linear,
    uses_kernel,
)

logger = logging.getLogger(__name__)


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
        self.packed_weight: torch.Tensor | None = None
        self.packed_by = ""  # which GEMM packed_weight is for (pack_for_cpu_gemm)
        self.packed_rows = 0  # the weight's output rows
        self.amx_weight: torch.Tensor | None = None  # amx_gemm_pack's copy (bfloat16, AMX)
        # A [gate; up] layer whose output only feeds silu_and_mul (set by its MLP): its AMX
        # copy then interleaves gate and up rows by 16 (amx_silu, with amx_bias alike) and
        # only gemm_silu takes it.
        self.silu_pairs = False
        self.amx_silu = False
        self.amx_bias: torch.Tensor | None = None
        # The copy is for float32 passes (amx_gemm_f32: a float32 layer of bfloat16 values).
        self.amx_f32 = False
        # packed_by "fp16" or "i16" (packed_weights._fp16_pack): the weight's largest |W|
        # (fp16) or its blocks' scales (i16), and for a [gate; up] layer its rows interleaved
        # by 16 as the AMX copy's (fp16_silu, with its bias alike and the inverse order for a
        # plain pass's columns).
        self.fp16_w_max = 0.0
        self.i16_scales: torch.Tensor | None = None
        self.fp16_silu = False
        self.fp16_bias: torch.Tensor | None = None
        self.fp16_unorder: torch.Tensor | None = None
        # Weights kept quantized (keel/model_executor/quantize_model.py); then no dense copy.
        self.quant: QuantizedWeight | None = None
        # A folder converted from a .gguf: the file's int4 groups (keel's form) for the AMX
        # copy of the dense weight, dropped once it is made (attach_gguf_amx_sources).
        self.amx_int4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def process_weights_after_loading(self) -> None:
        """Pack the loaded weight for the CPU's GEMM and release the dense copy (a
        quantized layer's dense weight too, when it keeps one for large passes)."""
        if self.weight.numel():
            pack_for_cpu_gemm(self)

    def has_dense(self) -> bool:
        return self.packed_weight is not None or self.weight.numel() > 0

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # A dense model pays one attribute check here, not a call.
        if self.quant is not None and uses_kernel(self.quant, x, self.has_dense()):
            return quantized_linear(x, self.quant, bias)
        if self.packed_weight is not None:
            return cpu_gemm(self, x, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


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


    def gemm_silu(self, x: torch.Tensor, dense_only: bool = False) -> torch.Tensor | None:
        """silu(gate) * up for a [gate; up] layer, with the activation in keel's GEMM epilogue
        (csrc/gemm.cpp gemm_silu, or a bfloat16 pass that the AMX GEMM takes (amx_takes) on
        its interleaved copy: the [T, 2I] product is never written out), or None where
        that path does not apply: another GEMM, a quantized pass, or widths that are not
        multiples of 16. On fp16_gemm or i16_gemm (packed_by "fp16" / "i16") an interleaved
        layer's float32 passes take silu in its epilogue likewise. `dense_only`: the dense
        weight's path even where the pass would go to the quantized kernel
        (rows_per_pass.choose_rows_per_pass times the two)."""
        if (not dense_only and self.quant is not None
                and uses_kernel(self.quant, x, self.has_dense())) or x.dim() != 2:
            return None
        if self.fp16_silu and x.dtype == torch.float32:
            return fp16_gemm_silu(self, x)
        if (self.amx_silu and x.dtype == torch.bfloat16
                and amx_choice.amx_takes(self.amx_weight, x.shape[0], silu=True)):
            return gemm_choice._keel_ops.amx_gemm(x, self.amx_weight, self.packed_rows,
                                                  self.amx_bias, True)
        if self.amx_silu and self.amx_f32 and x.dtype == torch.float32:
            return gemm_choice._keel_ops.amx_gemm_f32(x, self.amx_weight, self.packed_rows,
                                                      self.amx_bias, True)
        if (self.packed_by != "keel" or x.dtype != torch.float32 or self.packed_rows % 32
                or len(set(self.output_sizes)) != 1 or len(self.output_sizes) != 2):
            return None
        return gemm_choice._keel_ops.gemm_silu(x, self.packed_weight, self.packed_rows, self.bias)


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
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        out = tensor_model_parallel_all_reduce(self._matmul(x, None))
        if self.bias is not None:  # added once, after the reduction
            out = out + self.bias
        return out
