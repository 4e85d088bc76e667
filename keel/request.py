"""The scheduler's view of a request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from keel.pooling_params import PoolingParams
from keel.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 1  # its grammar is still compiling: not scheduled before it is ready
    RUNNING = 2
    PREEMPTED = 3
    # Finished states (> PREEMPTED):
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # the engine could not go on with it (e.g. its grammar failed)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(status)


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_tokens: int = 16  # sampling_params.max_tokens, or what max_model_len leaves
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | None = None  # the stop token id that ended it, if any
    # Its grammar and matcher, when it asked for structured outputs (set by the engine core).
    structured_output_request: Any = None
    # Prefix caching: the hash of each full block (keel/core/kv_cache_utils.py), and how many
    # prompt tokens the first scheduling found cached (-1 before it).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = -1
    # Speculative decoding: drafts proposed after the last step, scheduled in the next.
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: tokens sampled by steps still in flight (scheduled, not yet known).
    num_output_placeholders: int = 0
    # A pooling request (embeddings): finished with one vector once its prompt is computed.
    pooling_params: PoolingParams | None = None

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building prompt + output."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        n = len(prompt)
        if start >= n:
            return output[start - n : end - n]
        return prompt[start:end] + output[: max(0, end - n)]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
