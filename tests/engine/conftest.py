"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from tests.hf_models import hf_reference
from tests.model_executor.test_models import hf_greedy, random_prompt

MAX_TOKENS = 32
PROMPT_LENS = [3, 7, 12, 18, 25, 31, 40, 52, 66, 5, 9, 14, 21, 29, 35, 47, 58, 70, 4, 11, 16,
               23, 44, 61]  # 24 prompts, several longer than the chunk budget below


@pytest.fixture(scope="session")
def reference(hf_model_dir):
    """arch -> (folder, prompts, transformers' greedy continuations)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            folder = hf_model_dir(arch)
            hf = hf_reference(folder)
            prompts = [random_prompt(n, seed=100 + i) for i, n in enumerate(PROMPT_LENS)]
            cache[arch] = (folder, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts])
        return cache[arch]

    return get
