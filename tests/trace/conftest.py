"""A scripted run through the real ModelRunner, recorded: the seed's [2, 5, 3] pass, a
chunked prefill, a finished request, a preemption (the request leaves the batch, `condense()`
moves a row down), and the preempted request resumed with new blocks.

`scripted_trace` drives the runner with hand-built SchedulerOutputs (tests/worker's helpers),
writes every pass through the engine's TraceWriter, and keeps, for each pass, what the runner
really held between execute_model and sample_tokens, so tests can compare field by field.
"""

from __future__ import annotations

import numpy as np
import pytest

from keel.trace.recorder import RunnerTrace, TraceWriter
from tests.worker.test_model_runner import (  # noqa: F401 - fixtures are used by name
    BLOCK,
    cached,
    config,
    make_runner,
    model,
    new_req,
    prompt,
    sched,
    seed_example,
)

P4 = prompt(9, 4)


def scripted_outputs():
    """The passes, as the scheduler would have sent them (block ids by hand)."""
    yield seed_example()  # R1 [100..101], R2 [0..4], R3 [40..42]
    yield sched(cached_reqs=cached(("R1", 102, None), ("R2", 5, [33]), ("R3", 43, None)),
                nst={"R1": 1, "R2": 5, "R3": 1})
    # R1 finished; R2 preempted (not scheduled: leaves the batch, keeps self.requests);
    # R4 arrives and takes row 0; condense() moves R3 from row 2 down to row 1.
    so = sched([new_req("R4", P4, [40, 41, 42])], cached_reqs=cached(("R3", 44, [60])),
               nst={"R4": 9, "R3": 1}, finished={"R1"})
    so.preempted_req_ids = {"R2"}
    yield so
    # R2 resumed with a whole new allocation; recomputes its first 6 prompt tokens.
    yield sched(cached_reqs=cached(("R3", 45, None), ("R4", 9, None), ("R2", 0, [50, 51]),
                                   resumed={"R2"}), nst={"R3": 1, "R4": 1, "R2": 6})


def runner_snapshot(runner) -> dict:
    """What the runner holds after execute_model: the batch and this pass's layout."""
    batch, bt = runner.input_batch, runner.input_batch.block_table
    n = batch.num_reqs
    total = int(runner.num_scheduled_tokens_np[:n].sum())
    return {
        "req_ids": list(batch.req_ids),
        "num_computed_tokens": batch.num_computed_tokens_cpu[:n].tolist(),
        "num_tokens": batch.num_tokens[:n].tolist(),
        "block_ids": [bt.block_table.np[r, : bt.num_blocks_per_row[r]].tolist()
                      for r in range(n)],
        "positions": runner.positions.np[:total].tolist(),
        "input_ids": runner.input_ids.np[:total].tolist(),
        "slot_mapping": bt.slot_mapping.np[:total].tolist(),
        "query_start_loc": runner.query_start_loc.np[: n + 1].tolist(),
        "seq_lens": runner.seq_lens.np[:n].tolist(),
        "discard_request_mask": runner.discard_request_mask.np[:n].tolist(),
        "logits_indices": (np.asarray(runner.query_start_loc.np[1 : n + 1]) - 1).tolist(),
    }


def record_scripted_run(make_runner, path, max_tokens: int = 2048):  # noqa: F811
    runner = make_runner()
    runner.trace = RunnerTrace(max_tokens=max_tokens)
    writer = TraceWriter(path, {"model": "tiny llama (scripted)", "block_size": BLOCK,
                                "max_num_seqs": 8, "max_num_batched_tokens": 64})
    snapshots, outputs = [], []
    for so in scripted_outputs():
        t0 = writer.now()
        assert runner.execute_model(so) is None
        snapshots.append(runner_snapshot(runner))
        out = runner.sample_tokens(None)
        outputs.append(out)
        writer.write_step(so, out, (t0, t0), (writer.now(), writer.now()))
    writer.close()
    return runner, snapshots, outputs


@pytest.fixture
def scripted_trace(make_runner, tmp_path):  # noqa: F811
    path = tmp_path / "scripted.jsonl"
    _, snapshots, outputs = record_scripted_run(make_runner, path)
    return path, snapshots, outputs


@pytest.fixture
def recorded_trace(scripted_trace):
    """The browser test's input: a trace recorded from the real runner."""
    return scripted_trace[0]
