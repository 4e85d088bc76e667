"""Where a decode step's time goes: keel's default model at 64 requests, every request
decoding, steps timed by phase (schedule, diff, layout, forward, LM head, sampling, update),
keel's compiled kernels timed by call, and oneDNN's GEMMs from the torch profiler.

    .venv/bin/python benchmarks/step_profile.py                      # float32, short prompts
    .venv/bin/python benchmarks/step_profile.py --dtype bfloat16 --workload long
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workload", default="short", choices=["short", "long"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--phase", default="decode", choices=["decode", "prefill"],
                    help="prefill: time the first steps, chunks of prompt tokens")
    ap.add_argument("--warm-kv", action="store_true",
                    help="first run another round's prompts through the engine, so that the K/V "
                         "cache's pages are touched (as after an engine's first minutes)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vs_vllm import kv_cache_gib, make_prompts

    from keel import LLM, SamplingParams, cpu_ops
    from keel.attention.backends import torch_paged
    from keel.utils import cpu_model

    real = cpu_ops.get_cpu_ops()
    kernel_time: dict[str, float] = collections.defaultdict(float)

    class Timed:  # keel's kernels, each call timed
        def __getattr__(self, name):
            fn = getattr(real, name)

            def call(*a, **kw):
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                kernel_time[name] += time.perf_counter() - t0
                return out

            return call

    timed = Timed()
    cpu_ops._module = timed
    torch_paged.get_cpu_ops = lambda: timed

    # The default model's folder, dense, with vs_vllm.py's K/V space (LLM() alone keeps the
    # .gguf file's quantized weights for single-row passes).
    from keel.config import resolve_model_path
    llm = LLM(model=str(resolve_model_path(None)), dtype=args.dtype,
              kv_cache_memory_gib=kv_cache_gib(args.dtype))
    core = llm.engine_core
    runner = core.model_executor.driver_worker.model_runner
    if args.warm_kv:
        llm.generate([{"prompt_token_ids": p} for p in make_prompts(
            args.workload, args.num_requests, 49152, 0, 99)],
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i, p in enumerate(make_prompts(args.workload, args.num_requests, 49152, 0)):
        request, _ = llm.input_processor.process(str(i), {"prompt_token_ids": p}, sp)
        core.add_request(request)
    if args.phase == "prefill":  # one warm-up chunk, then the next ones are timed
        core.step()
    else:
        while core.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                             for r in core.scheduler.running):
            core.step()
        for _ in range(3):
            core.step()

    phase: dict[str, float] = collections.defaultdict(float)

    def time_phase(obj, name, label):
        fn = getattr(obj, name)

        def call(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            phase[label] += time.perf_counter() - t0
            return out

        setattr(obj, name, call)

    time_phase(core.scheduler, "schedule", "schedule")
    time_phase(runner, "_update_states", "diff (_update_states)")
    time_phase(runner, "_prepare_inputs", "layout (_prepare_inputs)")
    time_phase(runner.model, "forward", "forward (decoder layers)")
    time_phase(runner.model, "compute_logits", "LM head")
    if hasattr(runner.model, "greedy_token_ids"):  # the head's own argmax, in a greedy step
        time_phase(runner.model, "greedy_token_ids", "LM head")
    time_phase(runner, "sample_tokens", "sample_tokens")
    time_phase(core.scheduler, "update_from_output", "update_from_output")
    kernel_time.clear()
    n = args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            core.step()
        step = (time.perf_counter() - t0) / n
    import os
    if os.environ.get("KEEL_PROFILE_TABLE"):
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    gemm = sum(e.self_cpu_time_total for e in prof.key_averages()
               if "linear_pointwise" in e.key or e.key in ("aten::addmm", "aten::mm")) / n / 1e3
    ctx = sum(r.num_tokens for r in core.scheduler.running) / max(len(core.scheduler.running), 1)
    print(f"# {cpu_model()} | torch {torch.__version__} | default model, {args.dtype} | "
          f"{args.num_requests} requests, {args.phase}, mean context {ctx:.0f} tokens | "
          f"mean of {n} steps (profiler on)")
    print(f"step {step * 1e3:.1f} ms")
    for label, t in phase.items():
        print(f"  {label:28s} {t / n * 1e3:7.2f} ms")
    print(f"  of which oneDNN GEMMs (the LM head too where it runs there) {gemm:7.2f} ms")
    for name, t in sorted(kernel_time.items(), key=lambda kv: -kv[1]):
        print(f"  of which kernel {name:22s} {t / n * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
