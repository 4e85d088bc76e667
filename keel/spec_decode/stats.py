"""What the scheduler counts about drafts, and which requests may have any."""

from __future__ import annotations

from dataclasses import dataclass, field

from keel.sampling_params import SamplingParams


@dataclass
class SpecDecodingStats:
    """Cumulative: verification passes with drafts, drafts proposed, drafts accepted, and
    drafts accepted at each position (index 0 = the first draft)."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def scheduler_stats_fields(self) -> dict:
        """These counts as SchedulerStats' `spec_*` fields."""
        return {"spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_pos": list(self.accepted_per_pos)}


def can_speculate(sp: SamplingParams) -> bool:
    """Drafts are verified with temperature, min-p, top-k and top-p; a request that needs any
    other processing of its logits (or logprobs, or a grammar) decodes one token at a time."""
    return (sp.structured_outputs is None and sp.logprobs is None
            and sp.prompt_logprobs is None and not sp.logit_bias and not sp.allowed_token_ids
            and not sp.bad_words and sp.min_tokens == 0 and sp.presence_penalty == 0
            and sp.frequency_penalty == 0 and sp.repetition_penalty == 1.0)
