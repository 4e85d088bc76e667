"""Turns the engine core's logprob arrays into vLLM's per-position dicts for one request.

The engine core sends NumPy rows with as many top-k columns as the batch's largest request
asked for; each request keeps only its own count here, so one request's large `logprobs` never
shows up in another's output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keel.outputs import EngineCoreOutput, Logprob, LogprobsLists, PromptLogprobs, SampleLogprobs
from keel.request import Request


@dataclass
class LogprobsProcessor:
    tokenizer: Any | None  # None: decoded_token stays None
    num_logprobs: int | None  # top-k per generated token; None: not requested
    num_prompt_logprobs: int | None  # top-k per prompt token; None: not requested
    logprobs: SampleLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    cumulative_logprob: float | None = None
    # token id -> its text; the same top tokens come back position after position.
    _decoded: dict[int, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_new_request(cls, tokenizer: Any | None, request: Request) -> LogprobsProcessor:
        params = request.sampling_params
        sample = params.logprobs is not None
        prompt = params.prompt_logprobs is not None
        return cls(
            tokenizer=tokenizer if params.detokenize else None,
            num_logprobs=params.logprobs,
            num_prompt_logprobs=params.prompt_logprobs,
            logprobs=[] if sample else None,
            # The first prompt token has no context, hence no logprob.
            prompt_logprobs=[None] if prompt else None,
            cumulative_logprob=0.0 if sample else None,
        )

    def update_from_output(self, output: EngineCoreOutput) -> None:
        if output.new_logprobs is not None and self.logprobs is not None:
            rows = self._positions(output.new_logprobs, self.num_logprobs)
            for entry, sampled_logprob in rows:
                self.logprobs.append(entry)
                self.cumulative_logprob += sampled_logprob
        if output.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            rows = self._positions(output.new_prompt_logprobs, self.num_prompt_logprobs)
            self.prompt_logprobs.extend(entry for entry, _ in rows)

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs gathered since the last pop (delta outputs send them once)."""
        plp = self.prompt_logprobs
        if not plp:
            return None
        self.prompt_logprobs = []
        return plp

    def _positions(
        self, lists: LogprobsLists, num: int | None
    ) -> list[tuple[dict[int, Logprob], float]]:
        """One dict per row: column 0 (the sampled / actual token, with its vocabulary rank)
        first, then this request's top `num` tokens with ranks 1..num."""
        cols = lists.logprobs.shape[1] if num is None or num < 0 else num + 1
        token_ids = lists.logprob_token_ids[:, :cols].tolist()
        logprobs = lists.logprobs[:, :cols].tolist()
        ranks = lists.ranks.tolist()
        out = []
        for ids, lps, rank in zip(token_ids, logprobs, ranks):
            entry = {ids[0]: Logprob(float(lps[0]), int(rank), self._decode(ids[0]))}
            for top_rank, (token_id, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                if token_id not in entry:  # the sampled token keeps its own (exact) rank
                    entry[token_id] = Logprob(float(lp), top_rank, self._decode(token_id))
            out.append((entry, float(lps[0])))
        return out

    def _decode(self, token_id: int) -> str | None:
        """One token's own text, as vLLM writes it (not a continuation of its context)."""
        if self.tokenizer is None:
            return None
        text = self._decoded.get(token_id)
        if text is None:
            try:
                token = self.tokenizer.convert_ids_to_tokens(token_id)
            except (IndexError, KeyError, OverflowError, TypeError):
                token = None  # an id outside the tokenizer (a padded vocabulary)
            text = "" if token is None else self.tokenizer.convert_tokens_to_string([token])
            self._decoded[token_id] = text
        return text
