"""SchedulerOutput: the scheduler's decision for one pass, the only thing the runner diffs
its persistent batch against. Field names are the seed's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keel.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has never seen (or saw finish): everything needed to add it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # one list per KV cache group (keel has one group)
    num_computed_tokens: int
    pooling_params: Any = None  # PoolingParams of an embedding request, else None


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds in `self.requests`, as parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    # Resumed from preemption: their new_block_ids are the whole block list, not an addition.
    resumed_req_ids: set[str] = field(default_factory=set)
    # Tokens the runner does not have yet: for a resumed request, its output so far.
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens this pass
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    # Preempted since the last output (their blocks are freed; they resume as cached reqs).
    preempted_req_ids: set[str] = field(default_factory=set)


@dataclass(slots=True)
class GrammarOutput:
    """What `Scheduler.get_grammar_bitmask` hands to `sample_tokens`: one bitmask row per
    constrained request that samples a kept token this step (bit t of a row set = token t
    allowed). Rows follow `structured_output_request_ids`, not the batch's row order (the
    runner maps them through `req_id_to_index`)."""

    structured_output_request_ids: list[str]
    grammar_bitmask: Any  # torch.Tensor [len(ids), ceil(vocab / 32)] int32, on the CPU
