"""The runner's side of speculative decoding: drafts into the persistent batch, the layout of
a pass that verifies them, and the sampled tokens (1..d+1 per request) back into the batch.

A request with d drafts schedules 1 + d tokens: its last real token and the drafts, which sit
in its token row just past `num_tokens` (they are not its tokens yet). The model scores all of
them; the logits of the last d + 1 positions are kept: d targets (one per draft) and the bonus
position. E.g. two requests, the first with drafts [7, 9] (3 scheduled tokens at 0..2), the
second a plain decode (1 token at 3): logits_indices [0, 1, 2, 3], target rows [0, 1], bonus
rows [2, 3], draft_token_ids [7, 9] (the tokens after positions 0 and 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from keel.config import SpeculativeConfig
from keel.sample.rejection_sampler import SpecDecodeMetadata
from keel.spec_decode.ngram_proposer import NgramProposer
from keel.worker.input_batch import CachedRequestState, InputBatch


def write_draft_tokens(batch: InputBatch, spec: dict[str, list[int]], num_draft: np.ndarray,
                       num_unused: np.ndarray, requests: dict | None = None) -> int:
    """Put each request's drafts after its tokens (num_tokens is unchanged) and their count
    in num_draft[row] (buffers made once). Called after condense: rows are final.

    With async scheduling the scheduler sends placeholders (-1), not drafts: each request's
    drafts are then the ones this runner proposed after its last pass (`requests[req_id].
    spec_token_ids`), at most as many as placeholders. Placeholders without a draft are not
    computed: num_unused[row] says how many, and the total is returned."""
    num_draft[: batch.num_reqs] = 0
    num_unused[: batch.num_reqs] = 0
    total_unused = 0
    for req_id, drafts in spec.items():
        row = batch.req_id_to_index[req_id]
        if requests is not None:
            planned = len(drafts)
            drafts = requests[req_id].spec_token_ids[:planned]
            num_unused[row] = planned - len(drafts)
            total_unused += planned - len(drafts)
        n = batch.num_tokens[row]
        batch.token_ids_cpu[row, n : n + len(drafts)] = drafts
        num_draft[row] = len(drafts)
    return total_unused


def calc_spec_decode_metadata(num_draft: np.ndarray, cu_num_scheduled: np.ndarray,
                              input_ids: torch.Tensor) -> SpecDecodeMetadata:
    """The rows to project and sample for a pass with drafts (see the module docstring)."""
    num_sampled = num_draft + 1
    cu_sampled = np.cumsum(num_sampled)
    total = int(cu_sampled[-1])
    within = np.arange(total) - np.repeat(cu_sampled - num_sampled, num_sampled)
    logits_indices = np.repeat(cu_num_scheduled - num_sampled, num_sampled) + within
    bonus = cu_sampled - 1
    is_target = np.ones(total, dtype=bool)
    is_target[bonus] = False
    target = np.flatnonzero(is_target)
    device = input_ids.device
    logits_indices_t = torch.from_numpy(logits_indices).to(device)
    target_t = torch.from_numpy(target).to(device)
    # Draft j is the input token right after target position j.
    draft_token_ids = input_ids[logits_indices_t[target_t] + 1].to(torch.int64)
    return SpecDecodeMetadata(
        draft_token_ids=draft_token_ids,
        num_draft_tokens=num_draft,
        target_logits_indices=target_t,
        bonus_logits_indices=torch.from_numpy(bonus).to(device),
        logits_indices=logits_indices_t,
    )


def append_token_lists(batch: InputBatch, rows: np.ndarray, tokens: list[list[int]]) -> None:
    """Write each kept row's accepted tokens into its token row (one slice per request)."""
    for row in rows.tolist():
        new = tokens[row]
        n = batch.num_tokens[row]
        batch.token_ids_cpu[row, n : n + len(new)] = new
        batch.num_tokens[row] = n + len(new)


