"""What the scheduler decides per request around a step (vLLM keeps `check_stop` in
vllm/v1/core/sched/utils.py too): whether a request may be scheduled again before its tokens in
flight are known, how those tokens settle its counts once they are, whether it stops, whether
its grammar accepts a token, and the output of a pooled request."""

from __future__ import annotations

import logging
from typing import Any

from keel.outputs import EngineCoreOutput
from keel.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def can_schedule_ahead(request: Request, max_model_len: int) -> bool:
    """Async scheduling: may this running request get another step before the tokens of its
    steps in flight are known? Not past max_tokens or max_model_len, and not with a grammar
    (its bitmask needs the previous token)."""
    pending = request.num_output_placeholders
    if pending == 0:
        return True
    return (not request.use_structured_output
            and len(request.output_token_ids) + pending < request.max_tokens
            and request.num_tokens + pending < max_model_len)


def settle_in_flight(request: Request, drafts: list[int] | None, num_new: int,
                     async_scheduling: bool, num_draft_tokens, row: int, spec_stats) -> None:
    """A step's `num_new` sampled tokens are known: settle what schedule() counted ahead.
    With async scheduling its 1 + drafts placeholders are released. schedule() counted every
    draft as computed: the rejected ones are taken back (their KV slots are overwritten next
    step), and so are the placeholders the runner had no draft for (`num_draft_tokens[row]`).
    A request preempted meanwhile has nothing to take back."""
    if async_scheduling and num_new:
        request.num_output_placeholders -= 1 + len(drafts or ())
    if not drafts:
        return
    num_accepted = num_new - 1
    if request.status == RequestStatus.RUNNING:
        request.num_computed_tokens -= len(drafts) - num_accepted
    num_verified = len(drafts) if num_draft_tokens is None else num_draft_tokens[row]
    if num_verified:
        spec_stats.observe(num_verified, num_accepted)


def finish_pooled(request: Request, pooled: Any) -> EngineCoreOutput:
    request.status = RequestStatus.FINISHED_STOPPED
    return EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                            finish_reason="stop", num_preemptions=request.num_preemptions,
                            num_cached_tokens=request.num_cached_tokens,
                            pooling_output=pooled)


def advance_grammar(request: Request, token: int) -> bool:
    """Feed the sampled token to the request's matcher; False when that finishes the
    request: the grammar is complete ("stop"), or it rejects the token, which the bitmask
    should have made impossible (an engine bug: logged, the request ends with "error",
    the engine goes on)."""
    grammar = request.structured_output_request
    if not grammar.accept_token(token):
        logger.error("Request %s: the grammar rejected sampled token %d; finishing it "
                     "with an error.", request.request_id, token)
        request.status = RequestStatus.FINISHED_ERROR
        return False
    if grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED
        return False
    return True


def check_stop(request: Request, max_model_len: int) -> bool:
    """EOS (unless ignore_eos) and the stop token ids, once min_tokens are out; then the
    length cap. A stop token that is also the last allowed one reports "stop". Stop strings
    are the front end's (they need text)."""
    sp = request.sampling_params
    num_output = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    if num_output >= sp.min_tokens and not sp.ignore_eos and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
    elif num_output >= sp.min_tokens and last in sp.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
    elif num_output >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    else:
        return False
    return True
