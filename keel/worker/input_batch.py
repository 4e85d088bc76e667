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

from keel.pooling_params import PoolingParams
from keel.sample.metadata import MinTokens, Penalties, SamplingMetadata, TokenHistory
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
    # Prompt positions whose logprobs were already returned (a preempted request recomputes
    # its prompt; it must not send them twice).
    num_prompt_logprobs_done: int = 0
    # Async scheduling with drafts: the drafts this runner proposed after the request's last
    # pass; the scheduler planned placeholders for them.
    spec_token_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None  # a pooling request's, else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
        block_size: int, device: torch.device, vocab_size: int | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.vocab_size = vocab_size
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
        self.min_p = CpuGpuBuffer(max_num_reqs, dtype=torch.float32, device=device)
        self.presence_penalties = CpuGpuBuffer(max_num_reqs, dtype=torch.float32, device=device)
        self.frequency_penalties = CpuGpuBuffer(max_num_reqs, dtype=torch.float32, device=device)
        self.repetition_penalties = CpuGpuBuffer(max_num_reqs, dtype=torch.float32,
                                                 device=device)
        # The per-row scalars, moved together by condense() and swap_states().
        self._row_arrays = (
            self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu,
            self.temperature.np, self.top_p.np, self.top_k.np, self.min_p.np,
            self.presence_penalties.np, self.frequency_penalties.np, self.repetition_penalties.np,
        )
        self.greedy_reqs: set[str] = set()
        self.random_reqs: set[str] = set()
        self.top_p_reqs: set[str] = set()
        self.top_k_reqs: set[str] = set()
        self.min_p_reqs: set[str] = set()
        self.penalty_reqs: set[str] = set()
        # Requests with a grammar: their logits get its bitmask in sample_tokens.
        self.structured_reqs: set[str] = set()
        self._feature_sets = (self.greedy_reqs, self.random_reqs, self.top_p_reqs,
                              self.top_k_reqs, self.min_p_reqs, self.penalty_reqs,
                              self.structured_reqs)

        # Sparse per-row state, keyed by row (only rows that use the feature have an entry).
        self.generators: dict[int, torch.Generator] = {}  # per-request seeded generator
        self.logit_bias: dict[int, dict[int, float]] = {}
        self.allowed_token_ids: dict[int, list[int]] = {}
        self.bad_words_token_ids: dict[int, list[list[int]]] = {}
        self.min_tokens: dict[int, tuple[int, set[int]]] = {}  # row -> (min, stop ids)
        self._row_dicts = (self.generators, self.logit_bias, self.allowed_token_ids,
                           self.bad_words_token_ids, self.min_tokens)
        # Keyed by req_id: these do not depend on the row.
        self.num_logprobs: dict[str, int] = {}
        self.num_prompt_logprobs: dict[str, int] = {}
        # [max_num_reqs, vocab] bool, True = not allowed; made on first use.
        self._allowed_mask: torch.Tensor | None = None
        self.sampling_metadata: SamplingMetadata | None = None
        # Tracing (keel/trace/): a list while a pass is recorded, else None.
        self.moves: list[tuple[str, int, int]] | None = None

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
        self.min_p.np[req_index] = sp.min_p
        if sp.min_p > 0.0:
            self.min_p_reqs.add(req_id)
        self.presence_penalties.np[req_index] = sp.presence_penalty
        self.frequency_penalties.np[req_index] = sp.frequency_penalty
        self.repetition_penalties.np[req_index] = sp.repetition_penalty
        if sp.has_penalties:
            self.penalty_reqs.add(req_id)
        if sp.structured_outputs is not None:
            self.structured_reqs.add(req_id)
        if request.generator is not None:
            self.generators[req_index] = request.generator
        if sp.logit_bias:
            self.logit_bias[req_index] = sp.logit_bias
        if sp.allowed_token_ids is not None:
            self.allowed_token_ids[req_index] = sp.allowed_token_ids
        if sp.bad_words_token_ids:
            self.bad_words_token_ids[req_index] = sp.bad_words_token_ids
        if sp.min_tokens > 0 and sp.all_stop_token_ids:
            self.min_tokens[req_index] = (sp.min_tokens, sp.all_stop_token_ids)
        if sp.logprobs is not None:
            self.num_logprobs[req_id] = sp.logprobs
        if sp.prompt_logprobs is not None and request.num_prompt_logprobs_done < n_prompt - 1:
            self.num_prompt_logprobs[req_id] = sp.prompt_logprobs
        self.sampling_metadata = None  # membership changed: rebuilt in refresh_metadata
        return req_index

    def remove_request(self, req_id: str) -> int | None:
        req_index = self.req_id_to_index.pop(req_id, None)
        if req_index is None:
            return None
        self.req_ids[req_index] = None
        heapq.heappush(self._free_rows, req_index)
        for s in self._feature_sets:
            s.discard(req_id)
        for d in self._row_dicts:
            d.pop(req_index, None)
        self.num_logprobs.pop(req_id, None)
        self.num_prompt_logprobs.pop(req_id, None)
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
        for arr in self._row_arrays:
            arr[tgt] = arr[src]
        self.block_table.move_row(src, tgt)
        for d in self._row_dicts:
            if src in d:
                d[tgt] = d.pop(src)
        self.req_ids[tgt], self.req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = tgt
        self.sampling_metadata = None
        if self.moves is not None:
            self.moves.append((req_id, src, tgt))

    def swap_states(self, a: int, b: int) -> None:
        """Exchange two rows (used by a backend that wants its own order)."""
        ra, rb = self.req_ids[a], self.req_ids[b]
        na, nb = self.num_tokens[a], self.num_tokens[b]
        rows = self.token_ids_cpu[[a, b], : max(na, nb)].copy()
        self.token_ids_cpu[a, :nb], self.token_ids_cpu[b, :na] = rows[1, :nb], rows[0, :na]
        for arr in self._row_arrays:
            arr[[a, b]] = arr[[b, a]]
        self.block_table.swap_row(a, b)
        for d in self._row_dicts:
            va, vb = d.pop(a, None), d.pop(b, None)
            if va is not None:
                d[b] = va
            if vb is not None:
                d[a] = vb
        self.req_ids[a], self.req_ids[b] = rb, ra
        self.req_id_to_index[rb], self.req_id_to_index[ra] = a, b
        self.sampling_metadata = None

    # ---- per-pass metadata ------------------------------------------------------------------

    def refresh_metadata(self) -> None:
        """Push the settled arrangement's sampling parameters to the device. Rebuilt only when
        membership or order changed since the last pass; a steady decode batch reuses it.
        Each feature is built from its own request set or row dict, so one nobody uses is None
        and costs nothing."""
        if self.sampling_metadata is not None:
            return
        n = self.num_reqs
        all_greedy = len(self.random_reqs) == 0
        meta = SamplingMetadata(
            temperature=None if all_greedy else self.temperature.copy_to_gpu(n),
            all_greedy=all_greedy,
            all_random=len(self.greedy_reqs) == 0,
            top_p=None if not self.top_p_reqs else self.top_p.copy_to_gpu(n),
            top_k=None if not self.top_k_reqs else self.top_k.copy_to_gpu(n),
            generators=dict(self.generators),
            max_num_logprobs=max(self.num_logprobs.values()) if self.num_logprobs else None,
        )
        if self.min_p_reqs:
            rows = self._rows_of(self.min_p_reqs)
            meta.min_p = (rows, self.min_p.copy_to_gpu(n)[rows])
        if self.num_logprobs and len(self.num_logprobs) < n:  # else: every row
            meta.logprobs_rows = self._rows_of(self.num_logprobs)
        if self.penalty_reqs:
            rows = self._rows_of(self.penalty_reqs)
            rows_np = rows.cpu().numpy()
            meta.penalties = Penalties(
                rows=rows, rows_np=rows_np,
                presence=self.presence_penalties.copy_to_gpu(n)[rows],
                frequency=self.frequency_penalties.copy_to_gpu(n)[rows],
                repetition=self.repetition_penalties.copy_to_gpu(n)[rows],
            )
        if self.logit_bias:
            rows_l, ids, vals = [], [], []
            for row in sorted(self.logit_bias):
                bias = self.logit_bias[row]
                rows_l += [row] * len(bias)
                ids += bias.keys()
                vals += bias.values()
            meta.logit_bias = (torch.tensor(rows_l, device=self.device),
                               torch.tensor(ids, device=self.device),
                               torch.tensor(vals, dtype=torch.float32, device=self.device))
        if self.allowed_token_ids:
            assert self.vocab_size is not None, "allowed_token_ids needs the vocabulary size"
            if self._allowed_mask is None:
                self._allowed_mask = torch.ones(self.max_num_reqs, self.vocab_size,
                                                dtype=torch.bool, device=self.device)
            rows = sorted(self.allowed_token_ids)
            mask = self._allowed_mask[: len(rows)]
            mask.fill_(True)
            for i, row in enumerate(rows):
                mask[i, self.allowed_token_ids[row]] = False
            meta.allowed_token_ids_mask = (torch.tensor(rows, device=self.device), mask)
        if self.bad_words_token_ids:
            meta.bad_words_token_ids = dict(self.bad_words_token_ids)
        if self.min_tokens:
            rows = sorted(self.min_tokens)
            pair_pos, pair_ids = [], []
            for i, row in enumerate(rows):
                stop_ids = self.min_tokens[row][1]
                pair_pos += [i] * len(stop_ids)
                pair_ids += stop_ids
            meta.min_tokens = MinTokens(
                rows_np=np.array(rows, dtype=np.int64),
                min_tokens=np.array([self.min_tokens[r][0] for r in rows], dtype=np.int64),
                pair_row_pos=np.array(pair_pos, dtype=np.int64),
                pair_token_ids=np.array(pair_ids, dtype=np.int64),
            )
        if meta.penalties or meta.bad_words_token_ids or meta.min_tokens:
            meta.history = TokenHistory(self.token_ids_cpu_tensor, self.num_tokens,
                                        self.num_prompt_tokens)
        self.sampling_metadata = meta

    def _rows_of(self, req_ids) -> torch.Tensor:
        """The sorted rows of these requests, on the device."""
        rows = sorted(self.req_id_to_index[r] for r in req_ids)
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def append_sampled_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Write this pass's sampled tokens into the kept rows (vectorised)."""
        pos = self.num_tokens[rows]
        self.token_ids_cpu[rows, pos] = token_ids
        self.num_tokens[rows] = pos + 1
