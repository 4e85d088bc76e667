"""PrometheusStatLogger turns the engine's cumulative totals into counters, once each."""

from __future__ import annotations

from prometheus_client import generate_latest

from keel.metrics import PrometheusStatLogger
from keel.outputs import EngineCoreOutputs, SchedulerStats


def samples(logger: PrometheusStatLogger) -> dict[str, float]:
    out = {}
    for line in generate_latest(logger.registry).decode().splitlines():
        if line.startswith("keel:") and "_total" in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_totals_become_counters_and_are_not_counted_twice():
    m = PrometheusStatLogger("x")
    first = SchedulerStats(num_preemptions_total=2, prefix_cache_queries=100,
                           prefix_cache_hits=40, spec_num_drafts=3, spec_num_draft_tokens=9,
                           spec_num_accepted_tokens=4, spec_accepted_per_pos=[3, 1, 0])
    second = SchedulerStats(num_preemptions_total=2, prefix_cache_queries=150,
                            prefix_cache_hits=40, spec_num_drafts=4, spec_num_draft_tokens=12,
                            spec_num_accepted_tokens=6, spec_accepted_per_pos=[4, 2, 0])
    for stats in (first, second, second):
        m.record_outputs(EngineCoreOutputs(scheduler_stats=stats), [], 0.0)
    got = samples(m)
    assert got['keel:num_preemptions_total{model_name="x"}'] == 2
    assert got['keel:prefix_cache_queries_total{model_name="x"}'] == 150
    assert got['keel:prefix_cache_hits_total{model_name="x"}'] == 40
    assert got['keel:spec_decode_num_drafts_total{model_name="x"}'] == 4
    assert got['keel:spec_decode_num_draft_tokens_total{model_name="x"}'] == 12
    assert got['keel:spec_decode_num_accepted_tokens_total{model_name="x"}'] == 6
    per_pos = 'keel:spec_decode_num_accepted_tokens_per_pos_total{model_name="x",position="%d"}'
    assert got[per_pos % 0] == 4 and got[per_pos % 1] == 2 and per_pos % 2 not in got
