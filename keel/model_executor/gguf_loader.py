"""Turn a GGUF file into a cached Hugging Face model folder.

keel loads models from Hugging Face folders only. A GGUF file is converted once
(dequantised to float32) into ``$KEEL_CACHE_DIR/gguf/<stem>-<hash>/`` holding
``config.json``, ``generation_config.json``, ``model.safetensors`` and the
tokenizer files; later runs reuse that folder. Beside them, in ``keel_gguf/``: each tensor's
GGUF type (``tensor_types.json``), the 4-bit tensors' own blocks (``int4.safetensors``),
from which keel keeps those weights quantized in memory (layers/quantization.py), and the
converted file's path, size and mtime (``source.json``): after a conversion, the folders of
files that are gone or changed are deleted, as no run can find them again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from keel.model_executor.gguf_quant import int4_groups

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# Bumped when the cached folder's contents change (2: the int4 blocks and the tensor types).
CACHE_FORMAT = 2
# In a subfolder, so that the float32 checkpoint stays the folder's only *.safetensors.
INT4_FILE = "keel_gguf/int4.safetensors"
TYPES_FILE = "keel_gguf/tensor_types.json"
# The GGUF file converted: its path, size and mtime (remove_stale_conversions).
SOURCE_FILE = "keel_gguf/source.json"
# The quantized LM head, written by the first load (quantize_model._gguf_head_int8).
HEAD_INT8_FILE = "keel_gguf/lm_head_int8.safetensors"
# The tokenizer transformers built, kept by the first load (keel/engine/fast_tokenizer.py).
TOKENIZER_DIR = "keel_gguf/tokenizer"
KEEL_DIR = "keel_gguf"  # marks a folder keel converted

# general.architecture -> whether llama.cpp permuted the q/k rows for rotary.
# Mistral GGUFs written by llama.cpp declare "llama", so they are covered by it.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {"llama": True, "qwen2": False}

# HF model_type (as AutoConfig derives it from the GGUF metadata) -> model class.
_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors with no HF weight (llama3's rope-scaling factors); dropped with a warning.
_IGNORED_NAMES = {"rope_freqs"}


def _cache_root() -> Path:
    return Path(os.environ.get("KEEL_CACHE_DIR") or Path.home() / ".cache" / "keel")


def gguf_cache_dir(gguf_path: str | os.PathLike) -> Path:
    """Cache folder for ``gguf_path``; the hash changes when the file is replaced or touched."""
    path = _check_exists(gguf_path).resolve()
    st = path.stat()
    key = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{CACHE_FORMAT}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return _cache_root() / "gguf" / f"{path.stem}-{digest}"


def resolve_gguf(gguf_path: str | os.PathLike) -> Path:
    """Return the HF folder for ``gguf_path``, converting the file on first use (and then
    removing the cache's conversions that no later run can use, see remove_stale_conversions)."""
    out_dir = gguf_cache_dir(gguf_path)
    # The folder only ever appears via an atomic rename, so existing means complete.
    if out_dir.is_dir():
        return out_dir
    logger.info("Converting GGUF %s to a Hugging Face folder at %s", gguf_path, out_dir)
    convert_gguf_to_hf(gguf_path, out_dir)
    remove_stale_conversions(out_dir)
    return out_dir


def remove_stale_conversions(keep: Path) -> list[Path]:
    """Delete the folders beside ``keep`` that no run can find again, and return them.

    A folder's name is a hash of its GGUF file's path, size and modification time, so once
    that file is deleted, replaced or touched (a reinstalled package, a removed clone), its
    folder (hundreds of MB to GBs) is never used again. A folder is stale when the file its
    ``keel_gguf/source.json`` names is gone or changed. A folder from before that record
    existed is stale when it holds the same file name as ``keep`` (an earlier install of the
    same model; if it was still in use elsewhere, that run converts its file once again)."""
    stem = keep.name.rsplit("-", 1)[0]
    removed: list[Path] = []
    for folder in sorted(keep.parent.iterdir()):
        if folder == keep or folder.name.startswith(".") or not folder.is_dir():
            continue
        name_stem, _, digest = folder.name.rpartition("-")
        if len(digest) != 16:  # not a conversion's folder
            continue
        try:
            source = json.loads((folder / SOURCE_FILE).read_text())
            st = Path(source["path"]).stat()
            stale = (st.st_size, st.st_mtime_ns) != (source["size"], source["mtime_ns"])
        except FileNotFoundError:
            # No record (a folder from before it), or the file it records is gone.
            stale = name_stem == stem or (folder / SOURCE_FILE).exists()
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: leave it alone
        if stale:
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            shutil.rmtree(folder, ignore_errors=True)
            logger.info("Removed %s, a GGUF conversion whose file is gone or changed "
                        "(%.0f MB)", folder, size / 2**20)
            removed.append(folder)
    return removed


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantise ``gguf_path`` into a float32 HF folder at ``out_dir`` (replaced if present)."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = _check_exists(gguf_path).resolve()
    _check_magic(path)
    out_dir = Path(out_dir)

    reader = gguf.GGUFReader(path)
    arch = _read_string(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    tensor_names = {t.name for t in reader.tensors}
    # Map every name before the slow steps so an odd tensor fails fast.
    hf_names = {t.name: _hf_name(t.name) for t in reader.tensors}

    # transformers maps the GGUF metadata (rope theta, eps, token ids, ...) for us.
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model_class = _MODEL_CLASSES.get(config.model_type)
    if model_class is None:
        raise ValueError(f"{path}: unexpected model_type {config.model_type!r} for {arch!r}")
    config.architectures = [model_class]
    # No separate output matrix means the LM head reuses the embedding.
    config.tie_word_embeddings = "output.weight" not in tensor_names
    config.dtype = torch.float32

    state_dict: dict[str, torch.Tensor] = {}
    # The 4-bit tensors' own blocks, for keel to keep them quantized (layers/quantization.py):
    # q as two nibbles per byte, one (scale, zero) per group of 32.
    int4: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for tensor in reader.tensors:
        hf_name = hf_names[tensor.name]
        if hf_name is None:
            # rope_freqs carries llama3-style rope scaling, which transformers' GGUF config
            # mapping does not rebuild either: the converted model runs without it.
            logger.warning("%s: dropping tensor %s (rope scaling not applied)", path.name, tensor.name)
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; numpy/HF order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weights = weights.reshape(shape)
        types[hf_name] = tensor.tensor_type.name
        groups = int4_groups(tensor.data, tensor.tensor_type.name, shape) \
            if len(shape) == 2 else None
        heads = None
        if SUPPORTED_ARCHITECTURES[arch]:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                heads = config.num_attention_heads
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                heads = config.num_key_value_heads
        if heads is not None:
            weights = _unpermute_rotary(weights, heads)
        if groups is not None:
            q, scale, zero = (_unpermute_rotary(a, heads) if heads else a for a in groups)
            int4[f"{hf_name}.int4_q"] = torch.from_numpy(
                np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)))
            int4[f"{hf_name}.int4_scale"] = torch.from_numpy(np.ascontiguousarray(scale))
            int4[f"{hf_name}.int4_zero"] = torch.from_numpy(np.ascontiguousarray(zero))
        # F32 tensors come back as read-only views of the memory-mapped file: copy those.
        weights = np.require(weights, np.float32, ["C_CONTIGUOUS", "WRITEABLE", "OWNDATA"])
        state_dict[hf_name] = torch.from_numpy(weights)

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(state_dict, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        (tmp_dir / INT4_FILE).parent.mkdir()
        if int4:
            save_file(int4, str(tmp_dir / INT4_FILE), metadata={"format": "pt"})
        (tmp_dir / TYPES_FILE).write_text(json.dumps(types, indent=1))
        st = path.stat()
        (tmp_dir / SOURCE_FILE).write_text(json.dumps(
            {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
        config.save_pretrained(tmp_dir)
        GenerationConfig.from_model_config(config).save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        _move_into_place(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _check_exists(gguf_path: str | os.PathLike) -> Path:
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return path


def _check_magic(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")


def _read_string(reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return str(field.contents())


def _hf_name(gguf_name: str) -> str | None:
    """Map a llama-family GGUF tensor name to its HF name; None for droppable tensors."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[parts[0]]}.{parts[1]}"
    if parts[0] in _IGNORED_NAMES:
        return None
    # Anything else (e.g. qk-norm, MoE experts) means a model keel would load wrongly.
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama-family model")


def _unpermute_rotary(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: per head, its rows are stored as interleaved
    (x0, y0, x1, y1, ...) rotary pairs; HF's rotate_half expects (x0, x1, ..., y0, y1, ...)."""
    rows = weights.shape[0]
    head_dim = rows // n_head
    return (
        weights.reshape(n_head, head_dim // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _move_into_place(tmp_dir: Path, out_dir: Path) -> None:
    """Atomically publish ``tmp_dir`` as ``out_dir``, replacing an older folder if any."""
    try:
        os.replace(tmp_dir, out_dir)
        return
    except OSError:
        if not out_dir.exists():
            raise
    # rename() cannot overwrite a non-empty folder: move the old one aside first.
    old_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.replace(out_dir, old_dir / "folder")
    os.replace(tmp_dir, out_dir)
    shutil.rmtree(old_dir, ignore_errors=True)
