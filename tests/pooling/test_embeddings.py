"""Embeddings through the engine against sentence-transformers (the default MiniLM model) and
transformers (last-token pooling over random decoders), float32."""

from __future__ import annotations

import json
import shutil
from typing import ClassVar

import pytest
import torch
import transformers

from keel import LLM, PoolingParams, SamplingParams
from keel.executor.uniproc import UniProcExecutor
from tests.hf_models import make_hf_model
from tests.model_executor.test_models import random_prompt
from tests.pooling.conftest import cosine_distance, texts

TOL = 1e-5  # cosine distance


@pytest.fixture(scope="module")
def minilm():
    llm = LLM(runner="pooling", dtype="float32")
    yield llm
    llm.shutdown()


def st_embed(st, batch: list[str]) -> torch.Tensor:
    return st.encode(batch, convert_to_tensor=True, batch_size=len(batch)).float()


def test_default_model_is_minilm_with_its_folder_pooling(minilm, minilm_path):
    mc = minilm.config.model_config
    assert mc.model_path == minilm_path and mc.runner_type == "pooling"
    assert (mc.pooler_config.pooling_type, mc.pooler_config.normalize) == ("MEAN", True)
    assert mc.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    # An encoder's prompts are never chunked and never come from the prefix cache.
    assert not minilm.config.scheduler_config.enable_chunked_prefill
    assert not minilm.config.cache_config.enable_prefix_caching


@pytest.mark.parametrize("batch", [["A man is eating food."], texts(9, seed=1)],
                         ids=["single", "mixed_lengths"])
def test_minilm_equals_sentence_transformers(minilm, sentence_transformer, batch):
    outs = minilm.embed(batch, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert got.shape == (len(batch), 384)
    assert cosine_distance(got, st_embed(sentence_transformer, batch)).max() < TOL
    assert torch.allclose(got.norm(dim=1), torch.ones(len(batch)), atol=1e-5)
    tok = minilm.tokenizer
    assert [o.prompt_token_ids for o in outs] == [tok.encode(t) for t in batch]


def test_texts_that_need_several_steps(minilm_path, sentence_transformer):
    """60 texts against a 256-token step budget: several steps, each prompt whole in one."""
    batch = texts(60, seed=2, lo=20, hi=60)
    llm = LLM(runner="pooling", dtype="float32", max_num_batched_tokens=256)
    steps = []
    original = llm.engine_core.step_fn

    def counting():
        out = original()
        steps.append(1)
        return out

    llm.engine_core.step_fn = counting
    got = torch.tensor([o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)])
    llm.shutdown()
    assert len(steps) >= 5
    assert cosine_distance(got, st_embed(sentence_transformer, batch)).max() < TOL


def test_encode_is_the_unnormalised_mean(minilm, sentence_transformer):
    batch = texts(4, seed=3)
    raw = torch.stack([o.outputs.data for o in minilm.encode(batch, use_tqdm=False)])
    ref = sentence_transformer.encode(batch, convert_to_tensor=True, normalize_embeddings=False,
                                      output_value="token_embeddings")
    means = torch.stack([t.float().mean(0) for t in ref])  # no padding in per-text outputs
    assert torch.allclose(raw, means, atol=1e-5)
    assert not torch.allclose(raw.norm(dim=1), torch.ones(4))
    # normalize=False on embed gives the same raw vectors.
    plain = minilm.embed(batch, PoolingParams(normalize=False), use_tqdm=False)
    assert torch.allclose(torch.tensor([o.outputs.embedding for o in plain]), raw, atol=1e-6)


