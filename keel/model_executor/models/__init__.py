"""Model registry: HF `architectures` name -> keel class."""

from __future__ import annotations

from typing import Any

from torch import nn

_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    # Pooling only (no LM head): encoders, and decoders saved as their bare model.
    "BertModel": ("bert", "BertModel"),
    "LlamaModel": ("llama", "LlamaEmbeddingModel"),
    "MistralModel": ("llama", "LlamaEmbeddingModel"),
    "Qwen2Model": ("llama", "Qwen2EmbeddingModel"),
    "Qwen3Model": ("llama", "Qwen3EmbeddingModel"),
}
POOLING_ONLY = {"BertModel", "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: Any) -> type[nn.Module]:
    import importlib

    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(f"keel.model_executor.models.{module}"), cls)
    raise ValueError(
        f"Model architecture(s) {archs} are not supported by keel. "
        f"Supported architectures: {', '.join(supported_architectures())}."
    )
