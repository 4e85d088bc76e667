"""The recorder against what the runner really held, pass by pass (tests/trace/conftest.py
scripts the run), and the writer's format, caps and size guard."""

from __future__ import annotations

import itertools
import json

import pytest

from keel.trace.chrome import chrome_trace_events, write_chrome_trace
from keel.trace.recorder import TraceWriter, read_trace
from tests.trace.conftest import record_scripted_run, scripted_outputs

RUNNER_PHASES = ["diff", "prepare", "forward", "sample"]


def test_every_field_matches_the_runner(scripted_trace):
    path, snapshots, outputs = scripted_trace
    meta, steps = read_trace(path)
    assert meta["keel_trace"] == 1 and meta["block_size"] == 4
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    for step, snap, out, so in zip(steps, snapshots, outputs, scripted_outputs()):
        batch, layout = step["batch"], step["layout"]
        rows = batch["rows"]
        assert [r["req_id"] for r in rows] == snap["req_ids"]
        assert [r["row"] for r in rows] == list(range(len(rows))) and batch["num_reqs"] == len(rows)
        assert [r["num_computed_tokens"] for r in rows] == snap["num_computed_tokens"]
        assert [r["num_tokens"] for r in rows] == snap["num_tokens"]
        assert [r["block_ids"] for r in rows] == snap["block_ids"]
        assert [r["num_scheduled_tokens"] for r in rows] == [
            so.num_scheduled_tokens[r] for r in snap["req_ids"]]
        for key in ("positions", "input_ids", "slot_mapping", "query_start_loc", "seq_lens",
                    "discard_request_mask", "logits_indices"):
            assert layout[key] == snap[key], key
        assert layout["num_tokens"] == so.total_num_scheduled_tokens
        assert layout["truncated"] == {}
        assert step["sampled_token_ids"] == out.sampled_token_ids
        so_rec = step["scheduler_output"]
        assert so_rec["num_scheduled_tokens"] == so.num_scheduled_tokens
        assert so_rec["new"] == [r.req_id for r in so.scheduled_new_reqs]
        names = [p["name"] for p in step["phases"]]
        assert names == ["schedule", *RUNNER_PHASES, "update"]
        assert all(p["dur_us"] >= 0 for p in step["phases"])
        runner_phases = step["phases"][1:5]
        for a, b in itertools.pairwise(runner_phases):
            assert b["start_us"] >= a["start_us"] + a["dur_us"] - 1e-3  # in order, no overlap


def test_the_seed_example_pass(scripted_trace):
    _, steps = read_trace(scripted_trace[0])
    layout, batch = steps[0]["layout"], steps[0]["batch"]
    assert layout["req_indices"] == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    assert layout["positions"] == [100, 101, 0, 1, 2, 3, 4, 40, 41, 42]
    assert layout["query_start_loc"] == [0, 2, 7, 10]
    assert layout["logits_indices"] == [1, 6, 9]
    assert layout["discard_request_mask"] == [False, True, True]
    assert layout["seq_lens"] == [102, 5, 43]
    assert [a["req_id"] for a in batch["added"]] == ["R1", "R2", "R3"]
    assert batch["removed"] == [] and batch["moves"] == []
    # R2 and R3 are mid-prefill: sampled, then discarded.
    assert [len(t) for t in steps[0]["sampled_token_ids"]] == [1, 0, 0]


def test_finish_preempt_condense_and_resume(scripted_trace):
    _, steps = read_trace(scripted_trace[0])
    step2, step3 = steps[2], steps[3]
    assert step2["scheduler_output"]["finished"] == ["R1"]
    assert step2["scheduler_output"]["preempted"] == ["R2"]
    assert step2["batch"]["removed"] == [
        {"req_id": "R1", "row": 0, "reason": "finished"},
        {"req_id": "R2", "row": 1, "reason": "unscheduled"},
    ]
    # R4 fills the lowest hole (row 0); condense() moves R3 from row 2 into the other hole.
    assert step2["batch"]["added"] == [{"req_id": "R4", "row": 0, "resumed": False}]
    assert step2["batch"]["moves"] == [{"req_id": "R3", "from": 2, "to": 1}]
    assert [r["req_id"] for r in step2["batch"]["rows"]] == ["R4", "R3"]
    # R4's whole prompt beside R3's next prompt chunk (one token: R3 is at 44 of 60).
    assert step2["layout"]["positions"] == list(range(9)) + [44]
    assert step3["scheduler_output"]["resumed"] == ["R2"]
    assert step3["batch"]["added"] == [{"req_id": "R2", "row": 2, "resumed": True}]
    assert step3["batch"]["rows"][2]["block_ids"] == [50, 51]  # replaced, not extended
    assert step3["batch"]["rows"][2]["num_computed_tokens"] == 0
    # R4 decodes; R3 (46 of 60) and R2 (6 of 600) are still prefilling.
    assert step3["layout"]["discard_request_mask"] == [False, True, True]


def test_per_token_arrays_are_capped_and_say_so(make_runner, tmp_path):
    path = tmp_path / "capped.jsonl"
    record_scripted_run(make_runner, path, max_tokens=4)
    _, steps = read_trace(path)
    layout = steps[0]["layout"]
    assert layout["positions"] == [100, 101, 0, 1]
    assert layout["truncated"] == {"input_ids": 10, "req_indices": 10, "positions": 10,
                                   "slot_mapping": 10}
    assert layout["query_start_loc"] == [0, 2, 7, 10]  # per-request arrays are whole


def test_the_file_stops_growing_at_max_bytes(tmp_path, scripted_trace):
    _, steps = read_trace(scripted_trace[0])
    path = tmp_path / "small.jsonl"
    writer = TraceWriter(path, {"model": "x"}, max_bytes=3000)
    for step in steps * 5:
        writer._write(step)
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert path.stat().st_size < 3000 + 200
    assert lines[-1]["type"] == "truncated" and lines[-1]["max_bytes"] == 3000
    assert len(lines) < 2 + len(steps) * 5


def test_read_trace_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "meta"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not JSON"):
        read_trace(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"type": "meta"}\n')
    with pytest.raises(ValueError, match="no step lines"):
        read_trace(empty)
    with pytest.raises(FileNotFoundError, match="--trace"):
        read_trace(tmp_path / "missing.jsonl")


def test_chrome_trace_events(scripted_trace, tmp_path):
    path = scripted_trace[0]
    out = write_chrome_trace(path, tmp_path / "t.json")
    events = json.loads(out.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    _, steps = read_trace(path)
    assert len(complete) == len(steps) * (1 + 2 + len(RUNNER_PHASES))
    step0 = [e for e in complete if e["args"]["step"] == 0]
    whole = next(e for e in step0 if e["name"] == "step 0")
    for e in step0:
        assert whole["ts"] <= e["ts"] and e["ts"] + e["dur"] <= whole["ts"] + whole["dur"] + 1e-6
    assert {e["tid"] for e in step0 if e["name"] in RUNNER_PHASES} == {2}
    assert chrome_trace_events([])["traceEvents"][0]["ph"] == "M"
