"""Quantize a loaded model's weights in place (after loading, before packing for oneDNN).

- `"gguf"` (a .gguf file, the default for one): every linear layer whose GGUF tensors are
  Q4_0 / Q4_1 / Q4_K takes their own 4-bit blocks (int4, groups of 32; a merged layer such as
  `qkv_proj` concatenates its parts' rows); a layer from Q8_0 / Q6_K / Q5_* becomes int8 per
  output row; float tensors stay dense. The LM head follows the file's type for it (int8
  when it is quantized); the embedding table keeps the file's values in float32 (a lookup
  reads only the pass's rows, so its bytes do not grow with the model's size per token).
- `"int8"` / `"int4"` (any HF model): linear layers int8 per row / int4 in groups of
  `group_size` (the largest of 128, 64, 32 that divides K by default); the LM head int8.
- `"w8a8"` (any HF model, opt-in, lossy): linear layers int8 per row with int8 activations
  per token (layers/quantization.py `W8A8Weight`), the LM head dense: for many requests at
  once, where the weight-only forms fall back to the dense GEMM.

Logs which weights are quantized and how many bytes one token reads.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from keel.model_executor.gguf_loader import HEAD_INT8_FILE, INT4_FILE, TYPES_FILE
from keel.model_executor.gguf_quant import INT4_TYPES, INT8_TYPES
from keel.model_executor.layers.amx_choice import amx_compressed_copy_chosen, amx_gemm_chosen
from keel.model_executor.layers.linear import LinearBase
from keel.model_executor.layers.quantization import (
    choose_group_size,
    keel_int4_form,
    pack_int4,
    pack_int4_pairs,
    pack_int8,
    pack_w8a8,
    quantize_int4,
    quantize_int8,
)
from keel.model_executor.layers.vocab_embedding import ParallelLMHead
from keel.utils import replace_atomically

logger = logging.getLogger(__name__)
METHODS = ("gguf", "int8", "int4", "w8a8")
MiB = 1 << 20


def quantize_model(model: nn.Module, method: str, folder: Path,
                   group_size: int | None = None) -> None:
    if method not in METHODS:
        raise ValueError(f"Unknown quantization {method!r}: use one of {METHODS} or None.")
    kinds: Counter[str] = Counter()
    types: dict[str, str] = {}
    int4_file = None
    if method == "gguf":
        types = json.loads((folder / TYPES_FILE).read_text())
        if (folder / INT4_FILE).is_file():
            from safetensors import safe_open

            int4_file = safe_open(str(folder / INT4_FILE), framework="pt")
    mapping = getattr(model, "stacked_params_mapping", [])
    dense_bytes = quant_bytes = 0
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            weight = module.weight
            dense_bytes += weight.numel() * weight.element_size()
            if method == "gguf":
                kind = _gguf_linear(module, name, mapping, types, int4_file)
            elif method == "int8":
                module.quant = pack_int8(*quantize_int8(weight.data))
                kind = "int8"
            elif method == "w8a8":  # every pass size: no dense copy kept
                module.quant = pack_w8a8(weight.data)
                module.weight = nn.Parameter(weight.new_empty(0), False)
                kind = "w8a8 (int8 weights and activations)"
            else:
                g = choose_group_size(weight.shape[1], group_size)
                module.quant = pack_int4(*_int4_padded(weight.data, g), g)
                kind = f"int4/g{g}"
            # (the dense weight stays until rows_per_pass.choose_rows_per_pass)
            if module.quant is not None:
                quant_bytes += module.quant.nbytes
            else:
                quant_bytes += weight.numel() * weight.element_size()
            kinds[kind] += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, ParallelLMHead):
        head_bytes = head.weight.numel() * head.weight.element_size()
        dense_bytes += head_bytes
        # A GGUF file without an output tensor ties the LM head to the embedding table.
        head_type = types.get("lm_head.weight") or types.get("model.embed_tokens.weight", "F32")
        if method == "w8a8":  # the LM head stays dense, as in vLLM's W8A8 checkpoints
            quant_bytes += head_bytes
        elif method == "gguf" and head_type in INT4_TYPES + INT8_TYPES:
            head.quant = pack_int8(*_gguf_head_int8(head, folder))
            kinds[f"lm_head int8 (from {head_type})"] += 1
            quant_bytes += head.quant.nbytes
            if head_type == "Q8_0" and head.weight.dtype == torch.bfloat16 and \
                    amx_gemm_chosen() and amx_compressed_copy_chosen("int8"):
                # The file's own int8 blocks, for the AMX GEMM's copy of the head (ParallelLMHead
                # .process_weights_after_loading); not kept after that.
                head.q8_blocks = _q8_0_blocks(folder, "lm_head.weight" if "lm_head.weight"
                                              in types else "model.embed_tokens.weight")
        elif method != "gguf":
            head.quant = pack_int8(*quantize_int8(head.weight.data))
            kinds["lm_head int8 (from float)"] += 1
            quant_bytes += head.quant.nbytes
        else:
            quant_bytes += head_bytes
    logger.info("Quantized weights (%s): %s. A token reads %.1f MiB of weights (dense: %.1f "
                "MiB).", method, ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items())),
                quant_bytes / MiB, dense_bytes / MiB)


def attach_gguf_amx_sources(model: nn.Module, folder: Path) -> None:
    """A folder keel converted from a .gguf, loaded dense in bfloat16 with the AMX GEMM chosen:
    give each linear layer whose tensors were 4-bit the file's own groups (`amx_int4`), and a
    Q8_0 LM head its int8 blocks (`q8_blocks`). The AMX GEMM's copies are then made from them
    where every value widens to exactly the dense bfloat16 weight (packed_weights._amx_copy), so
    each pass computes the same bits as the dense model while reading 0.75 (int4) or ~1.06
    (int8) bytes a weight instead of 2. Nothing else changes: no layer becomes quantized."""
    if not (folder / INT4_FILE).is_file() or not (folder / TYPES_FILE).is_file() \
            or not amx_gemm_chosen():
        return
    from safetensors import safe_open

    types = json.loads((folder / TYPES_FILE).read_text())
    mapping = getattr(model, "stacked_params_mapping", [])
    n = 0
    # Only what a chosen copy takes is read (amx_compressed_copy_chosen measures once).
    if amx_compressed_copy_chosen("int4"):
        with safe_open(str(folder / INT4_FILE), framework="pt") as int4_file:
            for name, module in model.named_modules():
                if not isinstance(module, LinearBase) or module.tp_size != 1 \
                        or module.weight.dtype != torch.bfloat16 or module.weight.shape[1] % 32:
                    continue
                sources = _sources(name, mapping)
                if not {types.get(s, "F32") for s in sources} <= set(INT4_TYPES):
                    continue
                pairs, scale, zero = (torch.cat([int4_file.get_tensor(f"{s}.int4_{x}")
                                                 for s in sources])
                                      for x in ("q", "scale", "zero"))
                module.amx_int4 = pack_int4_pairs(pairs, scale, zero,
                                                  module.weight.shape[1]).keel
                n += 1
    head = getattr(model, "lm_head", None)
    head_name = "lm_head.weight" if "lm_head.weight" in types else "model.embed_tokens.weight"
    if isinstance(head, ParallelLMHead) and types.get(head_name) == "Q8_0" \
            and head.weight.dtype == torch.bfloat16 and head.tp_size == 1 \
            and amx_compressed_copy_chosen("int8"):
        head.q8_blocks = _q8_0_blocks(folder, head_name)
    logger.info("Folder converted from a .gguf: %d layers offer their int4 groups%s to the AMX "
                "GEMM's copies (each kept only where it widens to exactly the bfloat16 weight).",
                n, " and the LM head its Q8_0 blocks" if getattr(head, "q8_blocks", None)
                is not None else "")


def _gguf_head_int8(head: ParallelLMHead, folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8 of a GGUF model's LM head, kept in its cached folder after the first
    load (~0.2 s of start-up for the default model's 49,152 x 576 head; the folder is keyed
    by the GGUF file, so its float32 head never changes). A copy that cannot be read or
    written, or a head of another shape or dtype (tensor parallel, bfloat16), is quantized
    again."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    w = head.weight.data
    path = folder / HEAD_INT8_FILE
    whole = w.dtype == torch.float32 and head.tp_size == 1  # the file's head, not a shard
    if whole:
        try:
            saved = load_file(str(path))
            if saved["q"].shape == w.shape and saved["scale"].shape == w.shape[:1]:
                return saved["q"], saved["scale"]
        except (OSError, KeyError, SafetensorError) as e:
            if not isinstance(e, FileNotFoundError):
                logger.warning("Cannot read %s (%s); quantizing the LM head again.", path, e)
    q, scale = quantize_int8(w)
    if whole:
        try:
            replace_atomically(path, lambda tmp: save_file({"q": q, "scale": scale}, str(tmp)))
        except OSError as e:  # a read-only cache only costs the next start this step
            logger.info("Cannot keep the quantized LM head in %s (%s).", path, e)
    return q, scale


def q8_0_blocks_of(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A Q8_0 tensor's (q int8 [N, K], d float32 [N, K / 32]) recovered exactly from its
    float32 values w = q d (GGUF's dequantization: d is a float16, and each block's largest
    |q| is 127, so d = max |w| / 127 exactly), or None where w is not such a tensor."""
    n, k = w.shape
    if k % 32 or w.dtype != torch.float32:
        return None
    blocks = w.view(n, k // 32, 32)
    d = blocks.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, blocks / d[..., None], 0.0).round_()
    if not (q.abs() <= 127).all() or not torch.equal(q * d[..., None], blocks):
        return None
    return q.to(torch.int8).view(n, k), d


