"""N-gram (prompt lookup) drafts, vectorised over the batch.

For each request: take the last n tokens of its prompt + output (n from prompt_lookup_max down
to prompt_lookup_min), find the most recent earlier place where those n tokens occur, and
propose the k tokens that followed them there. E.g. tokens [5 6 7 8 5 6], n = 2: the suffix
[5 6] occurred at 0, followed by [7 8 5] -> drafts [7, 8, 5] for k = 3.

Where fewer than k tokens follow the match (the sequence repeats with a period shorter than
k), the drafts go on as the sequence would if it kept repeating: draft j is the token that
followed the match j places later, counting the drafts themselves, i.e. the followers again
from the start. E.g. [1 2 1 2], n = 2: [1 2] at 0 is followed by [1 2] and then by the drafts
-> [1, 2, 1, 2] for k = 4, where taking only the known followers would stop at [1, 2]. A
request whose output has fallen into a short loop then gets k drafts each step instead of its
period's worth.

The token ids come from the persistent batch (`input_batch.token_ids_cpu`); every request is
matched at once with one sliding-window comparison per n (torch `unfold`), no per-request loop.
"""

from __future__ import annotations

import numpy as np
import torch


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose_for_batch(self, batch, rows: np.ndarray) -> list[list[int]]:
        """Drafts for the given rows of the persistent batch; [] for every other row."""
        out: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        drafts = self.propose(batch.token_ids_cpu_tensor, batch.num_tokens, rows)
        for row, draft in zip(rows.tolist(), drafts):
            out[row] = draft
        return out

    def propose(self, token_ids: torch.Tensor, num_tokens: np.ndarray, rows: np.ndarray
                ) -> list[list[int]]:
        """token_ids: [num_rows, max_len] (each row's ids, valid up to num_tokens[row]);
        rows: the rows to draft for. Returns one draft list per row of `rows` (maybe empty)."""
        out: list[list[int]] = [[] for _ in range(len(rows))]
        if len(rows) == 0:
            return out
        lens = torch.from_numpy(num_tokens[rows].astype(np.int64))
        width = int(lens.max())
        if width <= self.min_n:
            return out
        toks = token_ids[torch.from_numpy(rows.astype(np.int64)), :width]  # [R, width]
        todo = torch.ones(len(rows), dtype=torch.bool)  # rows still without a match
        start = torch.full((len(rows),), -1, dtype=torch.int64)  # where the draft begins
        for n in range(min(self.max_n, width - 1), self.min_n - 1, -1):
            if not bool(todo.any()):
                break
            # The last n tokens of each row: positions lens-n .. lens-1.
            idx = (lens - n).clamp(min=0).unsqueeze(1) + torch.arange(n)
            suffix = toks.gather(1, idx)  # [R, n]
            windows = toks.unfold(1, n, 1)  # [R, width - n + 1, n]
            match = (windows == suffix.unsqueeze(1)).all(dim=-1)  # window p equals the suffix
            # Only earlier occurrences with at least one token after them: p + n < lens.
            p = torch.arange(match.shape[1])
            match &= (p.unsqueeze(0) + n < lens.unsqueeze(1)) & (lens >= n + 1).unsqueeze(1)
            # The most recent one: the largest matching p.
            last = torch.where(match, p.unsqueeze(0), -1).amax(dim=1)
            found = todo & (last >= 0)
            start = torch.where(found, last + n, start)
            todo &= ~found
        hit = torch.nonzero(start >= 0).flatten()
        if len(hit) == 0:
            return out
        # Draft j of a row is its token at start + (j mod period), period = lens - start: the
        # known followers, then the same again for the drafts past the end.
        s, period = start[hit], lens[hit] - start[hit]
        idx = s.unsqueeze(1) + torch.arange(self.k).unsqueeze(0) % period.unsqueeze(1)
        drafts = toks[hit].gather(1, idx).tolist()
        for i, draft in zip(hit.tolist(), drafts):
            out[i] = draft
        return out
