"""keel's two causal prefill kernels side by side: `prefill_attention` (float32 FMAs) and
`prefill_attention_i16` (int16 dot products; dtype="auto"'s where its GEMMs run on i16_gemm).

Accuracy: an English prompt (~330 tokens) goes through the default model in float32 with the
Python layers, and each of its 30 attention layers' q, k, v (after RoPE) is caught. Each
layer's causal attention is then computed exactly (float64), by the float32 kernel, by the
float32 kernel over K and V rounded to bfloat16 (what dtype="auto" keeps in its cache), and
by the int16 kernel; a kernel's error is its mean |error| / mean |exact|, averaged over the
layers (and the worst layer).

Speed: prompts of the long workload's lengths (310-790 tokens) at the default model's heads
(9 query, 3 KV, 64 dims), float32, the two kernels alternating over rounds in one process;
each kernel's median and best per prompt set, and GFLOP/s (the causal half counted).

    KEEL_FUSED_DECODE=0 .venv/bin/python benchmarks/prefill_attention_i16.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TEXT = ("The history of the Roman Empire spans many centuries. It began when Augustus became "
        "the first emperor in 27 BC, and in the West it ended in 476 AD. Historians have long "
        "debated the causes of its decline: economic troubles, military defeats, political "
        "instability and the pressure of migrating peoples all played a part. ")


def exact(q, k, v, scale):
    """Causal attention of a whole prompt in float64: q [L, H, D], k/v [L, Hkv, D]."""
    import torch

    L, H, _ = q.shape
    g = H // k.shape[1]
    k, v = (t.double().repeat_interleave(g, 1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(L, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    os.environ["KEEL_FUSED_DECODE"] = "0"  # the Python layers, whose inputs hooks can see
    logging.disable(logging.WARNING)

    import torch

    from keel import LLM, SamplingParams
    from keel.attention.layer import Attention
    from keel.config import resolve_model_path
    from keel.cpu_ops import get_cpu_ops

    ops = get_cpu_ops()
    if ops is None or not ops.prefill_attention_i16_available():
        raise SystemExit("prefill_attention_i16 needs a build with AVX512-VNNI")

    llm = LLM(model=str(resolve_model_path(None)), dtype="float32", kv_cache_memory_gib=0.5,
              max_num_batched_tokens=4096)
    model = llm.engine_core.model_executor.driver_worker.model_runner.model
    caught: dict[str, tuple] = {}  # each layer's first call: the whole prompt in one pass

    def catch(module, a):
        t = a[0].shape[0]
        caught.setdefault(module.prefix, (
            a[0].detach().clone().view(t, module.num_heads, module.head_size),
            a[1].detach().clone().view(t, module.num_kv_heads, module.head_size),
            a[2].detach().clone().view(t, module.num_kv_heads, module.head_size),
            module.scale))

    for m in model.modules():
        if isinstance(m, Attention):
            m.register_forward_pre_hook(catch)
    tokenizer = llm.tokenizer
    ids = tokenizer(TEXT * 5)["input_ids"]
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    names = ("float32 kernel", "float32 kernel, K/V in bfloat16", "int16 kernel")
    errs: dict[str, list[float]] = {n: [] for n in names}
    for q, k, v, scale in caught.values():
        ref = exact(q, k, v, scale)
        size = ref.abs().mean()
        kb, vb = (t.bfloat16().float() for t in (k, v))
        for name, fn, kk, vv in ((names[0], ops.prefill_attention, k, v),
                                 (names[1], ops.prefill_attention, kb, vb),
                                 (names[2], ops.prefill_attention_i16, k, v)):
            out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
            fn(q, kk, vv, out, scale, 0)
            errs[name].append(((out.double() - ref).abs().mean() / size).item())
    print(f"The default model's {len(caught)} attention layers over a prompt of {len(ids)} "
          "tokens; mean |error| / mean |exact|:")
    for name, e in errs.items():
        print(f"  {name:32s} {statistics.mean(e):.3e} (worst layer {max(e):.3e})")
    del llm

    torch.manual_seed(0)
    H, Hkv, D = 9, 3, 64
    lengths = (310, 430, 550, 670, 790)
    sets = []
    for L in lengths:  # views of one [L, q + 2 kv] projection, as a prompt pass hands them over
        qkv = torch.randn(L, (H + 2 * Hkv) * D)
        sets.append((qkv[:, : H * D].view(L, H, D), qkv[:, H * D : (H + Hkv) * D].view(L, Hkv, D),
                     qkv[:, (H + Hkv) * D :].view(L, Hkv, D), torch.empty(L, H * D)))
    kernels = {"prefill_attention": ops.prefill_attention,
               "prefill_attention_i16": ops.prefill_attention_i16}
    times: dict[str, list[float]] = {n: [] for n in kernels}
    for r in range(args.rounds + 1):
        for name in (list(kernels) if r % 2 == 0 else list(kernels)[::-1]):
            t0 = time.perf_counter()
            for q, k, v, out in sets:
                kernels[name](q, k, v, out, D**-0.5, 0)
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    flops = sum(4 * H * D * L * L / 2 for L in lengths)
    print(f"\n{len(lengths)} prompts of {lengths[0]}-{lengths[-1]} tokens ({H} heads, {Hkv} KV "
          f"heads, {D} dims, float32), {args.rounds} rounds, {torch.get_num_threads()} threads:")
    for name, t in times.items():
        print(f"  {name:24s} median {statistics.median(t) * 1e3:7.2f} ms  best "
              f"{min(t) * 1e3:7.2f} ms  {flops / statistics.median(t) / 1e9:6.1f} GFLOP/s")
    a, b = (statistics.median(times[n]) for n in kernels)
    print(f"  int16 / float32 time, medians: {b / a:.3f}x")


if __name__ == "__main__":
    main()
