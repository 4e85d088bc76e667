"""Load a Hugging Face model folder into keel's model classes.

Weights: `*.safetensors` (one file, or shards listed in `model.safetensors.index.json`) or
`pytorch_model*.bin`. Each tensor goes through its parameter's `weight_loader`, which is where
merged layers (`qkv_proj`, `gate_up_proj`) and, later, tensor-parallel slices are handled.
Every failure names the tensor or file to fix.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from keel.config import ModelConfig
from keel.model_executor.layers import gemm_choice
from keel.model_executor.models import resolve_architecture
from keel.model_executor.weight_errors import WeightLoadError

logger = logging.getLogger(__name__)


def _shards_from_index(index: Path) -> list[Path]:
    """The files a `*.index.json` lists, each checked to exist."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise WeightLoadError(f"{index} is not a valid weight index: {e}") from e
    files = [index.parent / f for f in sorted(set(weight_map.values()))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightLoadError(f"Shard(s) listed in {index.name} are missing: {missing}")
    return files


def weight_files(folder: Path) -> list[Path]:
    """safetensors first (indexed shards, else any *.safetensors), then pytorch_model*.bin."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return _shards_from_index(index)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    bin_index = folder / "pytorch_model.bin.index.json"
    if bin_index.is_file():
        return _shards_from_index(bin_index)
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise WeightLoadError(
            f"No weights in {folder}: expected *.safetensors or pytorch_model*.bin files."
        )
    return files


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                        yield name, sf.get_tensor(name)
            except SafetensorError as e:
                raise WeightLoadError(f"Cannot read {f}: {e}") from e
        else:
            try:
                state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # torch raises many types for a corrupt file
                raise WeightLoadError(f"Cannot read {f}: {e}") from e
            yield from state.items()


def load_model(model_config: ModelConfig) -> nn.Module:
    """Build the architecture named in config.json, load its weights, move it to the device."""
    cls = resolve_architecture(model_config.hf_config)
    folder = model_config.model_path
    files = weight_files(folder)  # fail on a missing checkpoint before building the model
    with torch.device("cpu"):
        model = cls(model_config.hf_config, dtype=model_config.torch_dtype)
    loaded = model.load_weights(iterate_weights(files))
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise WeightLoadError(
            f"{len(missing)} tensor(s) missing from the checkpoint in {folder}: {shown}"
        )
    logger.info("Loaded %s from %s (%s)", cls.__name__, folder, model_config.torch_dtype)
    if model_config.quantization_method is not None:
        from keel.model_executor.quantize_model import quantize_model

        quantize_model(model, model_config.quantization_method, folder,
                       model_config.quantization_group_size)
    elif model_config.torch_dtype == torch.bfloat16 and model_config.torch_device.type == "cpu":
        from keel.model_executor.quantize_model import attach_gguf_amx_sources

        attach_gguf_amx_sources(model, folder)  # a no-op unless keel converted the folder
    model = model.to(model_config.torch_device).eval()
    # e.g. pack weights for the CPU GEMM (layers/packed_weights.py; float16 FMAs where
    # dtype="auto" allows them: layers/gemm_choice.py)
    with gemm_choice.float16_gemms(model_config.float16_gemms):
        for module in model.modules():
            process = getattr(module, "process_weights_after_loading", None)
            if process is not None:
                process()
    if model_config.quantization_method is not None:
        from keel.model_executor.rows_per_pass import choose_rows_per_pass

        choose_rows_per_pass(model)
    return model
