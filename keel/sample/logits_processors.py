"""The transformations the sampler applies to logits before it picks a token, each over the
whole batch (or over the rows that use it) at once. All work in place on `logits`
[num_reqs, vocab] float32 and return it.

Penalties, bad words and min_tokens read the token ids the persistent batch already holds
(`TokenHistory`), so nothing is copied per request per step."""

from __future__ import annotations

import numpy as np
import torch

from keel.sample.metadata import MinTokens, Penalties, TokenHistory

_NEG_INF = float("-inf")


def apply_allowed_token_ids(logits: torch.Tensor, rows: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
    """mask [k, vocab]: True where row rows[i] may NOT emit the token."""
    logits[rows] = logits[rows].masked_fill_(mask, _NEG_INF)
    return logits


def apply_bad_words(logits: torch.Tensor, bad_words: dict[int, list[list[int]]],
                    hist: TokenHistory) -> torch.Tensor:
    """Ban the last token of each bad-word sequence whose other tokens are the row's latest
    outputs (a one-token bad word is always banned). A loop over the rows that use bad words
    only, as vLLM has it; one index write for the whole batch."""
    token_ids = hist.token_ids_cpu_tensor.numpy()
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for row, sequences in bad_words.items():
        n_tok = int(hist.num_tokens[row])
        n_out = n_tok - int(hist.num_prompt_tokens[row])
        for seq in sequences:
            prefix = len(seq) - 1
            if prefix > n_out:
                continue
            if prefix == 0 or token_ids[row, n_tok - prefix : n_tok].tolist() == seq[:-1]:
                ban_rows.append(row)
                ban_ids.append(seq[-1])
    if ban_rows:
        logits[torch.tensor(ban_rows, device=logits.device),
               torch.tensor(ban_ids, device=logits.device)] = _NEG_INF
    return logits


def apply_min_tokens(logits: torch.Tensor, mt: MinTokens, hist: TokenHistory) -> torch.Tensor:
    """Mask the stop ids of rows with fewer than min_tokens outputs so far."""
    num_out = hist.num_tokens[mt.rows_np] - hist.num_prompt_tokens[mt.rows_np]
    active = num_out < mt.min_tokens  # [k]
    if active.any():
        sel = active[mt.pair_row_pos]  # [p]
        rows = torch.from_numpy(mt.rows_np[mt.pair_row_pos[sel]]).to(logits.device)
        ids = torch.from_numpy(mt.pair_token_ids[sel]).to(logits.device)
        logits[rows, ids] = _NEG_INF
    return logits


def apply_logit_bias(logits: torch.Tensor,
                     bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    rows, ids, values = bias
    return logits.index_put_((rows, ids), values, accumulate=True)


class PenaltyBuffers:
    """Token-count scratch space for the penalty rows, [max_num_reqs, vocab], made on first use
    and overwritten each step."""

    def __init__(self) -> None:
        self.output_counts: torch.Tensor | None = None
        self.prompt_counts: torch.Tensor | None = None

    def get(self, k: int, vocab: int, device: torch.device, max_rows: int):
        if self.output_counts is None or self.output_counts.shape[1] != vocab:
            self.output_counts = torch.zeros(max_rows, vocab, dtype=torch.float32, device=device)
            self.prompt_counts = torch.zeros(max_rows, vocab, dtype=torch.float32, device=device)
        return self.output_counts[:k].zero_(), self.prompt_counts[:k].zero_()


def apply_penalties(logits: torch.Tensor, pen: Penalties, hist: TokenHistory,
                    buffers: PenaltyBuffers, max_rows: int) -> torch.Tensor:
    """vLLM's penalties, vectorised over the penalty rows:
      repetition: tokens seen in the prompt or the output: logit / r if > 0, else logit * r
      frequency:  logit -= f * (times the token appears in the output)
      presence:   logit -= p * (1 if it appears in the output at all)
    E.g. prompt [5, 7], output [7, 7, 9]: output counts {7: 2, 9: 1}; seen {5, 7, 9}."""
    rows_np = pen.rows_np
    k, vocab = len(rows_np), logits.shape[1]
    num_prompt = hist.num_prompt_tokens[rows_np][:, None]  # [k, 1]
    num_tok = hist.num_tokens[rows_np][:, None]
    width = int(num_tok.max())
    # [k, width]: each row's prompt + output ids (past num_tokens: stale ids, weighted 0).
    tokens = hist.token_ids_cpu_tensor[torch.from_numpy(rows_np), :width]
    tokens = tokens.to(device=logits.device, dtype=torch.int64)
    pos = np.arange(width)[None, :]
    out_w = torch.from_numpy(((pos >= num_prompt) & (pos < num_tok)).astype(np.float32))
    prompt_w = torch.from_numpy((pos < num_prompt).astype(np.float32))
    output_counts, prompt_counts = buffers.get(k, vocab, logits.device, max_rows)
    output_counts.scatter_add_(1, tokens, out_w.to(logits.device))
    prompt_counts.scatter_add_(1, tokens, prompt_w.to(logits.device))

    rows = pen.rows
    sub = logits[rows]  # [k, vocab]
    seen = (output_counts > 0) | (prompt_counts > 0)
    rep = pen.repetition.unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= pen.frequency.unsqueeze(1) * output_counts
    sub -= pen.presence.unsqueeze(1) * (output_counts > 0)
    logits[rows] = sub
    return logits


def apply_min_p(logits: torch.Tensor, rows: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability, in the
    rows that set min_p. p < min_p * p_max  <=>  logit < max_logit + log(min_p), so no softmax
    is needed."""
    sub = logits[rows]  # [k, vocab]
    threshold = sub.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits[rows] = sub.masked_fill_(sub < threshold, _NEG_INF)
    return logits
