"""OutputProcessor: between the engine core and the user. Turns EngineCoreOutputs (token ids,
logprob arrays) into RequestOutputs (text, logprob dicts), finds stop strings, and gathers the
children of n > 1 requests.

It knows nothing of how it is driven (offline LLM loop or a server's output thread), so both
use it unchanged. Work per token is O(new tokens): incremental detokenization, and in DELTA
mode nothing that grows with the output is copied."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from keel.engine.detokenizer import IncrementalDetokenizer
from keel.engine.logprobs import LogprobsProcessor
from keel.engine.parallel_sampling import ParentRequest
from keel.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from keel.request import Request
from keel.sampling_params import RequestOutputKind


@dataclass
class RequestState:
    """Everything the front end keeps about one request (one child, for n > 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    logprobs_processor: LogprobsProcessor
    parent_req: ParentRequest | None = None
    request_index: int = 0
    num_cached_tokens: int = 0

    @classmethod
    def from_new_request(
        cls, tokenizer: Any | None, request: Request, prompt: str | None,
        parent_req: ParentRequest | None, request_index: int,
    ) -> RequestState:
        return cls(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=request.sampling_params.output_kind,
            detokenizer=IncrementalDetokenizer.from_new_request(tokenizer, request),
            logprobs_processor=LogprobsProcessor.from_new_request(tokenizer, request),
            parent_req=parent_req,
            request_index=request_index,
        )

    def make_request_output(
        self, new_token_ids: list[int], finish_reason: str | None, stop_reason: int | str | None
    ) -> RequestOutput | None:
        """The RequestOutput to send now, or None when there is nothing to send: FINAL_ONLY
        before the end, a step that brought no token (a prefill chunk), or a parent still
        waiting for its other children."""
        finished = finish_reason is not None
        if not finished and (self.output_kind == RequestOutputKind.FINAL_ONLY
                             or not new_token_ids):
            return None
        completion = self._completion(new_token_ids, finish_reason, stop_reason)
        request_id, outputs = self.request_id, [completion]
        if self.parent_req is not None:
            request_id = self.parent_req.request_id
            outputs, finished = self.parent_req.get_outputs(self.request_id, completion)
            if not outputs:
                return None
        lp = self.logprobs_processor
        if self.output_kind == RequestOutputKind.DELTA:
            prompt_logprobs = lp.pop_prompt_logprobs()  # with the first output only
        else:
            prompt_logprobs = lp.prompt_logprobs
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )

    def _completion(
        self, new_token_ids: list[int], finish_reason: str | None, stop_reason: int | str | None
    ) -> CompletionOutput:
        finished = finish_reason is not None
        kind = self.output_kind
        delta = kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        logprobs = self.logprobs_processor.logprobs
        if delta:
            token_ids = list(new_token_ids)
            if logprobs is not None:
                logprobs = logprobs[max(len(logprobs) - len(new_token_ids), 0):]
        elif kind == RequestOutputKind.CUMULATIVE:
            # Copies: an output already handed to the user must not change under it.
            token_ids = list(self.detokenizer.output_token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        else:  # FINAL_ONLY: the state is dropped right after, nothing else will touch these
            token_ids = self.detokenizer.output_token_ids
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason if finished else None,
        )


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    # Requests that a stop string finished here while the engine core still runs them: the
    # caller aborts them there so they stop costing compute.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self, request: Request, prompt: str | None,
        parent_req: ParentRequest | None = None, request_index: int = 0,
    ) -> None:
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"Request id {request_id!r} is already running.")
        self.request_states[request_id] = RequestState.from_new_request(
            self.tokenizer, request, prompt, parent_req, request_index
        )
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Drop these requests (a parent id drops all its children); returns the ids the engine
        core must abort. Unknown or already finished ids are ignored."""
        to_abort: list[str] = []
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                to_abort.append(request_id)
                if state.parent_req is not None:
                    state.parent_req.remove_child(request_id)
                    self._maybe_drop_parent(state.parent_req)
                continue
            parent = self.parent_requests.pop(request_id, None)
            if parent is None:
                continue
            for child_id in sorted(parent.child_requests):
                if self.request_states.pop(child_id, None) is not None:
                    to_abort.append(child_id)
                parent.remove_child(child_id)
        return to_abort

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        result = OutputProcessorOutput()
        for out in engine_core_outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            if out.pooling_output is not None:  # a pooling request: one vector, finished
                del self.request_states[out.request_id]
                result.request_outputs.append(PoolingRequestOutput(
                    state.request_id, state.prompt, state.prompt_token_ids,
                    PoolingOutput(out.pooling_output)))
                continue
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            state.num_cached_tokens = max(out.num_cached_tokens, 0)
            state.logprobs_processor.update_from_output(out)
            stop_string = state.detokenizer.update(out.new_token_ids, finish_reason == "stop")
            if stop_string is not None:
                # The text was cut at the stop string: that is why the request ends, whatever
                # the engine core said about the same step.
                finish_reason, stop_reason = "stop", stop_string
            elif finish_reason is not None:
                state.detokenizer.flush()  # bytes of a character the output never completed
            request_output = state.make_request_output(out.new_token_ids, finish_reason,
                                                       stop_reason)
            if request_output is not None:
                result.request_outputs.append(request_output)
            if finish_reason is not None:
                del self.request_states[out.request_id]
                if state.parent_req is not None:
                    self._maybe_drop_parent(state.parent_req)
                if not out.finished:
                    result.reqs_to_abort.append(out.request_id)
        return result

    def _maybe_drop_parent(self, parent: ParentRequest) -> None:
        if not parent.child_requests:
            self.parent_requests.pop(parent.request_id, None)
