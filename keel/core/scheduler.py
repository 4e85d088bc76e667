"""Scheduler: continuous batching as vLLM v1 does it.

No prefill or decode phases: every step has one token budget (`max_num_batched_tokens`).
Running requests are served first (a decode needs one token, a chunked prefill the rest of its
prompt, up to the budget), then waiting ones, while the budget, `max_num_seqs` and the KV cache
allow. A long prompt is spread over several steps (chunked prefill) and shares them with
decodes. When blocks run out, the lowest-priority running request is preempted by recompute:
its blocks are freed, its computed tokens reset to 0, and it goes back to the front of the queue.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from keel.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from keel.core.kv_cache_manager import KVCacheManager
from keel.core.kv_cache_utils import update_block_hashes
from keel.core.sched_output import CachedRequestData, GrammarOutput, NewRequestData, SchedulerOutput
from keel.core.sched_utils import (
    advance_grammar,
    can_schedule_ahead,
    check_stop,
    finish_pooled,
    settle_in_flight,
)
from keel.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerStats
from keel.request import Request, RequestStatus
from keel.spec_decode.stats import SpecDecodingStats, can_speculate

if TYPE_CHECKING:
    from keel.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
        structured_output_manager: StructuredOutputManager | None = None,
        pipeline_parallel: bool = False,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.async_scheduling = scheduler_config.async_scheduling
        self.chunked_prefill = scheduler_config.enable_chunked_prefill
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               self.enable_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(): sent to the runner in the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()  # since the last SchedulerOutput
        self.num_preemptions = 0  # total, for metrics and tests
        self.structured_output_manager = structured_output_manager
        # With pipeline stages, only the last one samples: the others learn each pass's
        # tokens through scheduled_cached_reqs.new_token_ids.
        self.pipeline_parallel = pipeline_parallel
        num_spec = speculative_config.num_speculative_tokens if speculative_config else 0
        self.spec_stats = SpecDecodingStats(num_spec)
        # Async scheduling with drafts: a request's next drafts are proposed by the runner
        # after its step in flight, so the scheduler plans with placeholders (-1) for them;
        # the runner puts in its own drafts (and may use fewer). Made once, never mutated.
        self._spec_placeholders = [-1] * num_spec if self.async_scheduling else []
        self.structured_req_ids: set[str] = set()  # unfinished requests with a grammar
        # Outputs for requests finished outside a step (a grammar that failed to compile),
        # sent with the next update_from_output.
        self._pending_outputs: list[EngineCoreOutput] = []

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if self.enable_caching:
            update_block_hashes(request, self.block_size)
        self.waiting.append(request)
        self.requests[request.request_id] = request
        if request.use_structured_output:
            self.structured_req_ids.add(request.request_id)

    def finish_requests(self, request_ids, finished_status: RequestStatus) -> None:
        """Finish requests from outside the loop (aborts). Unknown or finished ids are ignored."""
        assert RequestStatus.is_finished(finished_status)
        for req_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self.structured_req_ids.discard(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_requests(self) -> bool:
        # Finished ids still to be sent count: the runner must see them to clean its batch.
        return self.has_unfinished_requests() or bool(self.finished_req_ids)

    def make_stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.block_pool
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=pool.get_usage(),
            num_preemptions_total=self.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            **self.spec_stats.scheduler_stats_fields(),
        )

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        kv = self.kv_cache_manager
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        preempted = False

        # 1. Running requests first, in arrival order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if self.async_scheduling and not can_schedule_ahead(request, self.max_model_len):
                req_index += 1
                continue
            pending = request.num_output_placeholders
            num_new_tokens = request.num_tokens + pending - request.num_computed_tokens
            spec = request.spec_token_ids
            if spec:
                # Never past max_model_len (the token rows end there) or max_tokens, counting
                # the tokens still in flight as if every draft was accepted.
                room = min(self.max_model_len - request.num_tokens - pending,
                           request.max_tokens - len(request.output_token_ids) - pending - 1)
                spec = spec[: max(room, 0)]
                num_new_tokens += len(spec)
            num_new_tokens = min(num_new_tokens, token_budget)
            while True:
                blocks = kv.allocate_slots(request, num_new_tokens)
                if blocks is not None:
                    break
                # Out of blocks: preempt the lowest-priority (latest) running request. Victims
                # come from the unvisited tail, so nothing scheduled this step is undone.
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if blocks is None:
                break
            scheduled_running.append(request)
            num_drafts = num_new_tokens - (request.num_tokens + pending
                                           - request.num_computed_tokens)
            if num_drafts > 0:
                scheduled_spec_decode_tokens[request.request_id] = spec[:num_drafts]
            request.spec_token_ids = []
            new_blocks[request.request_id] = blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # 2. Waiting requests (new, or resumed after preemption), unless we just preempted.
        # One whose grammar is still compiling is skipped (and keeps its place in the queue).
        skipped: list[Request] = []
        while self.waiting and token_budget > 0 and not preempted and not throttle_prefills:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(
                    request):
                self.waiting.popleft()
                if request.status == RequestStatus.WAITING_FOR_FSM:
                    skipped.append(request)
                continue
            # New or resumed (num_computed_tokens == 0): start after its longest cached prefix.
            computed_blocks, num_cached = kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens + request.num_output_placeholders - num_cached
            if num_new_tokens > token_budget and not self.chunked_prefill:
                break  # whole prompts only (an encoder): it waits for a step with room
            num_new_tokens = min(num_new_tokens, token_budget)
            blocks = kv.allocate_slots(request, num_new_tokens, computed_blocks, num_cached)
            if blocks is None:
                break
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            kv.record_prefix_cache_lookup(request.num_tokens, num_cached)
            self.waiting.popleft()
            self.running.append(request)
            if request.status == RequestStatus.PREEMPTED:
                scheduled_resumed.append(request)
            else:
                scheduled_new.append(request)
            request.status = RequestStatus.RUNNING
            new_blocks[request.request_id] = blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        self.waiting.extendleft(reversed(skipped))

        cached = CachedRequestData()
        for request, resumed in (*((r, False) for r in scheduled_running),
                                 *((r, True) for r in scheduled_resumed)):
            rid = request.request_id
            cached.req_ids.append(rid)
            if resumed:
                cached.resumed_req_ids.add(rid)
                cached.new_block_ids.append((list(kv.get_block_ids(rid)),))
            else:
                cached.new_block_ids.append((new_blocks[rid],) if new_blocks[rid] else None)
            if self.pipeline_parallel:
                start = request.num_computed_tokens
                cached.new_token_ids.append(
                    request.token_slice(start, start + num_scheduled_tokens[rid]))
            else:
                cached.new_token_ids.append([])  # the runner sampled them itself
            cached.num_computed_tokens.append(request.num_computed_tokens)

        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    prompt_token_ids=r.prompt_token_ids,
                    sampling_params=r.sampling_params,
                    block_ids=(list(kv.get_block_ids(r.request_id)),),
                    num_computed_tokens=r.num_computed_tokens,
                    pooling_params=r.pooling_params,
                )
                for r in scheduled_new
            ],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
        )
        self.finished_req_ids, self.preempted_req_ids = set(), set()
        # The runner got the pre-step counts above; from here on they include this step (and,
        # optimistically, every draft: update_from_output takes back the rejected ones).
        for request in (*scheduled_running, *scheduled_new, *scheduled_resumed):
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]
            if self.async_scheduling and request.num_computed_tokens >= (
                    request.num_tokens + request.num_output_placeholders):
                # This step samples 1 + drafts tokens for it, if every draft is accepted.
                num_drafts = len(scheduled_spec_decode_tokens.get(request.request_id, ()))
                request.num_output_placeholders += 1 + num_drafts
                if self._spec_placeholders and can_speculate(request.sampling_params):
                    request.spec_token_ids = self._spec_placeholders
        return output

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block. Blocks in use cannot be forgotten: with
        `reset_running_requests` every running request is preempted first (its blocks freed;
        it comes back as resumed in a later step, recomputing its tokens), otherwise the reset
        fails (False) while any request runs."""
        if reset_running_requests:
            while self.running:
                self._preempt(self.running.pop())  # latest first: the queue keeps their order
        ok = self.kv_cache_manager.reset_prefix_cache()
        if not ok:
            logger.warning("Prefix cache not reset: %d request(s) still hold KV blocks.",
                           len(self.running))
        return ok

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted_req_ids.add(request.request_id)
        self.waiting.appendleft(request)

    def _grammar_ready(self, request: Request) -> bool:
        """True once the request's grammar compiled (it becomes WAITING); a grammar that
        failed finishes the request with an error, reported with the next step's outputs."""
        try:
            ready = request.structured_output_request.ready()
        except Exception as e:  # noqa: BLE001 - the compiler's error, for this request alone
            logger.error("Request %s: its grammar failed to compile: %s", request.request_id, e)
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request)
            self._pending_outputs.append(EngineCoreOutput(
                request.request_id, [], finish_reason=request.get_finished_reason()))
            return False
        if ready:
            request.status = RequestStatus.WAITING
        return ready

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask of every constrained request that samples a kept token this step, or
        None when there is none. Runs while the forward pass does (EngineCore.step). A request
        still prefilling after this step is left out: its row is discarded anyway."""
        if not self.structured_req_ids:
            return None
        ids = [req_id for req_id in scheduler_output.num_scheduled_tokens.keys()
               & self.structured_req_ids
               if self.requests[req_id].num_computed_tokens >= self.requests[req_id].num_tokens]
        if not ids:
            return None
        ids.sort()  # a deterministic order; the runner maps ids to rows itself
        bitmask = self.structured_output_manager.grammar_bitmask(
            [self.requests[req_id] for req_id in ids])
        return GrammarOutput(ids, bitmask)

    # ---- after the step ---------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        sampled = model_runner_output.sampled_token_ids
        index_of = model_runner_output.req_id_to_index
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        pooler_output = model_runner_output.pooler_output
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            row = index_of.get(req_id)
            if request is None or row is None:
                continue  # aborted during the step
            if pooler_output is not None:  # a pooling model: done once its prompt is
                if pooler_output[row] is not None:
                    outputs.append(finish_pooled(request, pooler_output[row]))
                    stopped.append(request)
                continue
            new_token_ids = sampled[row]
            new_prompt_logprobs = prompt_logprobs.get(req_id)
            if not new_token_ids and new_prompt_logprobs is None:
                continue  # still prefilling (row discarded), nothing to report
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts or (self.async_scheduling and new_token_ids):
                settle_in_flight(request, drafts, len(new_token_ids), self.async_scheduling,
                                 model_runner_output.num_draft_tokens, row, self.spec_stats)
            grammar = request.structured_output_request
            for i, token in enumerate(new_token_ids):
                request.output_token_ids.append(token)
                finished = ((grammar is not None and not advance_grammar(request, token))
                            or check_stop(request, self.max_model_len))
                if finished:
                    new_token_ids = new_token_ids[: i + 1]
                    stopped.append(request)
                    break
            if self.enable_caching and new_token_ids:
                update_block_hashes(request, self.block_size)  # blocks that just filled up
            spec_token_ids = model_runner_output.spec_token_ids
            if spec_token_ids and not self._spec_placeholders and not request.is_finished() \
                    and can_speculate(request.sampling_params):
                request.spec_token_ids = spec_token_ids[row]
            new_logprobs = None
            if new_token_ids and logprobs is not None \
                    and request.sampling_params.logprobs is not None:
                new_logprobs = logprobs.slice(row, row + 1)
            outputs.append(EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_token_ids,
                finish_reason=request.get_finished_reason(),
                stop_reason=request.stop_reason,
                num_preemptions=request.num_preemptions,
                num_cached_tokens=request.num_cached_tokens,
                new_logprobs=new_logprobs,
                new_prompt_logprobs=new_prompt_logprobs,
            ))
        if stopped:
            stopped_ids = {r.request_id for r in stopped}
            num_running = len(self.running)
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
            if num_running - len(self.running) < len(stopped):
                # Async scheduling: some were preempted while their last step was in flight.
                self.waiting = deque(r for r in self.waiting if r.request_id not in stopped_ids)
            for request in stopped:
                self._free_request(request)
        finished_ids = {r.request_id for r in stopped}
        if self._pending_outputs:
            outputs += self._pending_outputs
            finished_ids.update(o.request_id for o in self._pending_outputs)
            self._pending_outputs = []
        return {0: EngineCoreOutputs(outputs, finished_ids)}