def _q8_0_blocks(folder: Path, hf_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q8_0_blocks_of the checkpoint's float32 tensor `hf_name` (None if it is not there)."""
    from safetensors import safe_open

    from keel.model_executor.loader import weight_files

    for f in weight_files(folder):
        if f.suffix != ".safetensors":
            continue
        with safe_open(str(f), framework="pt") as sf:
            if hf_name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                return q8_0_blocks_of(sf.get_tensor(hf_name))
    return None


def _int4_padded(w: torch.Tensor, group: int):
    """quantize_int4 over K padded with zero columns to a multiple of the group."""
    k = w.shape[1]
    if k % group:
        w = torch.nn.functional.pad(w, (0, group - k % group))
    q, s, z = quantize_int4(w, group)
    return q[:, :k], s, z


def _sources(name: str, mapping: list[tuple[str, str, Any]]) -> list[str]:
    """HF weight names a keel linear layer was loaded from, in row order."""
    merged = name.rsplit(".", 1)[-1]
    parts = [hf for m, hf, _ in mapping if m == merged]
    return [f"{name.rsplit('.', 1)[0]}.{p}.weight" for p in parts] or [f"{name}.weight"]


def _gguf_linear(module: LinearBase, name: str, mapping, types: dict[str, str],
                 int4_file) -> str:
    sources = _sources(name, mapping)
    kinds = {types.get(s, "F32") for s in sources}
    if kinds <= set(INT4_TYPES) and int4_file is not None:
        k = module.weight.shape[1]
        if module.tp_size == 1 and k % 32 == 0 and keel_int4_form():
            # The file's nibble pairs are the kernel's: no unpacking and packing again.
            pairs, scale, zero = (torch.cat([int4_file.get_tensor(f"{s}.int4_{x}")
                                             for s in sources]) for x in ("q", "scale", "zero"))
            module.quant = pack_int4_pairs(pairs, scale, zero, k)
            return f"int4/g32 (GGUF {'+'.join(sorted(kinds))})"
        parts = [_read_int4(int4_file, s) for s in sources]
        if module.tp_size > 1:
            q, scale, zero = _this_rank(module, name, mapping, parts)
        else:
            q, scale, zero = (torch.cat(x, 0) for x in zip(*parts))
        module.quant = pack_int4(q, scale, zero, 32)
        return f"int4/g32 (GGUF {'+'.join(sorted(kinds))})"
    if kinds <= set(INT4_TYPES + INT8_TYPES):
        module.quant = pack_int8(*quantize_int8(module.weight.data))
        return f"int8 (from GGUF {'+'.join(sorted(kinds))})"
    return f"dense (GGUF {'+'.join(sorted(kinds))})"


def _this_rank(module: LinearBase, name: str, mapping, parts) -> list[torch.Tensor]:
    """This tensor-parallel rank's rows (column parallel) or columns (row parallel) of the
    4-bit values and of their per-group scale and zero, cut by the layer's own weight_loader
    as it cut the dense weight: the groups of 32 run along K, so a row-parallel shard must
    start and end on a group boundary."""
    merged = name.rsplit(".", 1)[-1]
    shard_ids = [sid for m, _, sid in mapping if m == merged] or [None]
    n, k = module.weight.shape  # this rank's
    if k % 32:
        raise NotImplementedError(
            f"{name}: {k} input features per tensor-parallel rank is not a multiple of the "
            "GGUF 4-bit group (32); keel cannot split those groups yet: pass "
            "quantization=None (dequantized) or a smaller tensor_parallel_size.")
    out = []
    for i, cols in enumerate((k, k // 32, k // 32)):  # q, scale, zero
        local = torch.nn.Parameter(torch.empty(n, cols, dtype=parts[0][i].dtype), False)
        for part, shard_id in zip(parts, shard_ids):
            module.weight_loader(local, part[i], shard_id)
        out.append(local.data)
    return out


def _read_int4(f, hf_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed = f.get_tensor(f"{hf_name}.int4_q")  # uint8 [N, K / 2]: two nibbles per byte
    q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return (q.to(torch.int32), f.get_tensor(f"{hf_name}.int4_scale"),
            f.get_tensor(f"{hf_name}.int4_zero"))
