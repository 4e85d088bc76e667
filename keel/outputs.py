"""What crosses the layers: ModelRunnerOutput (worker -> engine), EngineCoreOutput(s)
(engine core -> front end), RequestOutput (front end -> user)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

# ---- logprobs ---------------------------------------------------------------------------------


class LogprobsLists(NamedTuple):
    """Logprobs of k+1 tokens for each of m positions (NumPy, on the CPU). Column 0 is the token
    that was sampled (or, for prompt logprobs, the prompt's next token); columns 1..k are the
    top-k tokens in descending order. `ranks` is column 0's rank in the full vocabulary
    (1 = most likely)."""

    logprob_token_ids: np.ndarray  # [m, k + 1] int64
    logprobs: np.ndarray  # [m, k + 1] float32
    ranks: np.ndarray  # [m] int64

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(self.logprob_token_ids[start:end], self.logprobs[start:end],
                             self.ranks[start:end])


@dataclass(slots=True)
class Logprob:
    """One token's entry in a logprobs dict, as vLLM returns it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token; one per prompt token (None for the first, which has no context).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]

# ---- pipeline stage -> next stage ------------------------------------------------------------


@dataclass(slots=True)
class IntermediateTensors:
    """What a non-final pipeline stage returns from `execute_model` instead of parking logits:
    the hidden states and residual after its last layer, which the worker sends on."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str):
        return self.tensors[key]


# ---- worker -> engine core ----------------------------------------------------------------------


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request, in req_ids order; empty for rows discarded (still prefilling).
    sampled_token_ids: list[list[int]]
    # Rows in req_ids order, one position each; None when no request in the batch asked.
    logprobs: LogprobsLists | None = None
    # req_id -> this pass's chunk of prompt logprobs, for requests that asked for them.
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)
    # Speculative decoding: the drafts proposed for the next step, in req_ids order.
    spec_token_ids: list[list[int]] | None = None
    # Async scheduling with drafts: how many drafts each row really verified (the scheduler
    # planned placeholders; the runner may have had fewer drafts). None otherwise.
    num_draft_tokens: list[int] | None = None
    # Tracing on (keel/trace/): what this pass did to the persistent batch; else None.
    trace: dict | None = None
    # A pooling model: per row, the pooled vector of a prompt completed this pass (float32,
    # on the CPU), None for a row still prefilling. None for a generation model.
    pooler_output: list[torch.Tensor | None] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])

# ---- engine core -> front end -------------------------------------------------------------------


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id (or, front end, stop string)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    new_logprobs: LogprobsLists | None = None  # one row per new token
    new_prompt_logprobs: LogprobsLists | None = None  # one row per prompt position this pass
    pooling_output: torch.Tensor | None = None  # a pooling request's vector (it is finished)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's state after a step, for metrics (the server's /metrics)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # share of KV blocks in use, 0..1
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, cumulative
    prefix_cache_hits: int = 0  # of which were found cached
    # Speculative decoding, cumulative: verification passes with drafts, drafts, accepted
    # drafts, and accepted drafts at each position (index 0 = the first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_requests: set[str] = field(default_factory=set)
    # Set by the engine-core process on what it sends to the front end.
    scheduler_stats: SchedulerStats | None = None

# ---- front end -> user --------------------------------------------------------------------------


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string, when "stop"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


# ---- pooling models (LLM.encode / LLM.embed) ----------------------------------------------------


@dataclass
class PoolingOutput:
    data: torch.Tensor  # [hidden] float32, the pooled vector


@dataclass
class PoolingRequestOutput:
    """What `LLM.encode` returns per prompt (vLLM's name): `outputs.data` is the tensor."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's name): `outputs.embedding` is a list."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, out.prompt, out.prompt_token_ids,
                   EmbeddingOutput(out.outputs.data.tolist()), out.finished)
