"""keel's GGUF -> HF folder conversion, checked against transformers' own GGUF loader."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from keel.model_executor import gguf_loader
from keel.model_executor.default_model import default_model_path
from keel.model_executor.gguf_loader import convert_gguf_to_hf, gguf_cache_dir, resolve_gguf

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never let a test write into the real ~/.cache/keel.
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keel-cache")


@pytest.fixture(scope="module")
def converted(gguf_path: Path, cache_root: Path) -> Path:
    """The default model converted once (through resolve_gguf) for the whole module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KEEL_CACHE_DIR", str(cache_root))
        return resolve_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference_model(gguf_path: Path):
    """transformers' own GGUF loading (needs accelerate, a test dependency): slow, so once."""
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path):
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def test_converted_folder_layout(converted: Path, cache_root: Path, gguf_path: Path) -> None:
    assert converted.parent == cache_root / "gguf"
    assert converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert len(converted.name.rsplit("-", 1)[1]) == 16
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (converted / name).is_file(), name
    # No temporary folders left behind next to the result.
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]


def test_logits_match_transformers_gguf(converted: Path, reference_model) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(
        converted, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    ref_params = dict(reference_model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, ref_params[name]), name

    # A fixed chat-shaped token sequence (ids are arbitrary but valid).
    input_ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198,
                               1, 4093, 198, 504, 314, 260, 3575, 282, 4649, 47, 2, 198]])
    with torch.no_grad():
        ours = model.eval()(input_ids).logits
        ref = reference_model(input_ids).logits
    assert ours.shape == (1, input_ids.shape[1], 49152)
    assert (ours - ref).abs().max().item() < 1e-4


def test_tokenizer_matches_transformers_gguf(converted: Path, reference_tokenizer) -> None:
    ours = AutoTokenizer.from_pretrained(converted)
    assert ours.chat_template == reference_tokenizer.chat_template
    kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = ours.apply_chat_template(MESSAGES, **kwargs)
    assert ids == reference_tokenizer.apply_chat_template(MESSAGES, **kwargs)
    assert ids[0] == ours.convert_tokens_to_ids("<|im_start|>")
    text = "Hello world, this is keel.\n  Indented línea 42!"
    assert ours.encode(text) == reference_tokenizer.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)


