"""Shared by the speculative decoding tests: prompts where n-gram drafts find matches, and
transformers' greedy output for them (per architecture, computed once per module)."""

from __future__ import annotations

import pytest

from tests.hf_models import hf_reference
from tests.model_executor.test_models import hf_greedy, random_prompt

MAX_TOKENS = 24


def prompts_with_repeats() -> list[list[int]]:
    """Prompts with repeated stretches, so that n-gram drafts find matches."""
    out = []
    for i, n in enumerate((6, 11, 17, 25)):
        base = random_prompt(n, seed=300 + i)
        out.append(base + base[: n // 2] + base)
    return out


@pytest.fixture(scope="module")
def reference(hf_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            folder = hf_model_dir(arch)
            hf = hf_reference(folder)
            prompts = prompts_with_repeats()
            cache[arch] = (folder, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts])
        return cache[arch]

    return get
