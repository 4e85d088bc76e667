"""Prompt logprobs: the runner's one piece of per-request work after sampling, paid only by
the requests that asked for them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from keel.outputs import LogprobsLists
from keel.sample.sampler import gather_logprobs
from keel.worker.input_batch import CachedRequestState, InputBatch


def get_prompt_logprobs_dict(
    batch: InputBatch,
    requests: dict[str, CachedRequestState],
    query_start_loc_np: np.ndarray,
    num_scheduled_tokens_np: np.ndarray,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
) -> dict[str, LogprobsLists]:
    """Logprobs of the prompt tokens this pass computed, for the requests that asked.
    The hidden state at position p predicts token p + 1, so a chunk covering positions
    [start, start + n) yields logprobs for prompt tokens start + 1 .. start + n (never past
    the prompt). E.g. a 10-token prompt in chunks of 4: positions 0-3 -> tokens 1-4,
    4-7 -> 5-8, 8-9 -> token 9 only (position 9's logits pick the first output token).
    Every prompt row of these requests is projected to the vocabulary, not only the last:
    that is the cost. hidden_states: [num_tokens, hidden], the pass's flat token axis."""
    out: dict[str, LogprobsLists] = {}
    finished = []
    for req_id, num_top in batch.num_prompt_logprobs.items():
        row = batch.req_id_to_index[req_id]
        state = requests[req_id]
        start = int(batch.num_computed_tokens_cpu[row])  # the pass's first position
        num_prompt = len(state.prompt_token_ids)
        # A resumed request recomputes its prompt: skip what was already sent.
        first = max(start, state.num_prompt_logprobs_done)
        last = min(start + int(num_scheduled_tokens_np[row]), num_prompt - 1)
        if last <= first:
            continue
        offset = int(query_start_loc_np[row]) - start  # flat index of position 0
        logits = compute_logits(hidden_states[offset + first : offset + last])
        targets = torch.tensor(state.prompt_token_ids[first + 1 : last + 1],
                               device=logits.device)
        out[req_id] = gather_logprobs(logits.float().log_softmax(dim=-1), num_top, targets)
        state.num_prompt_logprobs_done = last
        if last == num_prompt - 1:
            finished.append(req_id)
    for req_id in finished:
        del batch.num_prompt_logprobs[req_id]
    return out
