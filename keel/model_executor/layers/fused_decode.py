"""The fused pass: all of a Llama-family model's decoder layers in one C++ call (`DecodePlan`,
keel/csrc/decode_layers.cpp), for a pass of decode rows and for one with prompt tokens.
Between the kernels of a decoder layer the Python layers spend ~10 module calls, views and
splits: ~8 ms of a ~20 ms step for one user on the default model (quantized), where it cost as
much as the GEMVs themselves. At 64 requests (float32) the GEMMs dominate and the difference
was within this machine's noise.

The plan calls the same kernels as the Python layers, in the same order, with the same
arguments (each linear layer the way `LinearBase._matmul` picks for the pass's row count:
keel's quantized kernels up to the layer's `max_rows`, else the packed weight on keel's GEMM,
fp16_gemm or oneDNN's, else `F.linear`), so its output is bit-identical to theirs
(tests/model_executor/test_fused_decode.py checks that); the Python layers stay the path for
every other pass and the reference.

It is taken when all of these hold, else the Python layers run:
- the model: keel's compiled kernels, tensor parallel size 1, float32 or bfloat16 (a
  bfloat16 layer's GEMM computed in float32 and rounded back, as the Python layer does), a
  SiLU MLP, every quantized linear in keel's own form (int4 groups of 32 with K a multiple
  of 32, int8 per row, or w8a8; a bfloat16 pass converted to float32 and back around keel's
  quantized kernels, as `quantized_linear` does), KV cache bound in the model's dtype;
- the pass: every row one decode token; or prompt tokens (and draft tokens) beside them, whose
  attention the plan runs as torch_paged.paged_attention does (`PassAttention`: each token a
  row of paged_attention, a long chunk on the causal prefill kernel over its gathered blocks),
  except where the Python layers would give a long chunk to SDPA or dequantize an int8
  cache's gathered rows. At 4,096 prompt tokens a step the Python between the kernels took
  ~26 ms of a ~610 ms step (BENCHMARKS.md, thirty-ninth round); in a server nearly every step
  carries some prompt tokens beside its decode rows.
The last layer computes its output projection and MLP for the sampled rows only
(`output_rows`), as the Python layers do. `KEEL_FUSED_DECODE=0` turns it off.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from keel.attention.forward_context import get_forward_context
from keel.distributed import get_tensor_model_parallel_world_size
from keel.model_executor.layers import quantization
from keel.model_executor.layers.amx_choice import amx_max_rows
from keel.model_executor.layers.gemm_choice import LOW_PRECISION_KINDS
from keel.model_executor.layers.quantization import (
    ALL_ROWS,
    Int4Weight,
    Int8Weight,
    W8A8Weight,
)

logger = logging.getLogger(__name__)


def _plan_linear(ops: Any, linear: Any, dtype: torch.dtype) -> Any:
    """The layer as a `PlanLinear`, or None where the plan cannot compute it as the Python
    layer does."""
    w = linear.quant
    q = d = m = None
    max_rows = 0
    if isinstance(w, W8A8Weight):
        return ops.PlanLinear(None, None, None, 0, 0, None, None, linear.bias, w.packed)
    if w is not None:
        if isinstance(w, Int4Weight) and w.keel is not None and w.keel[0].shape[1] * 2 == (
                w.in_features):
            q, d, m = w.keel
        elif isinstance(w, Int8Weight) and w.scales_f32 is not None:
            q, d = w.q, w.scales_f32
        else:
            return None
        max_rows = w.max_rows if linear.has_dense() else ALL_ROWS
    weight = linear.weight if linear.weight.numel() else None
    if linear.packed_by in LOW_PRECISION_KINDS:  # fp16_gemm / i16_gemm, as cpu_gemm takes them
        return ops.PlanLinear(q, d, m, max_rows, quantization.ACTIVATION_PARTS, None, weight,
                              linear.bias, fp16=linear.packed_weight, fp16_n=linear.packed_rows,
                              fp16_w_max=linear.fp16_w_max, fp16_silu=linear.fp16_silu,
                              fp16_bias=linear.fp16_bias, fp16_unorder=linear.fp16_unorder,
                              i16_scales=linear.i16_scales)
    # A bfloat16 model's AMX copy takes the passes amx_max_rows allows for the layer's kind
    # (its SiLU epilogue or plain passes); a float32 layer's (amx_f32: bfloat16 values) every
    # float32 pass, on amx_gemm_f32.
    f32 = linear.amx_f32 and dtype == torch.float32
    amx = linear.amx_weight if dtype == torch.bfloat16 or f32 else None
    return ops.PlanLinear(q, d, m, max_rows, quantization.ACTIVATION_PARTS,
                          linear.packed_weight, weight, linear.bias,
                          gemm_rows=linear.packed_rows if linear.packed_by == "keel" else 0,
                          float32_compute=linear.packed_by == "onednn-upcast", amx=amx,
                          amx_rows=0 if amx is None else ALL_ROWS if f32
                          else amx_max_rows(amx, linear.amx_silu),
                          amx_n=linear.packed_rows, amx_silu=amx is not None and linear.amx_silu,
                          amx_bias=linear.amx_bias)


_UNSET = object()  # the long chunks' kernel, not chosen yet


class FusedDecode:
    """Owned by a LlamaModel: builds its plan on the first pass that finds the KV cache bound
    (and decides then, once, whether the model qualifies)."""

    def __init__(self) -> None:
        self.plan: Any = None  # the DecodePlan; False once the model is known not to qualify
        self._cache = None  # the first layer's KV cache the plan was built with
        self._dtype: torch.dtype | None = None  # the model's, which the plan computes in

    def __call__(self, model: Any, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, rows: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the model's layers, or None: run the Python layers.
        rows: only these tokens' outputs are wanted (the last layer computes its output
        projection and MLP for them alone, and the result has just those rows)."""
        if self.plan is False:
            return None
        if (self.plan is None
                or model.layers[model.start_layer].self_attn.attn.kv_cache is not self._cache):
            self.plan = self._build(model.layers[model.start_layer : model.end_layer], hidden)
            if not self.plan:
                return None
        meta = get_forward_context().attn_metadata
        t = hidden.shape[0]
        if meta is None or meta.num_actual_tokens != t or hidden.dtype != self._dtype:
            return None
        attention = None
        if meta.query_rows is not None or meta.long_chunks is not None:
            attention = self._pass_attention(meta)
            if attention is None:
                return None
        elif meta.seq_lens.shape[0] != t:
            return None
        return self.plan.run(hidden, residual, positions, meta.block_table, meta.seq_lens,
                             meta.slot_mapping, attention, rows)

    def _pass_attention(self, meta: Any) -> Any:
        """A pass with prompt tokens: its attention as torch_paged.paged_attention runs it
        (a PassAttention), or None where the plan cannot run it as the Python layers do."""
        ops = self._ops
        if meta.long_chunks is None:  # every token a row of its own
            return ops.PassAttention(meta.token_rows, meta.token_seq_lens)
        if self._long_kernel is _UNSET:
            self._long_kernel = self._choose_long_kernel()
        if self._long_kernel is None:
            return None
        chunks = torch.tensor(meta.long_chunks, dtype=torch.int64)
        kernel = self._long_kernel
        idx = meta.short_tokens
        if idx is None:
            return ops.PassAttention(meta.token_rows, meta.token_seq_lens, chunks,
                                     long_kernel=kernel)
        # The other tokens' requests and key counts, once for every layer (the Python layers
        # select them in each).
        return ops.PassAttention(meta.token_rows, meta.token_seq_lens, chunks, idx,
                                 meta.token_rows.index_select(0, idx),
                                 meta.token_seq_lens.index_select(0, idx),
                                 long_kernel=kernel)

    def _choose_long_kernel(self) -> str | None:
        """The kernel torch_paged._split_attention gives a long prompt chunk of this model,
        or None where that is torch's SDPA, or the cache is int8 (its gathered rows are
        dequantized in Python)."""
        from keel.attention.backends import chunk_kernels

        attn = self._attn
        if attn.kv_scale is not None or attn.kv_cache.dtype == torch.int8:
            return None
        return chunk_kernels.chunk_kernel_name(self._ops, self._dtype, attn.num_heads,
                                               attn.num_kv_heads, attn.head_size,
                                               int16=attn.int16_prompt_attention)

    def _build(self, layers: Any, hidden: torch.Tensor) -> Any:
        """The plan; None while the KV cache is not bound yet; False if the model does not
        qualify (checked once)."""
        from keel.cpu_ops import get_cpu_ops

        if layers[0].self_attn.attn.kv_cache is None:
            return None
        ops = get_cpu_ops() if hidden.device.type == "cpu" else None
        dtype = hidden.dtype
        if (os.environ.get("KEEL_FUSED_DECODE", "1") == "0" or ops is None
                or not hasattr(ops, "DecodePlan") or dtype not in (torch.float32, torch.bfloat16)
                or get_tensor_model_parallel_world_size() != 1):
            return False
        plan = ops.DecodePlan()
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [_plan_linear(ops, lin, dtype) for lin in (
                attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            cache = attn.attn.kv_cache
            if (any(lin is None for lin in linears) or not mlp.is_silu or cache is None
                    or cache.dtype not in (dtype, torch.bfloat16, torch.int8)
                    or not cache.is_contiguous()
                    or layer.input_layernorm.weight.dtype != dtype):
                return False
            cos, sin = attn.rotary_emb._cos_sin_in(dtype)
            plan.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                layer.input_layernorm.eps, linears,
                None if attn.q_norm is None else attn.q_norm.weight,
                None if attn.k_norm is None else attn.k_norm.weight,
                cos, sin, cache, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                attn.attn.scale, attn.attn.sliding_window or 0, attn.attn.kv_scale)
        self._cache, self._dtype = layers[0].self_attn.attn.kv_cache, dtype
        self._ops, self._attn, self._long_kernel = ops, layers[0].self_attn.attn, _UNSET
        logger.info("Passes run the %d decoder layers in one C++ call "
                    "(keel/csrc/decode_layers.cpp).", plan.num_layers)
        return plan
