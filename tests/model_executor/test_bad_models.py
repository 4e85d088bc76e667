"""Bad model folders and files: each gives a clear error that names what to fix."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from keel.config import ModelConfig
from keel.model_executor.loader import load_model
from keel.model_executor.weight_errors import WeightLoadError
from tests.hf_models import make_hf_model


@pytest.fixture
def folder(tmp_path):
    return make_hf_model("llama", tmp_path / "m")


def _edit_weights(folder, fn):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        ModelConfig(str(tmp_path / "nope"))


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig(str(folder))


def test_invalid_config_json(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig(str(folder))


def test_unknown_architecture_lists_supported(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig(str(folder))


def test_no_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="No weights"):
        load_model(ModelConfig(str(folder)))


def test_missing_tensor_is_named(folder):
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(ModelConfig(str(folder)))


def test_unexpected_tensor_is_named(folder):
    _edit_weights(folder, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.extra\.weight"):
        load_model(ModelConfig(str(folder)))


def test_shape_mismatch_is_named(folder):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 96)

    _edit_weights(folder, shrink)
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight.*\(3, 96\)"):
        load_model(ModelConfig(str(folder)))


def test_missing_shard_is_named(folder):
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match="model-00002-of-00002.safetensors"):
        load_model(ModelConfig(str(folder)))


def test_corrupt_safetensors_is_named(folder):
    (folder / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        load_model(ModelConfig(str(folder)))


def test_unknown_dtype(folder):
    with pytest.raises(ValueError, match="Unknown dtype 'float64'"):
        ModelConfig(str(folder), dtype="float64")


def test_unsupported_rope_type(tmp_path):
    folder = make_hf_model(
        "llama", tmp_path / "d",
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    with pytest.raises(NotImplementedError, match="dynamic"):
        load_model(ModelConfig(str(folder)))
