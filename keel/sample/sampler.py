"""Sampler: every SamplingParams transformation, over the whole batch at once, in vLLM's order:

  raw logprobs (only if a row asked) -> allowed ids -> bad words -> min_tokens -> logit bias ->
  penalties -> greedy argmax -> temperature -> min_p -> top-k / top-p -> random sample

A step that is not used by any row is skipped (its metadata field is None), so an all-greedy
batch with no processing is one argmax.

Random rows are sampled by inverse CDF: one uniform number per row, searched in the row's
cumulative probabilities (a cumsum and a binary search: ~12x cheaper on a CPU than drawing
vocab-many Exp(1) numbers for an exponential race). Rows with their own seed draw their number
from their own generator (the only per-row loop, and only over seeded rows)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from keel.cpu_ops import cpu_ops_for
from keel.outputs import LogprobsLists
from keel.sample import logits_processors as lp
from keel.sample.metadata import SamplingMetadata

_GREEDY_EPS = 1e-5


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsLists | None  # None when no row asked for logprobs


# Top-k / top-p look for their survivors among each row's top candidates (one topk), and fall
# back to a full sort only for rows whose nucleus is larger: a full-vocabulary sort costs ~40x
# a top-256 on a CPU (64 x 49152 logits: ~300 ms against ~8 ms on 2 cores).
_NUM_CANDIDATES = 256


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1); on the CPU keel's kernel (the same indices, 4x faster at
    [64, 49152] here: torch's ran on one thread). float32, or the LM head's bfloat16 where the
    step is a greedy argmax alone (keel/worker/sample_step.py)."""
    ops = cpu_ops_for(logits)
    if ops is not None and logits.dtype in (torch.float32, torch.bfloat16) and (
            logits.is_contiguous()) and (
            logits.dim() == 2 and logits.shape[1] > 0):
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """logits: [n, vocab] float32. Masks everything outside each row's top-k / top-p nucleus
    (top-k first, then top-p over what is left, as transformers' warpers in that order). A
    token survives top-p when the probability of the tokens ranked above it is below p; the
    most likely token always survives. Rows with neither are untouched."""
    if top_k is None and top_p is None:
        return logits
    n, vocab = logits.shape
    k = None if top_k is None else torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    p = None if top_p is None else top_p
    restricted = (k < vocab) if k is not None else torch.zeros(n, dtype=torch.bool,
                                                               device=logits.device)
    if p is not None:
        restricted |= p < 1.0
    every_row = bool(restricted.all())
    rows = None if every_row else restricted.nonzero().squeeze(1)  # [r]
    if rows is not None and rows.numel() == 0:
        return logits
    def pick(t):  # the restricted rows of a per-row tensor (no copy when that is all rows)
        return t if t is None or every_row else t[rows]

    sub, k_sub, p_sub = pick(logits), pick(k), pick(p)  # sub: [r, vocab]
    largest_k = 0 if k_sub is None else int(torch.where(k_sub < vocab, k_sub, 0).max())
    num_cand = min(vocab, max(_NUM_CANDIDATES, largest_k))
    cand, cand_ids = sub.topk(num_cand, dim=-1)  # [r, c], descending
    # The candidates' probabilities under the whole row (a softmax is cheaper than logsumexp).
    cand_probs = None if p_sub is None else sub.softmax(dim=-1).gather(1, cand_ids)
    keep, covered = _nucleus(cand, cand_probs, k_sub, p_sub)
    masked = torch.full_like(sub, float("-inf")).scatter_(
        1, cand_ids, cand.masked_fill(~keep, float("-inf")))
    if not bool(covered.all()):  # nucleus beyond the candidates: sort those rows in full
        wide = (~covered).nonzero().squeeze(1)
        full, order = sub[wide].sort(dim=-1, descending=True)
        keep_full, _ = _nucleus(full, None, None if k_sub is None else k_sub[wide],
                                None if p_sub is None else p_sub[wide])
        masked[wide] = torch.empty_like(full).scatter_(
            1, order, full.masked_fill(~keep_full, float("-inf")))
    if every_row:
        return masked
    logits[rows] = masked
    return logits