class RunnerSpecDecode:
    """The runner's speculative decoding state: the drafter and per-row buffers made once.

    With async scheduling the scheduler plans step N+1 before it sees step N: it sends draft
    placeholders and counts every draft of step N as accepted. The runner (which took step N's
    calls first) fills the placeholders with its own drafts, runs the forward pass on the real
    counts (`corrections_np`, subtracted in `_prepare_inputs`) and, after launching it, takes
    the optimistic drafts out of its records (`correct_counts`: the seed's
    deferred_state_corrections_fn)."""

    def __init__(self, config: SpeculativeConfig | None, max_num_reqs: int,
                 async_scheduling: bool) -> None:
        self.drafter = None if config is None else NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_draft_np = np.zeros(max_num_reqs, dtype=np.int64)  # drafts per row
        self.num_unused_np = np.zeros(max_num_reqs, dtype=np.int32)  # placeholders left out
        self.num_unused = 0  # this pass, in all
        self.has_drafts = False  # this pass verifies at least one draft
        self.defer_corrections = async_scheduling and config is not None
        self.corrections_np = np.zeros(max_num_reqs, dtype=np.int32)  # optimistic - real
        self.has_corrections = False
        self.num_accepted: np.ndarray | None = None  # per row, from the rejection sampler

    def write_drafts(self, batch: InputBatch, scheduled: dict[str, list[int]],
                     requests: dict[str, CachedRequestState]) -> None:
        self.num_unused, self.has_drafts = 0, False
        if scheduled:
            self.num_unused = write_draft_tokens(
                batch, scheduled, self.num_draft_np, self.num_unused_np,
                requests if self.defer_corrections else None)
            self.has_drafts = bool(self.num_draft_np[: batch.num_reqs].any())

    def deferred_corrections(self, batch: InputBatch, optimistic_seq_lens: torch.Tensor,
                             deferred: list[tuple[str, int, CachedRequestState]]
                             ) -> Callable[[], None] | None:
        """After condense: each corrected request's row gets its correction; returns the
        deferred call (None when nothing is optimistic)."""
        self.has_corrections = bool(deferred)
        if not deferred:
            return None
        self.corrections_np[: batch.num_reqs] = 0
        for req_id, correction, _ in deferred:
            self.corrections_np[batch.req_id_to_index[req_id]] = correction
        return functools.partial(self.correct_counts, batch, optimistic_seq_lens, deferred)

    def correct_counts(self, batch: InputBatch, optimistic_seq_lens: torch.Tensor,
                       deferred: list[tuple[str, int, CachedRequestState]]) -> None:
        """Take the rejected drafts of the previous pass out of the long-lived record, the
        batch's counts and the optimistic lengths. On the CPU the accepted counts are known
        when the diff runs (the worker takes calls in order), so nothing waits here; on a
        device this is where the CPU would wait for them, with this pass launched."""
        for req_id, correction, req_state in deferred:
            req_state.num_computed_tokens -= correction
            row = batch.req_id_to_index.get(req_id)
            if row is not None:
                batch.num_computed_tokens_cpu[row] -= correction
                optimistic_seq_lens[row] -= correction
        self.has_corrections = False

    def propose(self, batch: InputBatch, requests: dict[str, CachedRequestState],
                kept_rows: np.ndarray, num_scheduled: np.ndarray,
                spec: SpecDecodeMetadata | None
                ) -> tuple[list[list[int]] | None, list[int] | None]:
        """After sampling: the drafts for the next step (for the scheduler), and with async
        scheduling the drafts verified per row (for its counters) instead. Returns
        (spec_token_ids, num_draft_tokens) for the ModelRunnerOutput.

        With async scheduling the runner keeps each request's drafts for the next pass, and
        its real count of computed tokens (the rejected drafts taken out), which the next
        diff compares with the scheduler's optimistic count."""
        if self.drafter is None:
            return None, None
        drafts = self.drafter.propose_for_batch(batch, kept_rows)
        if not self.defer_corrections:
            return drafts, None
        n = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:n] + num_scheduled[:n]
        if spec is not None:
            computed -= spec.num_draft_tokens - self.num_accepted
        for row, req_id in enumerate(batch.req_ids):
            req_state = requests[req_id]
            req_state.num_computed_tokens = int(computed[row])
            req_state.spec_token_ids = drafts[row]
        return None, (self.num_draft_np[:n].tolist() if spec is not None else [0] * n)
