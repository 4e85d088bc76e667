"""Sampler: every SamplingParams transformation, over the whole batch at once, in vLLM's order:

  raw logprobs (only if a row asked) -> allowed ids -> bad words -> min_tokens -> logit bias ->
  penalties -> greedy argmax -> temperature -> min_p -> top-k / top-p -> random sample

A step that is not used by any row is skipped (its metadata field is None), so an all-greedy
batch with no processing is one argmax.

Random rows are sampled with the exponential race (argmax of probs / Exp(1) noise), which
equals sampling from `probs` and needs no sync or sort; rows with their own seed draw their
noise from their own generator (the only per-row loop, and only over seeded rows)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from keel.outputs import LogprobsLists
from keel.sample import logits_processors as lp
from keel.sample.metadata import SamplingMetadata

_GREEDY_EPS = 1e-5


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsLists | None  # None when no row asked for logprobs


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """logits: [n, vocab] float32. Masks everything outside each row's top-k / top-p nucleus."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # [n, 1] k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs(logprobs: torch.Tensor, num_top: int,
                    token_ids: torch.Tensor) -> LogprobsLists:
    """logprobs [m, vocab], token_ids [m] -> for each row the token's logprob and rank, then the
    num_top most likely tokens. E.g. logprobs [-0.1, -3, -2.5], token 2, num_top 1 ->
    ids [[2, 0]], logprobs [[-2.5, -0.1]], ranks [2]."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)  # [m, 1]
    ranks = (logprobs >= token_logprobs).sum(dim=-1)  # ties count as better: rank >= 1
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)
    return LogprobsLists(token_ids.cpu().numpy(), token_logprobs.cpu().numpy(),
                         ranks.cpu().numpy())


class Sampler:
    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        self._noise: torch.Tensor | None = None  # [max_num_reqs, vocab], made on first use
        self._penalty_buffers = lp.PenaltyBuffers()

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [num_reqs, vocab] float32, consumed (modified in place)."""
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            # vLLM's default: logprobs of the model's own distribution, before any processing.
            raw_logprobs = logits.log_softmax(dim=-1)
        if not meta.no_processing:
            logits = self.apply_logits_processors(logits, meta)
        sampled = self.sample(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, meta.max_num_logprobs, sampled)
        return SamplerOutput(sampled, logprobs)

    def apply_logits_processors(self, logits: torch.Tensor,
                                meta: SamplingMetadata) -> torch.Tensor:
        hist = meta.history
        if meta.allowed_token_ids_mask is not None:
            logits = lp.apply_allowed_token_ids(logits, *meta.allowed_token_ids_mask)
        if meta.bad_words_token_ids:
            logits = lp.apply_bad_words(logits, meta.bad_words_token_ids, hist)
        if meta.min_tokens is not None:
            logits = lp.apply_min_tokens(logits, meta.min_tokens, hist)
        if meta.logit_bias is not None:
            logits = lp.apply_logit_bias(logits, meta.logit_bias)
        if meta.penalties is not None:
            logits = lp.apply_penalties(logits, meta.penalties, hist, self._penalty_buffers,
                                        self.max_num_reqs)
        return logits

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Processed logits -> token ids [num_reqs] int64."""
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        temperature = meta.temperature
        # Greedy rows get temperature 1 here (any value works: their result is overridden).
        t = torch.where(temperature < _GREEDY_EPS, 1.0, temperature)
        logits = logits.div_(t.unsqueeze(1))
        if meta.min_p is not None:
            logits = lp.apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        noise = self._noise_buffer(probs)
        noise.exponential_()
        for row, gen in meta.generators.items():
            noise[row].exponential_(generator=gen)
        sampled = probs.div_(noise).argmax(dim=-1)
        if meta.all_random:
            return sampled
        return torch.where(temperature < _GREEDY_EPS, greedy, sampled)

    def _noise_buffer(self, probs: torch.Tensor) -> torch.Tensor:
        """A [num_reqs, vocab] view of a buffer allocated once for the largest batch."""
        n, vocab = probs.shape
        if self._noise is None or self._noise.shape[1] != vocab:
            self._noise = torch.empty(self.max_num_reqs, vocab, dtype=probs.dtype,
                                      device=probs.device)
        return self._noise[:n]
