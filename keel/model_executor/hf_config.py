"""Reading a model folder's config.json.

transformers' `AutoConfig` is the reference, but importing its config classes costs ~1.3-2.3 s
on these CPUs (its validators import `transformers.activations`, which imports torch.compile's
and torch.distributed's Python layers): more than half of keel's start-up. For the decoders keel
serves most (`llama`, `mistral`, `qwen2`, `qwen3`) with the plain RoPE of most checkpoints,
`read_fast` builds the same attributes from the JSON and the defaults of transformers' own
config classes; every other folder (other model types, scaled or nested RoPE, BERT) goes to
`AutoConfig`. `tests/model_executor/test_hf_config.py` compares the two field by field, and
`KEEL_HF_CONFIG=transformers` always takes `AutoConfig`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

# The defaults of transformers' LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config
# (transformers 5.x) for the fields keel or a user reads.
_COMMON = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_cache": True,
    "pad_token_id": None, "attention_dropout": 0.0, "initializer_range": 0.02, "dtype": None,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
              "pretraining_tp": 1, "attention_bias": False, "mlp_bias": False,
              "head_dim": None},
    "mistral": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,
                "max_position_embeddings": 4096 * 32, "bos_token_id": 1, "eos_token_id": 2,
                "sliding_window": 4096},
    "qwen2": {**_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
              "bos_token_id": None, "eos_token_id": None},
}
_DEFAULTS["qwen3"] = {**_DEFAULTS["qwen2"], "head_dim": 128, "attention_bias": False}
_DEFAULT_THETA = 10000.0


class HFConfig:
    """The attributes of a transformers config, read from config.json (see the module doc)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def get_text_config(self, *args: Any, **kwargs: Any) -> HFConfig:
        return self

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__!r})"


def _plain_rope(raw: dict[str, Any]) -> dict[str, Any] | None:
    """{"rope_type": "default", "rope_theta": ...} when the JSON asks for unscaled RoPE, as
    transformers' `standardize_rope_params` writes it; None for anything else."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or "partial_rotary_factor" in raw:
        return None
    if set(params) - {"rope_type", "type", "rope_theta"}:
        return None  # scaled, nested per layer type, or partial: AutoConfig's job
    if params.get("rope_type", params.get("type", "default")) != "default":
        return None
    theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_THETA))
    return {"rope_type": "default", "rope_theta": theta}


def read_fast(raw: dict[str, Any]) -> HFConfig | None:
    """The config for a JSON dict of a type `_DEFAULTS` knows, or None (use AutoConfig)."""
    defaults = _DEFAULTS.get(raw.get("model_type"))
    rope = _plain_rope(raw)
    if defaults is None or rope is None:
        return None
    values = {**defaults, **raw}
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
    if not all(isinstance(values[k], int) and values[k] > 0 for k in sizes):
        return None  # AutoConfig's validators say what is wrong
    if values["hidden_size"] % values["num_attention_heads"]:
        return None
    values.pop("rope_scaling", None)
    values.pop("rope_theta", None)
    values["rope_parameters"] = rope
    dtype = values.pop("torch_dtype", None)
    values["dtype"] = values["dtype"] if values["dtype"] is not None else dtype
    if isinstance(values["dtype"], str):
        values["dtype"] = getattr(torch, values["dtype"])
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values.get("head_dim", 0) is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if "use_sliding_window" in defaults:  # Qwen2 / Qwen3
        if not values["use_sliding_window"]:
            values["sliding_window"] = None
        if values["layer_types"] is None:
            values["layer_types"] = [
                "sliding_attention"
                if values["sliding_window"] is not None and i >= values["max_window_layers"]
                else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]
    return HFConfig(values)


def load_hf_config(path: str | os.PathLike) -> Any:
    """The parsed config.json of a model folder: `read_fast` where it applies, else
    transformers' AutoConfig (both the old `rope_theta`/`rope_scaling`/`torch_dtype` and the
    new `rope_parameters`/`dtype` forms)."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    config = None
    if isinstance(raw, dict) and os.environ.get("KEEL_HF_CONFIG", "fast") != "transformers":
        config = read_fast(raw)
    if config is None:
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(path))
        except (ValueError, KeyError, OSError, TypeError, StrictDataclassError) as e:
            raise ValueError(f"Cannot parse {path / 'config.json'}: {e}") from e
    if not getattr(config, "architectures", None):
        raise ValueError(f"{path / 'config.json'} has no 'architectures' entry.")
    return config
