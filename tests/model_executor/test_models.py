"""Each architecture against transformers, in float32: logits within 1e-4, greedy tokens
identical for 32 new tokens through the paged KV cache, and a mixed flat batch (prefill,
chunked prefill, decode) equal to running each request alone."""

from __future__ import annotations

import shutil

import pytest
import torch

from keel.config import ModelConfig
from keel.model_executor.direct import DirectRunner
from keel.model_executor.loader import load_model
from tests.hf_models import ARCHS, VOCAB, hf_reference, make_hf_model, write_legacy_config

PAD = 1  # the tokenizer's pad id; prompts avoid it so transformers does not mask it out


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_logits_and_greedy_match(model, hf, prompt: list[int]) -> None:
    """One prompt's logits within 1e-4 of transformers', and 16 greedy tokens identical."""
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    out = DirectRunner(model, max_reqs=1, max_len=128).step([0], [prompt], [0], all_rows=True)
    assert (out - ref).abs().max().item() < 1e-4
    got = DirectRunner(model, max_reqs=1, max_len=128).greedy([prompt], 16)[0]
    assert got == hf_greedy(hf, prompt, 16)


@pytest.fixture(scope="module")
def loaded(hf_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            folder = hf_model_dir(arch)
            cache[arch] = (load_model(ModelConfig(folder, dtype="float32")), hf_reference(folder))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, loaded):
    model, hf = loaded(arch)
    prompt = random_prompt(57, seed=1)  # longer than mistral's sliding window (24)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    out = DirectRunner(model, max_reqs=1, max_len=128).step([0], [prompt], [0], all_rows=True)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(arch, loaded):
    model, hf = loaded(arch)
    prompts = [random_prompt(n, seed=10 + n) for n in (5, 19, 33)]
    ours = DirectRunner(model, max_reqs=3, max_len=128).greedy(prompts, 32)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_share_one_rope_table(arch, loaded):
    """One cos/sin table for the model, not one per layer (the tests above show it rotates
    every layer as transformers does)."""
    model, _ = loaded(arch)
    tables = {id(layer.self_attn.rotary_emb.cos_cache) for layer in model.model.layers}
    assert len(model.model.layers) > 1 and len(tables) == 1


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_mixed_batch_equals_each_alone(arch, loaded):
    """One flat batch: a fresh prefill, a request mid-prefill (second chunk), and two decodes."""
    model, _ = loaded(arch)
    runner = DirectRunner(model, max_reqs=4, max_len=128)
    a, b, c, d = (random_prompt(n, seed=n) for n in (13, 40, 30, 7))
    # Warm the caches of b (first chunk of 25), c and d (full prompts) in one pass.
    runner.step([1, 2, 3], [b[:25], c, d], [0, 0, 0])
    mixed = runner.step(
        [0, 1, 2, 3], [a, b[25:], [c[-1]], [d[-1]]], [0, 25, len(c), len(d)], all_rows=True
    )
    alone = DirectRunner(model, max_reqs=1, max_len=128)
    expect = [
        alone.step([0], [a], [0], all_rows=True),
        alone.step([0], [b], [0], all_rows=True)[25:],
        alone.step([0], [c + [c[-1]]], [0], all_rows=True)[-1:],
        alone.step([0], [d + [d[-1]]], [0], all_rows=True)[-1:],
    ]
    assert (mixed - torch.cat(expect)).abs().max().item() < 1e-4


def test_legacy_config_form_and_bin_weights(tmp_path, loaded):
    """A config in the older form (`rope_theta`, `rope_scaling`, `torch_dtype`) with linear
    RoPE scaling, weights as pytorch_model.bin."""
    folder = make_hf_model(
        "llama", tmp_path / "m", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 10000.0},
    )
    hf = hf_reference(folder)
    write_legacy_config(folder)
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    cfg = ModelConfig(str(folder), dtype="float32")
    assert cfg.hf_config.rope_parameters["rope_type"] == "linear"
    prompt = random_prompt(30, seed=3)
    out = DirectRunner(load_model(cfg), 1, 64).step([0], [prompt], [0], all_rows=True)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (out - ref).abs().max().item() < 1e-4


def test_sharded_safetensors(tmp_path):
    folder = tmp_path / "sharded"
    src = make_hf_model("qwen2", tmp_path / "src")
    hf = hf_reference(src)
    hf.save_pretrained(folder, max_shard_size="40KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, folder / f)
    assert (folder / "model.safetensors.index.json").exists()
    prompt = random_prompt(20, seed=4)
    out = DirectRunner(load_model(ModelConfig(str(folder), dtype="float32")), 1, 64).step(
        [0], [prompt], [0]
    )
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1:]
    assert (out - ref).abs().max().item() < 1e-4


def test_bfloat16_close_to_float32(hf_model_dir, loaded):
    model32, _ = loaded("qwen3")
    model16 = load_model(ModelConfig(hf_model_dir("qwen3"), dtype="bfloat16"))
    assert next(model16.parameters()).dtype == torch.bfloat16
    prompt = random_prompt(24, seed=5)
    a = DirectRunner(model32, 1, 64).step([0], [prompt], [0])
    b = DirectRunner(model16, 1, 64).step([0], [prompt], [0])
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert torch.nn.functional.cosine_similarity(a, b).min().item() > 0.99


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_fallback_paths_match_transformers(arch, hf_model_dir, monkeypatch):
    """Without keel's compiled kernels (no compiler, or KEEL_CPU_KERNEL=0) and without oneDNN
    packing (KEEL_CPU_GEMM=torch), every layer takes its torch path: still transformers' logits
    and greedy tokens. qwen3 covers the per-head q/k norm before RoPE."""
    from keel import cpu_ops

    monkeypatch.setattr(cpu_ops, "_tried", True)
    monkeypatch.setattr(cpu_ops, "_module", None)
    monkeypatch.setenv("KEEL_CPU_GEMM", "torch")
    folder = hf_model_dir(arch)
    model, hf = load_model(ModelConfig(folder, dtype="float32")), hf_reference(folder)
    assert all(getattr(m, "packed_weight", None) is None for m in model.modules())
    assert_logits_and_greedy_match(model, hf, random_prompt(21, seed=4))


@pytest.mark.parametrize("mode", ["keel", "onednn"])
def test_each_cpu_gemm_matches_transformers(mode, hf_model_dir, monkeypatch):
    """Both packed GEMMs (layers/linear.py picks one per CPU; the tests above run the pick):
    transformers' logits and greedy tokens with every linear layer and the LM head on it."""
    monkeypatch.setenv("KEEL_CPU_GEMM", mode)
    folder = hf_model_dir("qwen2")  # biases on q/k/v
    model, hf = load_model(ModelConfig(folder, dtype="float32")), hf_reference(folder)
    assert {getattr(m, "packed_by", "") for m in model.modules()
            if getattr(m, "packed_weight", None) is not None} == {mode}
    assert_logits_and_greedy_match(model, hf, random_prompt(21, seed=5))
