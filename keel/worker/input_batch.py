"""The persistent batch: one object that outlives the pass.

`ModelRunner._update_states` diffs it against each SchedulerOutput: remove what left, add what
arrived, update the rest in place. Rows are sized once for the largest batch (`max_num_reqs` x
`max_model_len` token ids); a decoding request costs one appended token per pass.

`req_id` is stable across passes; `req_index` (a row) is not: `condense()` moves the highest
rows down into the holes removals leave, and `_may_reorder_batch` may swap rows.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from keel.sample.metadata import SamplingMetadata
from keel.sampling_params import SamplingParams
from keel.worker.block_table import BlockTable
from keel.worker.buffers import CpuGpuBuffer


@dataclass(slots=True)
class CachedRequestState:
    """The runner's long-lived record of a request (`ModelRunner.requests[req_id]`)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
        block_size: int, device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        # Row -> req_id, None for a hole. After condense() it is exactly the batch, in row order
        # (len == num_reqs), so `for r in input_batch.req_ids` visits every request once.
        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self._free_rows: list[int] = []  # heap of holes in req_ids

        # [max_num_reqs, max_model_len]: each request's prompt + output ids, in its own row.
        self.token_ids_cpu_tensor = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        max_blocks = -(-max_model_len // block_size)
        self.block_table = BlockTable(
            max_num_reqs, max_blocks, max_num_batched_tokens, block_size, device
        )

        # Sampling parameters, one slot per row; per-feature request sets keep the sampler
        # from branching per row (`greedy_reqs` need no random numbers at all).
        self.temperature = CpuGpuBuffer(max_num_reqs, dtype=torch.float32, device=device)
        self.top_p = CpuGpuBuffer(max_num_reqs, dtype=torch.float32, device=device)
        self.top_k = CpuGpuBuffer(max_num_reqs, dtype=torch.int64, device=device)
        self.greedy_reqs: set[str] = set()
        self.random_reqs: set[str] = set()
        self.top_p_reqs: set[str] = set()
        self.top_k_reqs: set[str] = set()
        self.generators: dict[int, torch.Generator] = {}  # row -> per-request seeded generator
        self.sampling_metadata: SamplingMetadata | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    # ---- membership -------------------------------------------------------------------------

    def add_request(self, request: CachedRequestState) -> int:
        """Put the request in the lowest free row and fill that row from its cached state."""
        if self._free_rows:
            req_index = heapq.heappop(self._free_rows)
        else:
            req_index = len(self.req_ids)
            self.req_ids.append(None)
        assert req_index < self.max_num_reqs, "more requests than max_num_seqs"
        req_id = request.req_id
        self.req_ids[req_index] = req_id
        self.req_id_to_index[req_id] = req_index

        n_prompt, n_out = len(request.prompt_token_ids), len(request.output_token_ids)
        self.token_ids_cpu[req_index, :n_prompt] = request.prompt_token_ids
        self.token_ids_cpu[req_index, n_prompt : n_prompt + n_out] = request.output_token_ids
        self.num_tokens[req_index] = n_prompt + n_out
        self.num_prompt_tokens[req_index] = n_prompt
        self.num_computed_tokens_cpu[req_index] = request.num_computed_tokens
        self.block_table.add_row(request.block_ids[0], req_index)

        sp = request.sampling_params
        if sp.greedy:
            self.greedy_reqs.add(req_id)
            self.temperature.np[req_index] = 0.0
        else:
            self.random_reqs.add(req_id)
            self.temperature.np[req_index] = sp.temperature
        self.top_p.np[req_index] = sp.top_p
        if sp.top_p < 1.0:
            self.top_p_reqs.add(req_id)
        self.top_k.np[req_index] = sp.top_k
        if sp.top_k > 0:
            self.top_k_reqs.add(req_id)
        if request.generator is not None:
            self.generators[req_index] = request.generator
        self.sampling_metadata = None  # membership changed: rebuilt in refresh_metadata
        return req_index

    def remove_request(self, req_id: str) -> int | None:
        req_index = self.req_id_to_index.pop(req_id, None)
        if req_index is None:
            return None
        self.req_ids[req_index] = None
        heapq.heappush(self._free_rows, req_index)
        for s in (self.greedy_reqs, self.random_reqs, self.top_p_reqs, self.top_k_reqs):
            s.discard(req_id)
        self.generators.pop(req_index, None)
        self.sampling_metadata = None
        return req_index

    def condense(self) -> None:
        """Close the holes: move the highest used rows down into the lowest holes, so rows
        [0, num_reqs) are exactly the batch. Work is per hole, not per request."""
        num_reqs = self.num_reqs
        holes = sorted(i for i in self._free_rows if i < num_reqs)
        self._free_rows.clear()
        last = len(self.req_ids) - 1
        for hole in holes:
            while self.req_ids[last] is None:  # skip holes at the top
                last -= 1
            self._move_row(last, hole)
            last -= 1
        del self.req_ids[num_reqs:]

    def _move_row(self, src: int, tgt: int) -> None:
        req_id = self.req_ids[src]
        n = self.num_tokens[src]
        self.token_ids_cpu[tgt, :n] = self.token_ids_cpu[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu,
                    self.temperature.np, self.top_p.np, self.top_k.np):
            arr[tgt] = arr[src]
        self.block_table.move_row(src, tgt)
        if src in self.generators:
            self.generators[tgt] = self.generators.pop(src)
        self.req_ids[tgt], self.req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = tgt
        self.sampling_metadata = None

    def swap_states(self, a: int, b: int) -> None:
        """Exchange two rows (used by a backend that wants its own order)."""
        ra, rb = self.req_ids[a], self.req_ids[b]
        na, nb = self.num_tokens[a], self.num_tokens[b]
        rows = self.token_ids_cpu[[a, b], : max(na, nb)].copy()
        self.token_ids_cpu[a, :nb], self.token_ids_cpu[b, :na] = rows[1, :nb], rows[0, :na]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu,
                    self.temperature.np, self.top_p.np, self.top_k.np):
            arr[[a, b]] = arr[[b, a]]
        self.block_table.swap_row(a, b)
        ga, gb = self.generators.pop(a, None), self.generators.pop(b, None)
        if ga is not None:
            self.generators[b] = ga
        if gb is not None:
            self.generators[a] = gb
        self.req_ids[a], self.req_ids[b] = rb, ra
        self.req_id_to_index[rb], self.req_id_to_index[ra] = a, b
        self.sampling_metadata = None

    # ---- per-pass metadata ------------------------------------------------------------------

    def refresh_metadata(self) -> None:
        """Push the settled arrangement's sampling parameters to the device. Rebuilt only when
        membership or order changed since the last pass; a steady decode batch reuses it."""
        if self.sampling_metadata is not None:
            return
        n = self.num_reqs
        all_greedy = len(self.random_reqs) == 0
        self.sampling_metadata = SamplingMetadata(
            temperature=None if all_greedy else self.temperature.copy_to_gpu(n),
            all_greedy=all_greedy,
            all_random=len(self.greedy_reqs) == 0,
            top_p=None if not self.top_p_reqs else self.top_p.copy_to_gpu(n),
            top_k=None if not self.top_k_reqs else self.top_k.copy_to_gpu(n),
            generators=dict(self.generators),
        )

    def append_sampled_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Write this pass's sampled tokens into the kept rows (vectorised)."""
        pos = self.num_tokens[rows]
        self.token_ids_cpu[rows, pos] = token_ids
        self.num_tokens[rows] = pos + 1
