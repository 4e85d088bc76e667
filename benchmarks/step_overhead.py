"""Per-step CPU cost of the persistent batch: `ModelRunner._update_states` + `_prepare_inputs`
(no forward pass, no sampling), against a runner that rebuilds its batch every step.

The runner is driven with hand-built SchedulerOutputs: step 0 schedules every request as new
(a prompt of --prompt-len tokens), later steps schedule them as cached decodes (1 token each,
num_computed_tokens + 1, a new block every block_size tokens). Between steps, outside the timed
region, the sampled token is appended the way `ModelRunner.sample_tokens` does it.

Scenarios, at each of --sizes running requests:
  steady       the same N requests every step (the case the persistent batch is built for)
  alternating  the seed's worst case: two disjoint sets of N, set A on even steps, set B on odd
               steps; keel removes the unscheduled set and re-adds the other every step

    .venv/bin/python benchmarks/step_overhead.py
    .venv/bin/python benchmarks/step_overhead.py --sizes 8 --steps 20 --warmup 2   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from keel.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from keel.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from keel.sampling_params import SamplingParams
from keel.utils import cpu_model
from keel.worker.input_batch import CachedRequestState, InputBatch
from keel.worker.model_runner import ModelRunner

TARGET_US = 1000.0  # under 1 ms per step at 256 decode requests
TARGET_N = 256
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16


class RebuildRunner(ModelRunner):
    """The peer: no persistent batch. Keeps `self.requests` up to date exactly as ModelRunner
    does, then empties the InputBatch (its arrays are reused, not reallocated) and re-adds every
    scheduled request, in the scheduler's order, from its cached state: prompt + output tokens
    and block ids are copied again every step. `_prepare_inputs` is inherited unchanged."""

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params, generator=None,
                block_ids=tuple(list(b) for b in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = tuple(list(b) for b in new_block_ids)
            elif new_block_ids is not None:
                for block_ids, new_ids in zip(state.block_ids, new_block_ids):
                    block_ids.extend(new_ids)

        batch = self.input_batch
        clear_batch(batch)
        for req_id in scheduler_output.num_scheduled_tokens:
            batch.add_request(self.requests[req_id])
        batch.refresh_metadata()


def clear_batch(batch: InputBatch) -> None:
    """Empty the batch's membership; rows are overwritten by the next add_request."""
    batch.req_ids.clear()
    batch.req_id_to_index.clear()
    batch._free_rows.clear()
    for s in (batch.greedy_reqs, batch.random_reqs, batch.top_p_reqs, batch.top_k_reqs):
        s.clear()
    batch.generators.clear()
    batch.sampling_metadata = None


