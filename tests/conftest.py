"""Shared fixtures: small random models saved as real Hugging Face folders (offline)."""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import make_hf_model


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """Factory: hf_model_dir("llama") -> folder saved by transformers (cached per session)."""
    cache: dict[str, str] = {}

    def make(kind: str) -> str:
        if kind not in cache:
            cache[kind] = str(make_hf_model(kind, tmp_path_factory.mktemp(kind)))
        return cache[kind]

    return make


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
