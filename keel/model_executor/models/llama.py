"""Llama-family decoder: Llama, Mistral, Qwen2, Qwen3 differ only in what config.json says
(and in two switches: Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm).

`forward(input_ids[T], positions[T]) -> hidden[T, hidden]` on the flat batch the runner built;
`compute_logits(hidden[n]) -> [n, vocab]` on the rows it selects. Paging metadata is read by the
attention layers from the forward context, never passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from keel.attention.forward_context import get_forward_context
from keel.attention.layer import Attention
from keel.cpu_ops import cpu_ops_for
from keel.distributed import (
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_pp_indices,
)
from keel.model_executor.layers.activation import get_act_fn
from keel.model_executor.layers.fused_decode import FusedDecode
from keel.model_executor.layers.layernorm import RMSNorm
from keel.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from keel.model_executor.layers.rotary_embedding import RotaryEmbedding
from keel.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from keel.model_executor.models.utils import load_hf_weights
from keel.outputs import IntermediateTensors


def _sliding_window(config: Any, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # Qwen2/Qwen3: per-layer choice
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window  # Mistral: all layers when set


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, qkv_bias: bool, qk_norm: bool, dtype,
                 rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.total_heads = config.num_attention_heads
        self.total_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_heads
        self.head_dim = _head_dim(config)
        o_bias = getattr(config, "attention_bias", False) and not qkv_bias
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, self.total_heads, self.total_kv_heads,
            bias=qkv_bias or getattr(config, "attention_bias", False), dtype=dtype,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            self.total_heads * self.head_dim, hidden, bias=o_bias, dtype=dtype
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        # One table for the whole model where LlamaModel passes it (see there).
        if rotary_emb is None:
            rotary_emb = RotaryEmbedding(config, self.head_dim, config.max_position_embeddings)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
            sliding_window=_sliding_window(config, layer_idx), prefix=f"layers.{layer_idx}",
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """rows: only these tokens' outputs are wanted (every token's K and V are still
        written)."""
        t = x.shape[0]
        # Views of one [T, q + 2 kv] output; RoPE rotates q and k in place where it can.
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head before RoPE
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out if rows is None else out.index_select(0, rows))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=bias, dtype=dtype
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, dtype=dtype)
        self.act = get_act_fn(config.hidden_act)
        self.is_silu = config.hidden_act == "silu"
        # Its output only ever goes through silu_and_mul: the AMX copy may interleave gate and
        # up (packed_weights.pack_for_cpu_gemm) and take silu in its epilogue.
        self.gate_up_proj.silu_pairs = self.is_silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_silu:  # the activation in keel's GEMM epilogue, where it applies
            h = self.gate_up_proj.gemm_silu(x)
            if h is not None:
                return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        ops = cpu_ops_for(gate_up) if self.is_silu else None
        if ops is not None and gate_up.dim() == 2:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, qkv_bias: bool, qk_norm: bool, dtype,
                 rotary_emb: RotaryEmbedding | None = None):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias, qk_norm, dtype, rotary_emb)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, positions, hidden, residual, rows=None):
        """rows: only these tokens' outputs are wanted; the result then has just those rows
        (the layer still writes every token's K and V)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class PPMissingLayer(nn.Identity):
    """Stands in for a layer that lives on another pipeline stage, so that parameter names
    (`model.layers.17. ...`) are the same on every stage."""


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, dtype) -> None:
        super().__init__()
        pp_rank, pp_size = get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size()
        self.is_first_rank, self.is_last_rank = pp_rank == 0, pp_rank == pp_size - 1
        self.start_layer, self.end_layer = get_pp_indices(config.num_hidden_layers, pp_rank,
                                                          pp_size)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # The last stage keeps a tied embedding too: it is the LM head's weight.
        if self.is_first_rank or (tied and self.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                       dtype)
        else:
            self.embed_tokens = PPMissingLayer()
        # Every layer rotates with the same cos/sin table ([max_position, head_dim] float32, 4 MiB
        # at 8k positions and head size 64): built once, not once per layer.
        rope = RotaryEmbedding(config, _head_dim(config), config.max_position_embeddings)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, qk_norm, dtype, rope)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = (RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
                     if self.is_last_rank else PPMissingLayer())
        self.fused_decode = FusedDecode()  # decode passes in one C++ call (fused_decode.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_rank:
            hidden, residual = self.embed_tokens(input_ids), None
        else:  # the previous stage's output
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors[
                "residual"]
        # On the last stage, the rows anyone reads (the sampled ones; None: all): the last
        # layer computes its attention output projection and MLP for those tokens only.
        rows = get_forward_context().output_rows if self.is_last_rank else None
        fused = self.fused_decode(self, positions, hidden, residual, rows)
        if fused is not None:  # only `rows`' outputs, where given
            hidden, residual = fused
        else:
            layers = self.layers[self.start_layer : self.end_layer]
            for i, layer in enumerate(layers):
                hidden, residual = layer(positions, hidden, residual,
                                         rows if i == len(layers) - 1 else None)
        if not self.is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    supports_output_rows = True  # forward honours the forward context's output_rows
    # (merged param, HF name, shard id)
    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, self.qkv_bias, self.qk_norm, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.model.is_last_rank:
            self.lm_head = PPMissingLayer()
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
                self.lm_head.tied = True
        # Checkpoint tensors under these prefixes belong to other pipeline stages.
        self._other_stages = tuple(
            f"{name}." for name, module in self.named_modules()
            if isinstance(module, PPMissingLayer)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        # [T, hidden] on the last pipeline stage; hidden states and residual on the others.
        return self.model(input_ids, positions, intermediate_tensors)

    def intermediate_tensor_shapes(self, num_tokens: int
                                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each tensor the previous pipeline stage sends."""
        shape = (num_tokens, self.config.hidden_size)
        return {"hidden_states": (shape, self.dtype), "residual": (shape, self.dtype)}

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        # [n, vocab] float32 (else the model's dtype: ParallelLMHead.compute_logits)
        return self.lm_head.compute_logits(hidden, float32)

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # compute_logits(hidden).argmax(-1), or None (ParallelLMHead.greedy_token_ids)
        return self.lm_head.greedy_token_ids(hidden)

    def expected_weights(self) -> set[str]:
        """Every (param, shard) that a complete checkpoint must provide, in HF names."""
        out = set()
        merged = {}
        for merged_name, hf_name, _ in self.stacked_params_mapping:
            merged.setdefault(merged_name, []).append(hf_name)
        for name, _ in self.named_parameters():
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            for merged_name, hf_names in merged.items():
                if f".{merged_name}." in name:
                    out.update(name.replace(merged_name, h) for h in hf_names)
                    break
            else:
                out.add(name)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into keel's (merged) parameters. Returns the HF names loaded."""
        return load_hf_weights(self, weights, self.stacked_params_mapping, self._skip_weight)

    def _skip_weight(self, name: str) -> bool:
        return ("rotary_emb.inv_freq" in name  # a cache some old checkpoints saved
                or (self.tie_word_embeddings and name == "lm_head.weight")  # tied
                or name.startswith(self._other_stages))  # another pipeline stage loads it


class MistralForCausalLM(LlamaForCausalLM):
    pass  # sliding_window comes from config.json


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class LlamaEmbeddingModel(LlamaForCausalLM):
    """A Llama-family decoder saved without its LM head (`LlamaModel`, `Qwen3Model`, ...: the
    form decoder embedders such as Qwen3-Embedding often take): tensor names lack the
    `model.` prefix, and there is nothing to project to the vocabulary. Pooling only."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype)
        self.lm_head = PPMissingLayer()
        self.tie_word_embeddings = False
        self._other_stages = (*self._other_stages, "lm_head.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = (("model." + n if not n.startswith(("model.", "lm_head.")) else n, t)
                   for n, t in weights)
        return {n.removeprefix("model.") for n in super().load_weights(renamed)}

    def expected_weights(self) -> set[str]:
        return {n.removeprefix("model.") for n in super().expected_weights()
                if not n.startswith("lm_head.")}

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} has no LM head: it embeds (LLM.embed), it "
                         "cannot generate.")


class Qwen2EmbeddingModel(LlamaEmbeddingModel):
    qkv_bias = True


class Qwen3EmbeddingModel(LlamaEmbeddingModel):
    qk_norm = True
