"""keel's own config.json reader against transformers' AutoConfig: every field keel (or a user)
reads is equal, for each model type the reader knows, in the new and the legacy JSON forms and
with every default left out; what it does not know goes to AutoConfig. Also the activations
keel takes from torch against transformers' ACT2FN, and the tokenizer loaded with keel's config
against the plain AutoTokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer
from transformers.activations import ACT2FN

from keel.engine.llm import load_tokenizer
from keel.model_executor.hf_config import HFConfig, load_hf_config
from keel.model_executor.layers.activation import _TORCH_ACTIVATIONS, get_act_fn
from tests.hf_models import ARCHS, make_hf_model, write_legacy_config

FIELDS = [
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "rope_parameters", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "dtype", "bos_token_id", "eos_token_id", "pad_token_id", "pretraining_tp",
]
MISSING = object()
ARCH_OF = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def write(folder, cfg: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def assert_same_as_transformers(folder) -> HFConfig:
    ours = load_hf_config(folder)
    ref = AutoConfig.from_pretrained(str(folder))
    assert isinstance(ours, HFConfig), "expected keel's fast reader to take this config"
    for name in FIELDS:
        assert getattr(ours, name, MISSING) == getattr(ref, name, MISSING), name
    return ours


@pytest.mark.parametrize("model_type", sorted(ARCH_OF))
def test_every_default_matches(tmp_path, model_type):
    cfg = {"architectures": [ARCH_OF[model_type]], "model_type": model_type}
    assert_same_as_transformers(write(tmp_path, cfg))


@pytest.mark.parametrize("model_type", sorted(ARCH_OF))
@pytest.mark.parametrize("form", ["new", "legacy"])
def test_small_configs_in_both_forms(tmp_path, model_type, form):
    cfg = {"architectures": [ARCH_OF[model_type]], "model_type": model_type,
           "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 96, "num_hidden_layers": 3, "vocab_size": 300,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "eos_token_id": [2, 7],
           "max_position_embeddings": 512}
    if form == "new":
        cfg.update(dtype="bfloat16", rope_parameters={"rope_type": "default",
                                                     "rope_theta": 123456.0})
    else:
        cfg.update(torch_dtype="float16", rope_theta=5e5, rope_scaling=None)
    ours = assert_same_as_transformers(write(tmp_path, cfg))
    assert ours.dtype == (torch.bfloat16 if form == "new" else torch.float16)


def test_qwen_sliding_window_layers(tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
           "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 32,
           "max_window_layers": 2}
    ours = assert_same_as_transformers(write(tmp_path / "a", cfg))
    assert ours.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    cfg.update(layer_types=["sliding_attention", "full_attention"] * 2,
               model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    assert_same_as_transformers(write(tmp_path / "b", cfg))


@pytest.mark.parametrize("arch", ARCHS)
def test_test_models_folders(hf_model_dir, tmp_path, arch):
    """The folders the model tests load (written by transformers), and their legacy forms."""
    import shutil

    folder = hf_model_dir(arch)
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    write_legacy_config(legacy)
    for f in (folder, legacy):
        ours, ref = load_hf_config(f), AutoConfig.from_pretrained(str(f))
        if arch == "llama":  # llama3 RoPE scaling: AutoConfig's job
            assert type(ours) is type(ref)
        for name in FIELDS:
            assert getattr(ours, name, MISSING) == getattr(ref, name, MISSING), (f, name)


@pytest.mark.parametrize("change", [
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
    {"partial_rotary_factor": 0.5},
    {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
])
def test_what_the_reader_does_not_know_goes_to_transformers(tmp_path, change):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **change}
    ours = load_hf_config(write(tmp_path, cfg))
    assert type(ours) is type(AutoConfig.from_pretrained(str(tmp_path)))
    assert not isinstance(ours, HFConfig)


def test_bad_values_get_transformers_error(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": 100, "num_attention_heads": 3}
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(write(tmp_path, cfg))


def test_env_forces_transformers(tmp_path, monkeypatch):
    folder = write(tmp_path, {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert isinstance(load_hf_config(folder), HFConfig)
    monkeypatch.setenv("KEEL_HF_CONFIG", "transformers")
    assert type(load_hf_config(folder)).__name__ == "Qwen2Config"


@pytest.mark.parametrize("name", sorted(_TORCH_ACTIVATIONS))
def test_activations_match_act2fn(name):
    x = torch.randn(4, 257) * 4
    assert torch.equal(get_act_fn(name)(x), ACT2FN[name](x))
    assert torch.equal(get_act_fn(name)(x.bfloat16()), ACT2FN[name](x.bfloat16()))


def test_other_activations_come_from_act2fn():
    x = torch.randn(3, 17)
    assert torch.equal(get_act_fn("gelu_new")(x), ACT2FN["gelu_new"](x))
    with pytest.raises(ValueError, match="hidden_act"):
        get_act_fn("no_such_act")


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory):
    """A llama folder with plain RoPE (the test models' llama uses llama3 scaling, which
    keel's config reader leaves to AutoConfig), like keel's default model."""
    return make_hf_model("llama", tmp_path_factory.mktemp("plain_llama"),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "plain_llama"])
def test_tokenizer_with_keel_config(hf_model_dir, plain_llama, arch):
    folder = plain_llama if arch == "plain_llama" else hf_model_dir(arch)
    config = load_hf_config(folder)
    assert isinstance(config, HFConfig)
    ours, ref = load_tokenizer(folder, config), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(ref)
    text = "hello world, the quick brown fox"
    assert ours(text).input_ids == ref(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(
        chat, tokenize=False)
    assert ours.eos_token_id == ref.eos_token_id


def test_generic_tokenizer_folder_is_loaded_without_autotokenizer(hf_model_dir, plain_llama,
                                                                  tmp_path):
    """A llama folder naming transformers' generic class gets that class directly (what
    AutoTokenizer would return, as the test above checks), without importing transformers'
    model registry; any other folder goes through AutoTokenizer."""
    import shutil
    import subprocess
    import sys

    from keel.engine.llm import _generic_tokenizer_folder

    folder = plain_llama
    assert _generic_tokenizer_folder(folder, load_hf_config(folder))
    qwen2 = hf_model_dir("qwen2")  # AutoTokenizer maps qwen2 to its own class
    assert not _generic_tokenizer_folder(qwen2, load_hf_config(qwen2))
    custom = tmp_path / "custom"
    shutil.copytree(folder, custom)
    cfg = json.loads((custom / "tokenizer_config.json").read_text())
    (custom / "tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {"x": "y"}}))
    assert not _generic_tokenizer_folder(custom, load_hf_config(custom))
    probe = ("import sys; from keel.engine.llm import load_tokenizer; "
             "from keel.model_executor.hf_config import load_hf_config; "
             f"p = {str(folder)!r}; t = load_tokenizer(p, load_hf_config(p)); "
             "print(type(t).__name__, 'transformers.models.auto' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == ["TokenizersBackend", "False"]