def _nucleus(desc: torch.Tensor, desc_probs: torch.Tensor | None, k: torch.Tensor | None,
             p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """desc [r, c]: each row's c largest logits, descending; desc_probs their probabilities
    under the whole row, or None when desc is the whole row. k [r] (vocab = off), p [r]
    (1 = off). Returns which columns survive top-k then top-p, and whether the c columns were
    enough to decide (the row's nucleus did not reach past them)."""
    width = desc.shape[1]
    keep = torch.ones_like(desc, dtype=torch.bool)
    covered = torch.ones(desc.shape[0], dtype=torch.bool, device=desc.device)
    if k is not None:
        kth = desc.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))  # ties with it survive
        keep &= desc >= kth
    if p is not None:
        masked = desc.masked_fill(~keep, float("-inf"))
        if desc_probs is None:
            probs = masked.softmax(dim=-1)
        else:
            # A top-k inside the candidates leaves only candidates: renormalise over them.
            # Otherwise the whole row's probabilities are the ones top-p reads.
            inside = (k <= width) if k is not None else torch.zeros_like(covered)
            probs = torch.where(inside.unsqueeze(1), masked.softmax(dim=-1), desc_probs)
            covered = inside | (probs.sum(dim=-1) >= p)
        above = probs.cumsum(dim=-1) - probs  # mass ranked strictly above each token
        keep &= above < p.unsqueeze(1)
        keep[:, 0] = True
    return keep, covered


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


def _to_all_rows(lists: LogprobsLists, rows: torch.Tensor, n: int) -> LogprobsLists:
    """Scatter the asking rows' logprobs into [n, ...] arrays (other rows: zeros, never read)."""
    idx = rows.cpu().numpy()
    ids = np.zeros((n, lists.logprob_token_ids.shape[1]), dtype=lists.logprob_token_ids.dtype)
    lps = np.zeros((n, lists.logprobs.shape[1]), dtype=lists.logprobs.dtype)
    ranks = np.zeros(n, dtype=lists.ranks.dtype)
    ids[idx], lps[idx], ranks[idx] = lists
    return LogprobsLists(ids, lps, ranks)


class Sampler:
    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        self._uniform: torch.Tensor | None = None  # [max_num_reqs, 1], made on first use
        self._penalty_buffers = lp.PenaltyBuffers()

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [num_reqs, vocab] float32, consumed (modified in place)."""
        raw_logprobs = None
        rows = meta.logprobs_rows
        if meta.max_num_logprobs is not None:
            # vLLM's default: logprobs of the model's own distribution, before any processing;
            # only for the rows that asked.
            raw_logprobs = (logits if rows is None else logits[rows]).log_softmax(dim=-1)
        if not meta.no_processing:
            logits = self.apply_logits_processors(logits, meta)
        sampled = self.sample(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, meta.max_num_logprobs,
                                       sampled if rows is None else sampled[rows])
            if rows is not None:
                logprobs = _to_all_rows(logprobs, rows, sampled.shape[0])
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
        greedy = None if meta.all_random else _argmax(logits)
        if meta.all_greedy:
            return greedy
        temperature = meta.temperature
        # Greedy rows get temperature 1 here (any value works: their result is overridden).
        t = torch.where(temperature < _GREEDY_EPS, 1.0, temperature)
        logits = logits.div_(t.unsqueeze(1))
        if meta.min_p is not None:
            logits = lp.apply_min_p(logits, *meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        sampled = self._draw(logits.softmax(dim=-1), meta.generators)
        if meta.all_random:
            return sampled
        return torch.where(temperature < _GREEDY_EPS, greedy, sampled)

    def _draw(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """probs [n, vocab] (consumed) -> one token per row, drawn from each row's probs.
        E.g. probs [0.2, 0, 0.5, 0.3] -> cdf [0.2, 0.2, 0.7, 1.0]; u = 0.45 -> token 2 (the
        first with cdf > u); a zero-probability token is never the first."""
        n, vocab = probs.shape
        cdf = probs.cumsum_(dim=-1)
        if self._uniform is None or self._uniform.device != probs.device:
            self._uniform = torch.empty(self.max_num_reqs, 1, device=probs.device)
        u = self._uniform[:n].uniform_()
        for row, gen in generators.items():
            u[row].uniform_(generator=gen)
        total = cdf[:, -1:]
        # u < total, so the search always lands on a token with probability > 0.
        u = torch.minimum(u.mul_(total), torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=vocab - 1)
