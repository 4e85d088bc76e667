"""What every step did to the persistent batch, recorded for `keel trace view`.

Two halves, because the runner may live in another process (the `mp` and `ray` executors):

- `RunnerTrace` (in the runner): at fixed points of `execute_model` / `sample_tokens` it
  records the rows of `self.input_batch` after `_update_states` (which rows were removed,
  added, and moved by `condense()`), the flat layout `_prepare_inputs` built, the tokens kept,
  and the wall time of each phase. The record rides back on `ModelRunnerOutput.trace`.
- `TraceWriter` (in `EngineCore`): adds the `SchedulerOutput` summary and the schedule /
  update phases, and writes one JSON line per step.

Off by default; then the runner holds `trace = None` and each hook is one `is None` check.
Per-token arrays are capped (`caps.tokens` entries, the full length under `truncated`), block
lists per row too, and the file stops growing at `max_bytes` with a final `truncated` line.
Times are `time.monotonic_ns()`, one clock for all processes of one machine (a Ray worker on
another machine has its own: its phases keep their lengths, not their offsets).
The format is written out in docs/trace.md.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from keel.core.sched_output import SchedulerOutput
    from keel.outputs import ModelRunnerOutput
    from keel.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

TRACE_VERSION = 1
MAX_TOKENS = 2048  # per-token entries kept per step
MAX_BLOCKS_PER_ROW = 64
MAX_BYTES = 256 << 20


def _now_us() -> float:
    return time.monotonic_ns() / 1000.0


def _capped(arr: np.ndarray, cap: int, name: str, truncated: dict[str, int]) -> list:
    if len(arr) > cap:
        truncated[name] = len(arr)
        arr = arr[:cap]
    return arr.tolist()


class RunnerTrace:
    """The runner's half: call `begin` before the diff, then `after_diff`, `after_prepare`,
    `after_forward`, and `finish` (from `sample_tokens`, or for a pass with nothing to sample)."""

    def __init__(self, max_tokens: int = MAX_TOKENS,
                 max_blocks_per_row: int = MAX_BLOCKS_PER_ROW) -> None:
        self.max_tokens = max_tokens
        self.max_blocks_per_row = max_blocks_per_row
        self.record: dict[str, Any] | None = None
        self._t = 0.0
        self._rows_before: dict[str, int] = {}

    def _phase(self, name: str) -> None:
        now = _now_us()
        self.record["phases"].append({"name": name, "start_us": self._t, "dur_us": now - self._t})
        self._t = now

    def begin(self, runner: ModelRunner) -> None:
        self._t = _now_us()
        self._rows_before = dict(runner.input_batch.req_id_to_index)
        runner.input_batch.moves = []  # condense() appends (req_id, from, to) while tracing
        self.record = {"batch": None, "layout": None, "sampled_token_ids": None, "phases": []}

    def after_diff(self, runner: ModelRunner, scheduler_output: SchedulerOutput) -> None:
        self._phase("diff")
        batch = runner.input_batch
        moves, batch.moves = batch.moves or [], None
        finished = scheduler_output.finished_req_ids
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        # A resumed request the batch still held (the forced-preemption case) was removed by
        # the unscheduled loop and added back in the same diff.
        removed = [
            {"req_id": r, "row": row, "reason": "finished" if r in finished else "unscheduled"}
            for r, row in sorted(self._rows_before.items(), key=lambda kv: kv[1])
            if r not in batch.req_id_to_index or r in resumed
        ]
        added = [
            {"req_id": r, "row": row, "resumed": r in resumed}
            for r, row in batch.req_id_to_index.items()
            if r not in self._rows_before or r in resumed
        ]
        nst = scheduler_output.num_scheduled_tokens
        bt = batch.block_table
        rows = []
        for row, req_id in enumerate(batch.req_ids):
            n_blocks = int(bt.num_blocks_per_row[row])
            rows.append({
                "row": row, "req_id": req_id,
                "num_computed_tokens": int(batch.num_computed_tokens_cpu[row]),
                "num_tokens": int(batch.num_tokens[row]),
                "num_scheduled_tokens": int(nst.get(req_id, 0)),
                "block_ids": bt.block_table.np[row, :min(n_blocks, self.max_blocks_per_row)]
                .tolist(),
                "blocks_truncated": n_blocks > self.max_blocks_per_row,
            })
        self.record["batch"] = {
            "num_reqs": batch.num_reqs, "rows": rows, "removed": removed,
            "added": sorted(added, key=lambda a: a["row"]),
            "moves": [{"req_id": r, "from": src, "to": tgt} for r, src, tgt in moves],
        }

    def after_prepare(self, runner: ModelRunner, num_scheduled_tokens_np: np.ndarray,
                      logits_indices: Any) -> None:
        self._phase("prepare")
        num_reqs = runner.input_batch.num_reqs
        total = int(num_scheduled_tokens_np.sum())
        cap, truncated = self.max_tokens, {}
        # The same expression _prepare_inputs evaluates: [2, 5, 3] -> [0,0,1,1,1,1,1,2,2,2]
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled_tokens_np)
        slots = runner.input_batch.block_table.slot_mapping.cpu[:total].numpy()
        self.record["layout"] = {
            "num_tokens": total,
            "input_ids": _capped(runner.input_ids.np[:total], cap, "input_ids", truncated),
            "req_indices": _capped(req_indices, cap, "req_indices", truncated),
            "positions": _capped(runner.positions.np[:total], cap, "positions", truncated),
            "slot_mapping": _capped(slots, cap, "slot_mapping", truncated),
            "query_start_loc": runner.query_start_loc.np[: num_reqs + 1].tolist(),
            "seq_lens": runner.seq_lens.np[:num_reqs].tolist(),
            "logits_indices": _capped(np.asarray(logits_indices.cpu()), cap, "logits_indices",
                                      truncated),
            "discard_request_mask": runner.discard_request_mask.np[:num_reqs].tolist(),
            "truncated": truncated,
        }

    def after_forward(self) -> None:
        self._phase("forward")

    def finish(self, sampled_token_ids: list[list[int]] | None = None,
               sample_start: float | None = None) -> dict[str, Any] | None:
        """The record of this pass (None when nothing was begun). `sample_start`: when
        `sample_tokens` began (the engine ran the grammar bitmask in between)."""
        record = self.record
        if record is not None and sampled_token_ids is not None:
            self._t = sample_start if sample_start is not None else self._t
            self._phase("sample")
            record["sampled_token_ids"] = sampled_token_ids
        self.record = None
        return record


def summarize_scheduler_output(so: SchedulerOutput) -> dict[str, Any]:
    cached = so.scheduled_cached_reqs
    return {
        "new": [r.req_id for r in so.scheduled_new_reqs],
        "cached": [r for r in cached.req_ids if r not in cached.resumed_req_ids],
        "resumed": sorted(cached.resumed_req_ids),
        "finished": sorted(so.finished_req_ids),
        "preempted": sorted(so.preempted_req_ids),
        "num_scheduled_tokens": dict(so.num_scheduled_tokens),
        "total_num_scheduled_tokens": so.total_num_scheduled_tokens,
        "spec_decode_tokens": {r: len(t) for r, t in so.scheduled_spec_decode_tokens.items()},
    }


class TraceWriter:
    """The engine core's half: one JSON line per step into `path` (meta line first)."""

    def __init__(self, path: str | Path, meta: dict[str, Any],
                 max_bytes: int = MAX_BYTES) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", encoding="utf-8")
        self.max_bytes = max_bytes
        self._bytes = 0
        self._step = 0
        self._origin = _now_us()
        self._write({"type": "meta", "keel_trace": TRACE_VERSION,
                     "caps": {"tokens": MAX_TOKENS, "blocks_per_row": MAX_BLOCKS_PER_ROW},
                     **meta})

    @staticmethod
    def now() -> float:
        return _now_us()

    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        if self._bytes + len(line) > self.max_bytes:
            self._file.write(json.dumps({"type": "truncated", "after_step": self._step - 1,
                                         "max_bytes": self.max_bytes}) + "\n")
            self.close()
            return
        self._file.write(line)
        self._file.flush()  # a crash keeps every step written so far
        self._bytes += len(line)

    def write_step(self, scheduler_output: SchedulerOutput,
                   model_output: ModelRunnerOutput | None, schedule: tuple[float, float],
                   update: tuple[float, float]) -> None:
        """`schedule`, `update`: (start, end) of the engine's own two phases."""
        runner = getattr(model_output, "trace", None) or {}
        o = self._origin
        phases = [{"name": "schedule", "start_us": schedule[0] - o,
                   "dur_us": schedule[1] - schedule[0]}]
        phases += [{**p, "start_us": p["start_us"] - o} for p in runner.get("phases", ())]
        phases.append({"name": "update", "start_us": update[0] - o,
                       "dur_us": update[1] - update[0]})
        self._write({
            "type": "step", "step": self._step,
            "scheduler_output": summarize_scheduler_output(scheduler_output),
            "batch": runner.get("batch"), "layout": runner.get("layout"),
            "sampled_token_ids": runner.get("sampled_token_ids"),
            "phases": phases,
        })
        self._step += 1

    def instrument(self, scheduler: Any) -> None:
        """Record around `scheduler.schedule` and `scheduler.update_from_output` (this
        instance only): the step is written when its output has been processed. With async
        scheduling several outputs are in flight; each is matched by identity."""
        schedule, update = scheduler.schedule, scheduler.update_from_output
        pending: dict[int, tuple[float, float]] = {}

        def traced_schedule(*args: Any, **kwargs: Any) -> SchedulerOutput:
            start = _now_us()
            output = schedule(*args, **kwargs)
            if len(pending) > 64:  # outputs never launched (nothing scheduled) are dropped
                pending.clear()
            pending[id(output)] = (start, _now_us())
            return output

        def traced_update(scheduler_output: SchedulerOutput,
                          model_output: ModelRunnerOutput) -> Any:
            start = _now_us()
            result = update(scheduler_output, model_output)
            sched = pending.pop(id(scheduler_output), (start, start))
            self.write_step(scheduler_output, model_output, sched, (start, _now_us()))
            return result

        scheduler.schedule, scheduler.update_from_output = traced_schedule, traced_update

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def trace_meta(config: Any) -> dict[str, Any]:
    """The meta line: what was run, and the sizes the viewer draws against."""
    mc, sc = config.model_config, config.scheduler_config
    return {"model": str(mc.model_path), "dtype": str(mc.torch_dtype).removeprefix("torch."),
            "block_size": config.cache_config.block_size, "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "async_scheduling": sc.async_scheduling}


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a trace into {"source", "meta", "steps", "truncated"} ("truncated": the writer's
    last line when the file reached max_bytes, else None). A clear error, naming the file and
    line, for a missing file, a line that is not a JSON record, or no step line at all."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Trace file {str(path)!r} not found: record one with "
                                "`keel generate --trace FILE` or LLM(..., trace_path=FILE).")
    meta: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = []
    cut: dict[str, Any] | None = None
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno} is not JSON ({e.msg}): is this a keel "
                                 "trace (JSON Lines)?") from None
            kind = obj.get("type") if isinstance(obj, dict) else None
            if kind is None:
                raise ValueError(f"{path}:{lineno} is not a keel trace record (a JSON object "
                                 'with a "type")')
            if kind == "step":
                steps.append(obj)
            elif kind == "meta" and meta is None:
                meta = obj
            elif kind == "truncated":
                cut = obj
    if not steps:
        raise ValueError(f"{path} has no step lines: record a run with tracing on "
                         "(`keel generate --trace FILE`).")
    if meta is not None and meta.get("keel_trace") != TRACE_VERSION:
        logger.warning("%s: keel_trace version %r; this keel reads version %d", path,
                       meta.get("keel_trace"), TRACE_VERSION)
    return {"source": path.name, "meta": meta, "steps": steps, "truncated": cut}


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(meta, steps) of a trace file (see load_trace)."""
    trace = load_trace(path)
    return trace["meta"] or {}, trace["steps"]
