"""BERT encoder (`BertModel`, e.g. all-MiniLM-L6-v2) for pooling: bidirectional attention,
absolute position embeddings, token types, post-LayerNorm blocks, no KV cache.

`forward(input_ids[T], positions[T]) -> hidden[T, hidden]` on the runner's flat batch, like
the decoders; each request's whole prompt is in the pass (the engine does not chunk an
encoder's prompt), and attention stays within a request (`EncoderOnlyAttention`). Every token
has token type 0, as for a single sentence. Parameter names are HF's, except the merged
`qkv_proj` (query, key, value).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from keel.attention.layer import EncoderOnlyAttention
from keel.model_executor.layers.activation import get_act_fn
from keel.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from keel.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from keel.model_executor.models.utils import load_hf_weights
from keel.outputs import IntermediateTensors


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden, dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden,
                                                dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])  # token type 0


class BertSelfAttention(nn.Module):
    """HF's `attention.self` (query/key/value, merged) and `attention.output` (dense +
    LayerNorm over the residual)."""

    def __init__(self, config: Any, prefix: str, dtype) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True, dtype=dtype)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.attn = EncoderOnlyAttention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5,
                                         prefix=prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size] * 3, dim=-1)
        return self.attn(q, k, v)


class BertAttentionOutput(nn.Module):
    def __init__(self, config: Any, inner: int, dtype) -> None:
        super().__init__()
        self.dense = RowParallelLinear(inner, config.hidden_size, bias=True, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                      dtype=dtype)
        self.LayerNorm.requires_grad_(False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, prefix: str, dtype) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, prefix, dtype)
        self.output = BertAttentionOutput(config, config.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, dtype) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size,
                                          bias=True, dtype=dtype)
        self.act = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any, prefix: str, dtype) -> None:
        super().__init__()
        self.attention = BertAttention(config, prefix, dtype)
        self.intermediate = BertIntermediate(config, dtype)
        self.output = BertAttentionOutput(config, config.intermediate_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, f"encoder.layer.{i}", dtype)
                                   for i in range(config.num_hidden_layers))


class BertModel(nn.Module):
    is_encoder_only = True
    # Tensors of a BERT checkpoint that pooling does not use: BERT's own pooler (a dense +
    # tanh over [CLS], which sentence-transformers skips too), the MLM head, cached buffers.
    skipped_prefixes = ("pooler.", "cls.", "embeddings.position_ids")
    stacked_params_mapping: ClassVar[list[tuple[str, str, str]]] = [
        ("self.qkv_proj", "self.query", "q"),
        ("self.qkv_proj", "self.key", "k"),
        ("self.qkv_proj", "self.value", "v"),
    ]

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise NotImplementedError(
                f"BERT with position_embedding_type={config.position_embedding_type!r} is not "
                "implemented in keel (absolute only).")
        self.config, self.dtype = config, dtype
        self.embeddings = BertEmbeddings(config, dtype)
        self.encoder = BertEncoder(config, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions)  # [T, hidden]
        for layer in self.encoder.layer:
            hidden = layer(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        raise ValueError("BertModel is an encoder: it embeds (LLM.embed), it cannot generate.")

    def _hf_names(self, name: str) -> str:
        return name.removeprefix("bert.")  # BertFor* checkpoints nest the encoder

    def expected_weights(self) -> set[str]:
        out = set()
        for name, _ in self.named_parameters():
            if ".self.qkv_proj." in name:
                out.update(name.replace("self.qkv_proj", h) for _, h, _ in
                           self.stacked_params_mapping)
            else:
                out.add(name)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((self._hf_names(n), t) for n, t in weights)
        return load_hf_weights(self, renamed, self.stacked_params_mapping,
                               lambda name: name.startswith(self.skipped_prefixes))
