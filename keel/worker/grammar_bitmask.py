"""The runner's side of structured outputs: put each constrained request's bitmask row on the
logits row the request has in this pass's batch."""

from __future__ import annotations

import torch

from keel.core.sched_output import GrammarOutput


class BatchGrammarBitmask:
    """A [max_num_reqs, ceil(vocab / 32)] buffer, made on first use and overwritten after."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.max_num_reqs, self.device = max_num_reqs, device
        self.buffer: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, grammar_output: GrammarOutput,
              req_id_to_index: dict[str, int], num_reqs: int) -> None:
        """The scheduler's bitmask rows follow its request ids; the batch's rows may have moved
        since (condense, reorder), so each id is looked up in req_id_to_index and its row
        copied into the batch-ordered buffer, then xgrammar masks those logits rows."""
        import xgrammar as xgr

        bitmask = grammar_output.grammar_bitmask
        if self.buffer is None or self.buffer.shape[1] != bitmask.shape[1]:
            self.buffer = torch.full((self.max_num_reqs, bitmask.shape[1]), -1,
                                     dtype=torch.int32, device=self.device)
        rows = [req_id_to_index[r] for r in grammar_output.structured_output_request_ids]
        batch_bitmask = self.buffer[:num_reqs]
        batch_bitmask[rows] = bitmask.to(self.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, batch_bitmask, indices=rows,
                                        vocab_size=logits.shape[1])
