"""Prometheus metrics of a serving engine, named as vLLM names them with keel's prefix
(`keel:num_requests_running`, `keel:time_to_first_token_seconds`, ...), so that a vLLM
dashboard only needs the prefix changed. Fed by AsyncLLM from the front end: request arrivals,
each step's outputs (with the scheduler's state), aborts."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from keel.outputs import EngineCoreOutputs

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


@dataclass(slots=True)
class _RequestTimes:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("keel:num_requests_running",
                                          "Requests in the model's batch.")
        self.num_requests_waiting = gauge("keel:num_requests_waiting",
                                          "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("keel:kv_cache_usage_perc",
                                    "KV-cache usage: 1 means every block is in use.")
        self.num_preemptions = counter("keel:num_preemptions", "Preemptions, cumulative.")
        self.prefix_cache_queries = counter("keel:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("keel:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("keel:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("keel:generation_tokens", "Generated tokens.")
        self.request_success = Counter(
            "keel:request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.spec_num_drafts = counter("keel:spec_decode_num_drafts",
                                       "Verification passes of requests with drafts.")
        self.spec_num_draft_tokens = counter("keel:spec_decode_num_draft_tokens",
                                             "Draft tokens proposed.")
        self.spec_num_accepted_tokens = counter("keel:spec_decode_num_accepted_tokens",
                                                "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter(
            "keel:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.", ["model_name", "position"],
            registry=self.registry)
        self.ttft = histogram("keel:time_to_first_token_seconds",
                              "Time to first token, seconds.", _LATENCY_BUCKETS)
        self.itl = histogram("keel:inter_token_latency_seconds",
                             "Time between a request's successive outputs, seconds.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("keel:e2e_request_latency_seconds",
                             "Request latency from arrival to finish, seconds.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("keel:request_prompt_tokens",
                                               "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "keel:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS)
        self.model_name = model_name
        self._requests: dict[str, _RequestTimes] = {}
        # Engine totals already counted (the engine sends totals; counters take deltas).
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "drafts": 0,
                      "draft_tokens": 0, "accepted": 0}
        self._seen_per_pos: list[int] = []

    def record_request_added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        self._requests[request_id] = _RequestTimes(now, num_prompt_tokens)

    def record_outputs(self, outputs: EngineCoreOutputs, stopped_here: list[str],
                       now: float) -> None:
        """One step's outputs; `stopped_here`: requests a stop string finished in the front
        end (their finish reason is "stop")."""
        for out in outputs.outputs:
            times = self._requests.get(out.request_id)
            if times is None:
                continue
            n = len(out.new_token_ids)
            if out.pooling_output is not None:  # an embedding: its prompt is all it computed
                self.prompt_tokens.inc(times.num_prompt_tokens)
            if n:
                if times.first_token is None:
                    times.first_token = now
                    self.ttft.observe(now - times.arrival)
                    self.prompt_tokens.inc(times.num_prompt_tokens)
                else:
                    self.itl.observe(now - times.last_token)
                times.last_token = now
                times.num_generated += n
                self.generation_tokens.inc(n)
            reason = out.finish_reason
            if reason is None and out.request_id in stopped_here:
                reason = "stop"
            if reason is not None:
                self._finish(out.request_id, reason, now)
        stats = outputs.scheduler_stats
        if stats is not None:
            self.num_requests_running.set(stats.num_running_reqs)
            self.num_requests_waiting.set(stats.num_waiting_reqs)
            self.kv_cache_usage.set(stats.kv_cache_usage)
            for key, counter, total in (
                    ("preemptions", self.num_preemptions, stats.num_preemptions_total),
                    ("queries", self.prefix_cache_queries, stats.prefix_cache_queries),
                    ("hits", self.prefix_cache_hits, stats.prefix_cache_hits),
                    ("drafts", self.spec_num_drafts, stats.spec_num_drafts),
                    ("draft_tokens", self.spec_num_draft_tokens, stats.spec_num_draft_tokens),
                    ("accepted", self.spec_num_accepted_tokens,
                     stats.spec_num_accepted_tokens)):
                if total > self._seen[key]:  # the engine sends totals; counters take deltas
                    counter.inc(total - self._seen[key])
                    self._seen[key] = total
            for pos, total in enumerate(stats.spec_accepted_per_pos):
                if pos >= len(self._seen_per_pos):
                    self._seen_per_pos.append(0)
                if total > self._seen_per_pos[pos]:
                    self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(
                        total - self._seen_per_pos[pos])
                    self._seen_per_pos[pos] = total

    def record_aborted(self, request_ids: list[str], now: float | None = None) -> None:
        import time

        now = time.monotonic() if now is None else now
        for request_id in request_ids:
            if request_id in self._requests:
                self._finish(request_id, "abort", now)

    def _finish(self, request_id: str, reason: str, now: float) -> None:
        times = self._requests.pop(request_id)
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.observe(now - times.arrival)
        self.request_prompt_tokens.observe(times.num_prompt_tokens)
        self.request_generation_tokens.observe(times.num_generated)
