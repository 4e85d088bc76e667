"""One prepared device check, for a session that has a GPU lent (run it there as one script):

    .venv/bin/python benchmarks/gpu_check.py --device cuda

It exercises what the CPU test suite cannot: CUDA tensors through CpuGpuBuffer.copy_to_gpu,
synchronize_input_prep's CUDA event, the profiling run and gpu_memory_utilization sizing, and
the torch paged-attention path on the GPU. For a small random Llama and the default model it
checks greedy LLM.generate against transformers on the same device (float32), and prints the
KV cache sizing. Exit code 0 when every check passes. `--device cpu` runs the same checks here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests/

from keel import LLM, SamplingParams
from keel.config import resolve_model_path


def check(folder: str, device: str, prompts: list[list[int]], max_tokens: int) -> bool:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = hf.to(device).eval()
    hf.generation_config.eos_token_id = None
    expected = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_tokens)
        expected.append(out[0, len(p):].tolist())
    del hf
    t0 = time.perf_counter()
    llm = LLM(folder, dtype="float32", device=device, gpu_memory_utilization=0.5)
    print(f"  engine up in {time.perf_counter() - t0:.1f} s, "
          f"{llm.config.cache_config.num_blocks} KV blocks")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    same = sum(o.outputs[0].token_ids == e for o, e in zip(outs, expected))
    print(f"  greedy identical to transformers: {same}/{len(prompts)}")
    llm.shutdown()
    return same == len(prompts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("CUDA is not available here")
            return 2
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    from tests.hf_models import make_hf_model

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_hf_model("llama", Path(tmp) / "llama"))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 17, 40, 64)]
        print("random llama:")
        ok &= check(folder, args.device, prompts, 24)
    default = str(resolve_model_path(None))
    tok = transformers.AutoTokenizer.from_pretrained(default)
    prompts = [tok(t).input_ids for t in ("The capital of France is", "Once upon a time",
                                          "def fibonacci(n):")]
    print("default model:")
    ok &= check(default, args.device, prompts, 32)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
