"""keel end to end as two other kinds of CPU run it: one with AVX2 and no AVX-512 (keel's
kernels built for x86-64-v3, oneDNN held to AVX2) and an AVX-512 one without AMX tiles (oneDNN
held to AVX512_CORE_BF16: `vs_vllm.py --no-amx`); `KEEL_AMX=0` in both. CI runs on whichever
machine a session has (AVX2-only AMD, AVX-512 AMD and AMX Xeons so far), and the rest of the
suite tests the other kinds' paths kernel by kernel only. Each kind runs in a process of its
own (the build flags and the AMX answer are read once a process).

A model with the default model's attention shape (9 heads, 3 KV heads, head size 64, hidden
576; 2 layers) and prompts longer than the attention kernel's query limit, so that decode rows,
short prompt rows and long prompt chunks (on keel's prefill kernel, with and without context
before them: without AMX no SDPA is timed against it) all run:
- float32: greedy tokens identical to transformers', through the fused pass;
- bfloat16: each prompt token's logprob within 0.25 of transformers' float32 one (0.057-0.068
  measured here on both kinds and with AMX; a wrong kernel is off by whole units)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import os, sys, torch
sys.path.insert(0, {root!r})
import keel.cpu_ops as c
ops = c.get_cpu_ops()
assert ops is not None, "keel's kernels did not build"
assert ("avx512f" in ops.built_for()) == {avx512!r}, ops.built_for()
assert not ops.amx_gemm_available() and not ops.prefill_attention_amx_available()
from pathlib import Path
from keel import LLM, SamplingParams
from tests.hf_models import hf_reference, make_hf_model
from tests.model_executor.test_models import hf_greedy, random_prompt

folder = make_hf_model("llama", Path({folder!r}), hidden_size=576, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                       num_hidden_layers=2, initializer_range=0.05)
hf = hf_reference(folder)
prompts = [random_prompt(n, seed=n) for n in (5, 37, 300, 12, 420)]
want = [hf_greedy(hf, p, 10) for p in prompts]
ids = [{{"prompt_token_ids": p}} for p in prompts]
# A 512-token budget: the 420-token prompt's second chunk has its first tokens as context.
llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=512)
outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                    use_tqdm=False)
assert [o.outputs[0].token_ids for o in outs] == want
model = llm.engine_core.model_executor.driver_worker.model_runner.model
assert model.model.fused_decode.plan, "the fused pass was not built"
del llm, outs

llm = LLM(str(folder), dtype="bfloat16", max_num_batched_tokens=512)
outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                        prompt_logprobs=0), use_tqdm=False)
worst = 0.0
for p, o in zip(prompts, outs):
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0], -1)
    for i in range(1, len(p)):
        worst = max(worst, abs(o.prompt_logprobs[i][p[i]].logprob - ref[i - 1, p[i]].item()))
    assert len(o.outputs[0].token_ids) == 4
assert worst < 0.25, worst
print("ok", worst)
"""


@pytest.mark.parametrize("kind", ["avx2", "avx512-no-amx"])
def test_other_cpu_kinds_match_transformers(kind, tmp_path):
    with open("/proc/cpuinfo") as f:
        flags = f.read().split()
    assert "avx2" in flags, "keel's CI machines have AVX2"
    env = {**os.environ, "KEEL_AMX": "0",
           "ONEDNN_MAX_CPU_ISA": "AVX2" if kind == "avx2" else "AVX512_CORE_BF16"}
    env.pop("KEEL_CPU_MARCH", None)
    if kind == "avx2":
        env["KEEL_CPU_MARCH"] = "x86-64-v3"  # keel's kernels built for AVX2, no AVX-512
    code = CHECK.format(root=str(ROOT), avx512=kind != "avx2" and "avx512f" in flags,
                        folder=str(tmp_path / "model"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    assert out.returncode == 0 and out.stdout.strip().startswith("ok"), out.stderr[-3000:]