class FakeScheduler:
    """Hands out SchedulerOutputs the way keel's Scheduler would for pure decode: new requests
    with their whole prompt first, then one token per step and a block when one fills up."""

    def __init__(self, prompt_len: int, vocab: int) -> None:
        self.prompt_len = prompt_len
        self.vocab = vocab
        self.computed: dict[str, int] = {}
        self.num_blocks: dict[str, int] = {}
        self.next_block = 0
        self.params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)

    def _alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def schedule(self, req_ids: list[str]) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        nst: dict[str, int] = {}
        for rid in req_ids:
            if rid not in self.computed:
                k = int(rid[1:])
                prompt = [(7 * k + 13 * j) % self.vocab for j in range(self.prompt_len)]
                n = -(-self.prompt_len // BLOCK_SIZE)
                new_reqs.append(NewRequestData(rid, prompt, self.params, (self._alloc(n),), 0))
                self.computed[rid], self.num_blocks[rid] = 0, n
                nst[rid] = self.prompt_len
                continue
            need = -(-(self.computed[rid] + 1) // BLOCK_SIZE) - self.num_blocks[rid]
            cached.req_ids.append(rid)
            cached.new_token_ids.append([])
            cached.new_block_ids.append((self._alloc(need),) if need > 0 else None)
            cached.num_computed_tokens.append(self.computed[rid])
            self.num_blocks[rid] += max(need, 0)
            nst[rid] = 1
        for rid, n in nst.items():
            self.computed[rid] += n
        return SchedulerOutput(new_reqs, cached, nst, sum(nst.values()))


def emulate_sampling(runner: ModelRunner, step: int, vocab: int) -> None:
    """What sample_tokens does with the sampled ids (untimed): append to the batch rows that are
    not discarded, and to each request's output_token_ids."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    rows = np.flatnonzero(~runner.discard_request_mask.np[:num_reqs])
    req_ids = batch.req_ids[:num_reqs]
    tokens = np.array([(int(req_ids[r][1:]) * 31 + step) % vocab for r in rows], dtype=np.int64)
    batch.append_sampled_tokens(rows, tokens)
    for row, tok in zip(rows.tolist(), tokens.tolist()):
        runner.requests[req_ids[row]].output_token_ids.append(tok)


def layout_digest(runner: ModelRunner, total: int) -> int:
    """Checksum of what the forward pass would read, to check both runners agree."""
    num_reqs = runner.input_batch.num_reqs
    parts = (runner.input_ids.np[:total], runner.positions.np[:total],
             runner.query_start_loc.np[: num_reqs + 1], runner.seq_lens.np[:num_reqs],
             runner.input_batch.block_table.slot_mapping.np[:total])
    return zlib.crc32(b"".join(np.ascontiguousarray(p).tobytes() for p in parts))


@torch.inference_mode()
def measure(make_runner, n: int, alternating: bool, args, vocab: int):
    """Per-step ns of _update_states + _prepare_inputs over args.steps steps after warm-up."""
    runner: ModelRunner = make_runner()
    sched = FakeScheduler(args.prompt_len, vocab)
    sets = [[f"r{i}" for i in range(n)]]
    if alternating:
        sets.append([f"r{i}" for i in range(n, 2 * n)])
    prefill_steps = len(sets)
    times, digests = [], []
    for step in range(prefill_steps + args.warmup + args.steps):
        so = sched.schedule(sets[step % len(sets)])
        t0 = time.perf_counter_ns()
        # What execute_model runs before the forward pass.
        runner._update_states(so)
        num_reqs = runner.input_batch.num_reqs
        nst_np = runner.num_scheduled_tokens_np[:num_reqs]
        nst_np[:] = [so.num_scheduled_tokens[r] for r in runner.input_batch.req_ids[:num_reqs]]
        runner._prepare_inputs(so, nst_np)
        t1 = time.perf_counter_ns()
        if step >= prefill_steps + args.warmup:
            times.append(t1 - t0)
        digests.append(layout_digest(runner, so.total_num_scheduled_tokens))
        emulate_sampling(runner, step, vocab)
    assert sched.next_block <= args.num_blocks, "raise num_blocks"
    return np.array(times) / 1e3, digests  # microseconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64,256", help="running decode requests, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=20, help="untimed decode steps first")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--json", metavar="PATH", help="append a JSON record of the result to PATH")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    max_len = args.prompt_len + args.warmup + args.steps + 2
    if max_len > MAX_MODEL_LEN:
        p.error(f"prompt-len + warmup + steps must stay under {MAX_MODEL_LEN - 2}")
    torch.set_num_threads(1)
    max_seqs = 2 * max(sizes)  # the alternating scenario holds two sets
    args.num_blocks = max_seqs * -(-max_len // BLOCK_SIZE)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests/
    from tests.hf_models import make_hf_model

    with tempfile.TemporaryDirectory(prefix="keel-step-") as tmp:
        folder = make_hf_model("llama", Path(tmp), max_position_embeddings=MAX_MODEL_LEN)
        config = EngineConfig(
            model_config=ModelConfig(model=str(folder), dtype="float32", device="cpu"),
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_seqs,
                max_num_batched_tokens=max(2048, max(sizes) * args.prompt_len),  # step 0
            ),
            threads=1,
        )
        template = ModelRunner(config, torch.device("cpu"))
        template.load_model()
        template.initialize_kv_cache(args.num_blocks)  # lazily mapped zeros: costs no memory
        vocab = config.model_config.vocab_size

    def factory(cls):
        def make() -> ModelRunner:
            runner = cls(config, torch.device("cpu"))
            runner.model, runner.kv_caches = template.model, template.kv_caches
            return runner
        return make

    print(f"hardware:  {cpu_model()}, {len(os.sched_getaffinity(0))} cores available, "
          f"1 torch thread")
    print(f"software:  torch {torch.__version__}, numpy {np.__version__}, "
          f"python {platform.python_version()}")
    print(f"model:     tests.hf_models 'llama' (random, vocab {vocab}); the forward pass is "
          "not run, only _update_states + _prepare_inputs")
    print(f"workload:  decode, {args.prompt_len}-token prompts, block_size {BLOCK_SIZE}, "
          f"max_model_len {MAX_MODEL_LEN}, max_num_seqs {max_seqs}; {args.warmup} warm-up + "
          f"{args.steps} timed steps per row")
    print("peer:      rebuild = empty the InputBatch and re-add every scheduled request each "
          "step, then the same _prepare_inputs")
    print()
    print(f"{'scenario':<12}{'reqs':>5}  {'persistent us/step':>22}  {'rebuild us/step':>22}"
          f"  {'rebuild/persistent':>18}  layout")
    print(f"{'':<12}{'':>5}  {'median':>10} {'p90':>11}  {'median':>10} {'p90':>11}")
    records = []
    for alternating in (False, True):
        for n in sizes:
            gc.collect()
            keel_us, keel_dig = measure(factory(ModelRunner), n, alternating, args, vocab)
            gc.collect()
            peer_us, peer_dig = measure(factory(RebuildRunner), n, alternating, args, vocab)
            km, kp = np.median(keel_us), np.percentile(keel_us, 90)
            pm, pp = np.median(peer_us), np.percentile(peer_us, 90)
            name = "alternating" if alternating else "steady"
            same = "same" if keel_dig == peer_dig else "DIFFERENT"
            print(f"{name:<12}{n:>5}  {km:>10.1f} {kp:>11.1f}  {pm:>10.1f} {pp:>11.1f}"
                  f"  {pm / km:>17.2f}x  {same}")
            records.append({"scenario": name, "reqs": n, "persistent_median_us": km,
                            "persistent_p90_us": kp, "rebuild_median_us": pm,
                            "rebuild_p90_us": pp, "ratio": pm / km,
                            "layouts_equal": keel_dig == peer_dig})
    print()
    for r in records:
        if r["reqs"] == TARGET_N:
            ok = "met" if r["persistent_median_us"] < TARGET_US else "NOT met"
            print(f"target: persistent batch under {TARGET_US / 1000:.0f} ms per step at "
                  f"{TARGET_N} decode requests ({r['scenario']}): "
                  f"{r['persistent_median_us']:.0f} us median -> {ok}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "benchmark": "step_overhead",
                "cpu": cpu_model(), "torch": torch.__version__, "steps": args.steps,
                "prompt_len": args.prompt_len, "results": records}) + "\n")


if __name__ == "__main__":
    main()
