"""Rejection sampling for speculative decoding: which draft tokens the target model accepts.

For each request with d drafts the model produced d + 1 rows of logits: the targets at each
draft position, then the bonus position. Walking the drafts in order:

  greedy rows   accept draft j while it equals the target's argmax at j (exact: the output is
                the greedy output of the target alone)
  random rows   accept draft x with probability min(1, p(x) / q(x)), where p is the target's
                processed distribution (temperature, min-p, top-k, top-p) and q the drafter's;
                n-gram drafts are a point mass, q(x) = 1. At the first rejection, sample from
                the residual max(0, p - q), normalised: p without x. The result is distributed
                exactly as p (the standard speculative sampling rule).

If every draft is accepted, the bonus token (sampled from the bonus row by the ordinary
Sampler, with every SamplingParams feature) follows them. So each request gets between 1 and
d + 1 tokens. Seeded requests draw their uniforms from their own generator, so a seeded run
repeats exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from keel.sample import logits_processors as lp
from keel.sample.metadata import SamplingMetadata
from keel.sample.sampler import apply_top_k_top_p

_GREEDY_EPS = 1e-5


@dataclass
class SpecDecodeMetadata:
    """Built by ModelRunner._calc_spec_decode_metadata for a pass with draft tokens."""

    draft_token_ids: torch.Tensor  # [total drafts] the drafts, request after request
    num_draft_tokens: np.ndarray  # [num_reqs] drafts per request row (0 for most)
    target_logits_indices: torch.Tensor  # [total drafts] rows of the parked logits
    bonus_logits_indices: torch.Tensor  # [num_reqs] the last row of each request
    logits_indices: torch.Tensor  # [total drafts + num_reqs] rows of hidden states projected


def _expand(values: torch.Tensor | None, req_of_row: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else values[req_of_row]


def target_probs(logits: torch.Tensor, req_of_row: torch.Tensor, meta: SamplingMetadata
                 ) -> torch.Tensor:
    """The processed distribution of each target row, with its request's parameters (rows of
    greedy requests are left at temperature 1: only their argmax is used)."""
    t = meta.temperature[req_of_row]
    logits = logits / torch.where(t < _GREEDY_EPS, 1.0, t).unsqueeze(1)
    if meta.min_p is not None:
        rows, values = meta.min_p
        per_req = torch.zeros(int(meta.temperature.shape[0]), dtype=values.dtype)
        per_req[rows] = values
        row_min_p = per_req[req_of_row]
        sel = torch.nonzero(row_min_p > 0).flatten()
        if len(sel):
            logits = lp.apply_min_p(logits, sel, row_min_p[sel])
    logits = apply_top_k_top_p(logits, _expand(meta.top_k, req_of_row),
                               _expand(meta.top_p, req_of_row))
    return logits.softmax(dim=-1)


def rejection_sample(target_logits: torch.Tensor | None, spec: SpecDecodeMetadata,
                     bonus_token_ids: torch.Tensor, meta: SamplingMetadata,
                     target_argmax: torch.Tensor | None = None
                     ) -> tuple[list[list[int]], np.ndarray]:
    """Returns the output tokens of every request row and how many drafts each accepted.
    target_argmax: each target row's argmax, where the LM head took it without the logits
    (an all-greedy batch: target_logits None)."""
    num_reqs = len(spec.num_draft_tokens)
    bonus = bonus_token_ids.tolist()
    num_draft = spec.num_draft_tokens
    total = int(num_draft.sum())
    if total == 0:
        return [[b] for b in bonus], np.zeros(num_reqs, dtype=np.int64)
    req_of_row = torch.from_numpy(np.repeat(np.arange(num_reqs), num_draft))
    drafts = spec.draft_token_ids
    assert target_logits is not None or (meta.all_greedy and target_argmax is not None), \
        "rows that sample need the targets' logits"
    argmax = target_logits.argmax(dim=-1) if target_argmax is None else target_argmax
    accept = drafts == argmax  # greedy rule
    recovered = argmax.clone()
    if not meta.all_greedy:
        probs = target_probs(target_logits, req_of_row, meta)
        u = torch.rand(total)
        starts = np.concatenate([[0], np.cumsum(num_draft)[:-1]])
        for row, gen in meta.generators.items():
            if num_draft[row]:
                s = int(starts[row])
                u[s : s + int(num_draft[row])] = torch.rand(int(num_draft[row]), generator=gen)
        p_draft = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        random_row = meta.temperature[req_of_row] >= _GREEDY_EPS
        accept = torch.where(random_row, u < p_draft, accept)
        # The residual for a point-mass draft: p with the draft removed (renormalised).
        residual = probs.scatter(1, drafts.unsqueeze(1), 0.0)
        empty = residual.sum(dim=1) <= 0  # p was all on the draft: it is accepted anyway
        residual[empty] = probs[empty]
        draws = torch.multinomial(residual, 1).squeeze(1)
        for row, gen in meta.generators.items():
            if num_draft[row]:
                s = int(starts[row])
                e = s + int(num_draft[row])
                draws[s:e] = torch.multinomial(residual[s:e], 1, generator=gen).squeeze(1)
        recovered = torch.where(random_row, draws, recovered)
    # Accepted = the leading run of accepts of each request: pad to [num_reqs, max_d].
    max_d = int(num_draft.max())
    pos = torch.arange(total) - torch.from_numpy(
        np.repeat(np.cumsum(num_draft) - num_draft, num_draft))
    grid = torch.zeros(num_reqs, max_d, dtype=torch.bool)
    grid[req_of_row, pos] = accept
    num_accepted = grid.to(torch.int32).cumprod(dim=1).sum(dim=1).numpy()
    drafts_l, recovered_l = drafts.tolist(), recovered.tolist()
    out = []
    start = 0
    for row in range(num_reqs):
        d, a = int(num_draft[row]), int(num_accepted[row])
        tokens = drafts_l[start : start + a]
        tokens.append(bonus[row] if a == d else recovered_l[start + a])
        out.append(tokens)
        start += d
    return out, num_accepted
