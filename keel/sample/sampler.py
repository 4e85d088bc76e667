"""Sampler: greedy, temperature, top-k, top-p, over the whole batch at once.

Random rows are sampled with the exponential race (argmax of probs / Exp(1) noise), which
equals sampling from `probs` and needs no sync or sort; rows with their own seed draw their
noise from their own generator (the only per-row loop, and only over seeded rows)."""

from __future__ import annotations

import torch

from keel.sample.metadata import SamplingMetadata

_GREEDY_EPS = 1e-5


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


class Sampler:
    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        self._noise: torch.Tensor | None = None  # [max_num_reqs, vocab], made on first use

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [num_reqs, vocab] float32, consumed (modified in place) -> token ids
        [num_reqs] int64."""
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        temperature = meta.temperature
        # Greedy rows get temperature 1 here (any value works: their result is overridden).
        t = torch.where(temperature < _GREEDY_EPS, 1.0, temperature)
        logits = apply_top_k_top_p(logits.div_(t.unsqueeze(1)), meta.top_k, meta.top_p)
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
