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

import numpy as np
import torch

from keel.sample.rejection_sampler import SpecDecodeMetadata
from keel.worker.input_batch import InputBatch


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
