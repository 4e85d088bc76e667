"""A keel trace as Chrome trace events, so its steps open in Perfetto (ui.perfetto.dev) or
chrome://tracing: one complete event ("ph": "X") per phase, on two tracks, the engine core's
(schedule, update) and the runner's (diff, prepare, forward, sample), and one per step around
them. Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from keel.trace.recorder import read_trace

_ENGINE_TID, _RUNNER_TID, _STEP_TID = 1, 2, 0
_ENGINE_PHASES = {"schedule", "update"}


def chrome_trace_events(steps: list[dict[str, Any]]) -> dict[str, Any]:
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "keel"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": _STEP_TID,
         "args": {"name": "EngineCore.step"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": _ENGINE_TID,
         "args": {"name": "scheduler"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": _RUNNER_TID,
         "args": {"name": "model runner"}},
    ]
    for step in steps:
        phases = step.get("phases") or []
        if not phases:
            continue
        so = step.get("scheduler_output") or {}
        args = {"step": step["step"], "num_reqs": len(so.get("num_scheduled_tokens", {})),
                "num_tokens": so.get("total_num_scheduled_tokens", 0)}
        start = min(p["start_us"] for p in phases)
        end = max(p["start_us"] + p["dur_us"] for p in phases)
        events.append({"name": f"step {step['step']}", "ph": "X", "pid": 0, "tid": _STEP_TID,
                       "ts": start, "dur": end - start, "args": args})
        for p in phases:
            tid = _ENGINE_TID if p["name"] in _ENGINE_PHASES else _RUNNER_TID
            events.append({"name": p["name"], "ph": "X", "pid": 0, "tid": tid,
                           "ts": p["start_us"], "dur": p["dur_us"], "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(trace_path: str | Path, out_path: str | Path | None = None) -> Path:
    """Convert a keel trace (JSON Lines) into a Chrome trace-event JSON file; returns its path
    (default: next to the trace, `.chrome.json`)."""
    trace_path = Path(trace_path)
    out = Path(out_path) if out_path is not None else trace_path.with_suffix(".chrome.json")
    _, steps = read_trace(trace_path)
    out.write_text(json.dumps(chrome_trace_events(steps)))
    return out
