"""Small random models for every supported architecture, saved with transformers'
`save_pretrained` (so config.json is in transformers 5's form), plus a real byte-level BPE
tokenizer trained here, offline, so that string prompts work end to end."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

VOCAB = 320
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "keel is an inference engine with a persistent batch.",
    "Hello world! The capital of France is Paris. 0123456789",
    "Once upon a time there was a little model that generated tokens.",
]

CONFIGS = {
    # GQA, head_dim != hidden/heads, llama3 RoPE scaling, untied embeddings.
    "llama": dict(
        cls="LlamaConfig", hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
        head_dim=32, intermediate_size=200, num_hidden_layers=3, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        tie_word_embeddings=False,
    ),
    # Attention bias on q/k/v, tied embeddings, odd sizes.
    "qwen2": dict(
        cls="Qwen2Config", hidden_size=80, num_attention_heads=5, num_key_value_heads=1,
        intermediate_size=136, num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    # Per-head q/k RMSNorm, head_dim 48 with hidden 64.
    "qwen3": dict(
        cls="Qwen3Config", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=48, intermediate_size=160, num_hidden_layers=3, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    # Sliding window smaller than the prompts used in the tests.
    "mistral": dict(
        cls="MistralConfig", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=24, tie_word_embeddings=False,
    ),
}
ARCHS = list(CONFIGS)


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return fast


def make_hf_model(kind: str, folder: Path, seed: int = 0, **overrides) -> Path:
    tokenizer = make_tokenizer()
    spec = dict(
        vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    spec.update(CONFIGS[kind])
    spec.update(overrides)
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_legacy_config(folder: Path) -> None:
    """Rewrite config.json in the pre-v5 form real folders use: `rope_theta`, `rope_scaling`,
    `torch_dtype`."""
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def hf_reference(folder) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare fixed-length continuations
    return model.eval()