def test_cls_pooling_without_normalize(tmp_path, minilm_path):
    """The folder's pooling is what counts: the same weights with CLS pooling and no
    Normalize module, against sentence-transformers loading that folder."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "cls"
    shutil.copytree(minilm_path, folder)
    pooling = json.loads((folder / "1_Pooling/config.json").read_text())
    pooling.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (folder / "1_Pooling/config.json").write_text(json.dumps(pooling))
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(
        [m for m in modules if not m["type"].endswith("Normalize")]))
    batch = texts(5, seed=4)
    llm = LLM(str(folder), dtype="float32")  # auto: a sentence-transformers folder pools
    got = torch.tensor([o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)])
    llm.shutdown()
    assert llm.config.model_config.pooler_config.pooling_type == "CLS"
    ref = SentenceTransformer(str(folder), device="cpu").encode(batch, convert_to_tensor=True)
    assert cosine_distance(got, ref).max() < TOL
    assert torch.allclose(got, ref.float(), atol=1e-4)  # not normalised: the raw CLS state


def hf_last_hidden(folder, prompts: list[list[int]]) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])


@pytest.mark.parametrize("setting", [{}, {"max_num_batched_tokens": 32}],
                         ids=["whole", "chunked_prefill"])
def test_last_token_embedder_on_qwen3_equals_transformers(hf_model_dir, setting):
    folder = hf_model_dir("qwen3")
    prompts = [random_prompt(n, seed=400 + n) for n in (3, 17, 45, 70, 9)]
    llm = LLM(folder, runner="pooling", dtype="float32", **setting)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    raw = torch.stack([o.outputs.data for o in llm.encode(reqs, use_tqdm=False)])
    emb = torch.tensor([o.outputs.embedding for o in llm.embed(reqs, use_tqdm=False)])
    llm.shutdown()
    ref = hf_last_hidden(folder, prompts)
    assert torch.allclose(raw, ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(emb, torch.nn.functional.normalize(ref, dim=-1), atol=1e-5)


def test_bare_qwen3_model_folder_is_detected_as_an_embedder(tmp_path):
    """A decoder saved as its bare `Qwen3Model` (no LM head, no `model.` prefix), as
    Qwen3-Embedding is: auto-detected as pooling, equal to transformers."""
    folder = make_hf_model("qwen3", tmp_path / "causal")
    bare = tmp_path / "bare"
    transformers.AutoModel.from_pretrained(str(folder)).save_pretrained(bare)
    for f in folder.glob("tokenizer*"):
        shutil.copy(f, bare / f.name)
    assert json.loads((bare / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    prompts = [random_prompt(n, seed=500 + n) for n in (5, 30)]
    llm = LLM(str(bare), dtype="float32")
    raw = torch.stack([o.outputs.data for o in llm.encode(
        [{"prompt_token_ids": p} for p in prompts], use_tqdm=False)])
    llm.shutdown()
    assert torch.allclose(raw, hf_last_hidden(bare, prompts), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="has no LM head"):
        LLM(str(bare), runner="generate")


class CountingExecutor(UniProcExecutor):
    calls: ClassVar[dict[str, int]] = {"execute_model": 0, "sample_tokens": 0}

    def execute_model(self, *args, **kwargs):
        CountingExecutor.calls["execute_model"] += 1
        return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        CountingExecutor.calls["sample_tokens"] += 1
        return super().sample_tokens(*args, **kwargs)


def test_sample_tokens_is_skipped_and_generation_still_works(hf_model_dir):
    """The seed: a pooling model's execute_model returns its output, so EngineCore.step never
    makes the second call. A generation model in the same process is unaffected."""
    CountingExecutor.calls.update(execute_model=0, sample_tokens=0)
    llm = LLM(runner="pooling", dtype="float32", max_num_batched_tokens=256,
              distributed_executor_backend=CountingExecutor)
    outs = llm.embed(texts(30, seed=5, lo=20, hi=50), use_tqdm=False)
    llm.shutdown()
    assert len(outs) == 30 and CountingExecutor.calls["execute_model"] >= 4
    assert CountingExecutor.calls["sample_tokens"] == 0

    gen = LLM(hf_model_dir("llama"), dtype="float32", distributed_executor_backend=CountingExecutor)
    out = gen.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    gen.shutdown()
    assert len(out[0].outputs[0].token_ids) == 4
    assert CountingExecutor.calls["sample_tokens"] >= 4


def test_bad_input_is_a_clear_error_and_the_engine_goes_on(minilm, sentence_transformer,
                                                          hf_model_dir):
    long_text = " ".join(["persistent batch"] * 200)  # > 256 tokens
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        minilm.embed([long_text, "fine"], use_tqdm=False)
    with pytest.raises(ValueError, match="No prompts"):
        minilm.embed([], use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate"):
        minilm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=128"):
        minilm.embed(["hi"], PoolingParams(dimensions=128), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    # Truncated as sentence-transformers truncates (the first max_seq_length tokens).
    got = minilm.embed([long_text], truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(got.prompt_token_ids) == 256
    ref = st_embed(sentence_transformer, [long_text])
    assert cosine_distance(torch.tensor([got.outputs.embedding]), ref).max() < TOL
    assert len(minilm.embed(["still serving"], use_tqdm=False)[0].outputs.embedding) == 384

    gen = LLM(hf_model_dir("llama"), dtype="float32")
    with pytest.raises(ValueError, match="runner='pooling'"):
        gen.embed(["hello"], use_tqdm=False)
    gen.shutdown()
