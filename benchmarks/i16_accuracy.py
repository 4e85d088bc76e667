"""How close `i16_gemm` (dtype="auto"'s GEMMs on a CPU with AVX512-VNNI and neither AMX nor
AVX512-FP16) comes to the exact product on the default model's own layers and activations.

One prompt of English text goes through the default model in float32 (the Python layers, so
that each linear layer's input can be caught); then each of the 120 decoder GEMMs is computed
exactly (float64), in bfloat16 arithmetic (both operands rounded, as `auto` computes where the
CPU has AMX), and on `i16_gemm` of each build named (keel_cpu_ops_<digest> folders, as
benchmarks/kernel_ab.py loads them; default: this tree's build). Each layer's error is its
mean |error| over the mean |exact|; the report is the mean over the layers and the worst.

    KEEL_FUSED_DECODE=0 .venv/bin/python benchmarks/i16_accuracy.py [keel_cpu_ops_<a> ...]
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TEXT = ("The history of the Roman Empire spans many centuries. It began when Augustus became "
        "the first emperor in 27 BC, and in the West it ended in 476 AD. Historians have long "
        "debated the causes of its decline: economic troubles, military defeats, political "
        "instability and the pressure of migrating peoples all played a part.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="*", help="keel_cpu_ops_<digest> folders (default: this one)")
    args = ap.parse_args()
    os.environ["KEEL_FUSED_DECODE"] = "0"  # the Python layers, whose inputs hooks can see
    logging.disable(logging.WARNING)

    import torch
    from safetensors.torch import load_file

    from keel import LLM, SamplingParams
    from keel.config import resolve_model_path
    from keel.cpu_ops import get_cpu_ops
    from keel.model_executor.layers.linear import LinearBase

    if args.builds:
        from kernel_ab import load
        builds = {name: load(name) for name in args.builds}
    else:
        builds = {"this build": get_cpu_ops()}
    if not all(ops is not None and ops.i16_gemm_available() for ops in builds.values()):
        raise SystemExit("i16_gemm needs a build with AVX512-VNNI")

    folder = resolve_model_path(None)
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory_gib=0.5)
    model = llm.engine_core.model_executor.driver_worker.model_runner.model
    inputs: dict[str, torch.Tensor] = {}

    def catch(name):
        def hook(module, a):
            inputs.setdefault(name, a[0].detach().float().clone())
        return hook

    for name, m in model.named_modules():
        if isinstance(m, LinearBase) and not name.endswith("gate_up_proj"):
            m.register_forward_pre_hook(catch(name))
        if name.endswith(".mlp"):  # gate_up runs inside the MLP (with SiLU in its epilogue)
            m.register_forward_pre_hook(catch(name + ".gate_up_proj"))
    llm.generate([TEXT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)

    state: dict[str, torch.Tensor] = {}
    for f in glob.glob(f"{folder}/*.safetensors"):
        state.update(load_file(f))

    # A merged layer's checkpoint parts, in the model's own mapping's order (q, k, v; gate, up).
    parts: dict[str, list[str]] = {}
    for merged, part, _ in type(model).stacked_params_mapping:
        parts.setdefault(merged, []).append(part)

    def weight(name: str) -> torch.Tensor:
        stem, _, leaf = name.rpartition(".")
        if leaf in parts:
            return torch.cat([state[f"{stem}.{p}.weight"] for p in parts[leaf]])
        return state[f"{name}.weight"]

    bf16, errs = [], {b: [] for b in builds}
    for name, x in inputs.items():
        w = weight(name).float()
        exact = x.double() @ w.double().t()
        size = exact.abs().mean()
        rounded = x.bfloat16().float() @ w.bfloat16().float().t()
        bf16.append((rounded.double() - exact).abs().mean() / size)
        for b, ops in builds.items():
            packed, scales = ops.i16_gemm_pack(w)
            out = ops.i16_gemm(x.contiguous(), packed, scales, w.shape[0], None, False)
            errs[b].append((out.double() - exact).abs().mean() / size)
    bf = torch.stack(bf16).mean().item()
    print(f"{len(inputs)} GEMMs of the default model over a prompt of "
          f"{next(iter(inputs.values())).shape[0]} tokens; mean |error| / mean |exact|:")
    print(f"  bfloat16 arithmetic: {bf:.3e}")
    for b, e in errs.items():
        e = torch.stack(e)
        print(f"  i16_gemm ({b}): {e.mean().item():.3e} (1/{bf / e.mean().item():.1f} of "
              f"bfloat16's), worst layer {e.max().item():.3e}")


if __name__ == "__main__":
    main()