def test_resolve_reuses_cache(
    converted: Path, cache_root: Path, gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(cache_root))
    mtime = (converted / "model.safetensors").stat().st_mtime_ns

    def _fail(*args, **kwargs):
        raise AssertionError("resolve_gguf reconverted a cached file")

    monkeypatch.setattr(gguf_loader, "convert_gguf_to_hf", _fail)
    assert resolve_gguf(gguf_path) == converted
    assert gguf_cache_dir(gguf_path) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_dir_tracks_file_identity(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf", "llama", ["token_embd.weight"])
    first = gguf_cache_dir(path)
    assert first.parent == tmp_path / "cache" / "gguf"
    assert first.name.startswith("tiny-")
    assert gguf_cache_dir(path) == first
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert gguf_cache_dir(path) != first


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # llama.cpp convert_hf_to_gguf.py LlamaModel.permute (n_head already the kv count).
        head_half = w.shape[0] // n_head // 2
        return w.reshape(n_head, 2, head_half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    for shape, n_head in (((9 * 64, 576), 9), ((3 * 64, 576), 3), ((4 * 8,), 4)):
        w = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(gguf_loader._unpermute_rotary(permute(w, n_head), n_head), w)


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    for fn in (resolve_gguf, gguf_cache_dir, lambda p: convert_gguf_to_hf(p, tmp_path / "out")):
        with pytest.raises(FileNotFoundError, match="nope.gguf"):
            fn(missing)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip file")
    with pytest.raises(ValueError, match="bogus.gguf.*not a GGUF"):
        resolve_gguf(bogus)
    assert not (tmp_path / "cache" / "gguf").exists()


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "fake.gguf", "gpt2", ["token_embd.weight"])
    with pytest.raises(ValueError, match=r"'gpt2'.*llama"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unexpected_tensor_rejected(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "qknorm.gguf", "llama", ["blk.0.attn_q_norm.weight"])
    with pytest.raises(ValueError, match="attn_q_norm"):
        convert_gguf_to_hf(path, tmp_path / "out")


def test_move_into_place_replaces_old_folder(tmp_path: Path) -> None:
    out, new = tmp_path / "model", tmp_path / ".model.tmp-1"
    out.mkdir()
    (out / "old.txt").write_text("old")
    new.mkdir()
    (new / "new.txt").write_text("new")
    gguf_loader._move_into_place(new, out)
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_conversion_records_its_source(converted: Path, gguf_path: Path) -> None:
    source = json.loads((converted / gguf_loader.SOURCE_FILE).read_text())
    st = gguf_path.resolve().stat()
    assert source == {"path": str(gguf_path.resolve()), "size": st.st_size,
                      "mtime_ns": st.st_mtime_ns}


def _fake_conversion(root: Path, name: str, source: Path | None) -> Path:
    """A cache folder as convert_gguf_to_hf leaves it, recording `source` as it is now
    (None: a folder from before keel recorded its source)."""
    folder = root / name
    (folder / "keel_gguf").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    if source is not None:
        st = source.stat()
        (folder / gguf_loader.SOURCE_FILE).write_text(json.dumps(
            {"path": str(source), "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    return folder


def test_stale_conversions_are_removed(tmp_path: Path) -> None:
    """After a conversion, the cache keeps the folders whose GGUF file is still there as it
    was, and deletes those of files that were removed or changed (a reinstalled package, a
    deleted clone: each left ~600 MB behind for the default model before) and, from before
    the source was recorded, those of the same file name."""
    root = tmp_path / "gguf"
    a, b, c = (tmp_path / n for n in ("a.gguf", "b.gguf", "c.gguf"))
    for f in (a, b, c):
        f.write_bytes(b"GGUF" + bytes(10))
    keep = _fake_conversion(root, "a-" + "0" * 16, a)
    other_model = _fake_conversion(root, "b-" + "1" * 16, b)
    touched = _fake_conversion(root, "c-" + "2" * 16, c)
    deleted = _fake_conversion(root, "d-" + "3" * 16, tmp_path / "a.gguf")
    legacy_same = _fake_conversion(root, "a-" + "4" * 16, None)
    legacy_other = _fake_conversion(root, "b-" + "5" * 16, None)
    not_ours = root / "notes"
    not_ours.mkdir()
    in_progress = root / ".a-6666666666666666.tmp-x"
    in_progress.mkdir()
    st = c.stat()
    os.utime(c, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    (deleted / gguf_loader.SOURCE_FILE).write_text(json.dumps(
        {"path": str(tmp_path / "gone.gguf"), "size": 14, "mtime_ns": 1}))

    removed = gguf_loader.remove_stale_conversions(keep)

    assert sorted(removed) == sorted([touched, deleted, legacy_same])
    assert sorted(p.name for p in root.iterdir()) == sorted(
        p.name for p in (keep, other_model, legacy_other, not_ours, in_progress))


def test_resolve_removes_stale_conversions_after_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(10))
    root = tmp_path / "cache" / "gguf"
    old = _fake_conversion(root, "m-" + "7" * 16, path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the file was replaced

    def convert(gguf, out_dir):
        return _fake_conversion(Path(out_dir).parent, Path(out_dir).name, Path(gguf).resolve())

    monkeypatch.setattr(gguf_loader, "convert_gguf_to_hf", convert)
    new = resolve_gguf(path)
    assert new != old and new.is_dir() and not old.exists()
    assert resolve_gguf(path) == new  # the fresh folder is reused, not removed


def _write_gguf(path: Path, arch: str, tensor_names: list[str]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name in tensor_names:
        writer.add_tensor(name, np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_keel_greedy_equals_transformers_gguf(converted: Path, reference_model, reference_tokenizer):
    """keel's own model on the converted folder continues a fixed chat prompt exactly as
    transformers' own GGUF load of the same file does: 32 greedy tokens, float32."""
    from keel.config import ModelConfig
    from keel.model_executor.direct import DirectRunner
    from keel.model_executor.loader import load_model

    prompt = reference_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = torch.tensor([prompt])
    reference_model.generation_config.eos_token_id = None  # a fixed-length continuation
    expected = reference_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
    )[0, len(prompt):].tolist()
    model = load_model(ModelConfig(str(converted), dtype="float32"))
    got = DirectRunner(model, max_reqs=1, max_len=len(prompt) + 32).greedy([prompt], 32)[0]
    assert got == expected
    assert "Paris" in reference_tokenizer.decode(got)
