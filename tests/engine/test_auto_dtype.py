"""dtype="auto": the checkpoint's dtype, except a float32 model on a CPU with AMX tiles, which
computes in bfloat16 (as vLLM's "auto" does for every float32 checkpoint)."""

from __future__ import annotations

import torch

from keel import config
from keel.config import ModelConfig


def test_float32_model_computes_in_bfloat16_only_where_the_cpu_has_amx(hf_model_dir,
                                                                      monkeypatch):
    folder = hf_model_dir("llama")  # saved in float32
    monkeypatch.setattr(config, "cpu_has_amx_bfloat16", lambda: False)
    assert ModelConfig(folder, device="cpu").torch_dtype == torch.float32

    monkeypatch.setattr(config, "cpu_has_amx_bfloat16", lambda: True)
    assert ModelConfig(folder, device="cpu").torch_dtype == torch.bfloat16
    # What the user asked for stays, and so do weights kept quantized (their kernels compute
    # in float32).
    assert ModelConfig(folder, dtype="float32", device="cpu").torch_dtype == torch.float32
    assert ModelConfig(folder, device="cpu", quantization="int8").torch_dtype == torch.float32
    assert ModelConfig(None, device="cpu").torch_dtype == torch.float32  # the default .gguf


def test_amx_check_reads_this_cpu():
    assert config.cpu_has_amx_bfloat16() == (
        torch.cpu._is_amx_tile_supported() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
