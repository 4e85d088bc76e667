"""ModelRunner: owns the persistent batch, the input buffers, and the call into the model.

One pass is two calls (the seed's steps 4-5; the second lives in keel/worker/sample_step.py):
  execute_model(scheduler_output)  _update_states (diff) -> _prepare_inputs (layout) ->
                                   attention metadata -> forward in set_forward_context ->
                                   logits of the rows at logits_indices -> park, return None
  sample_tokens(grammar_output)    unpark -> grammar bitmask onto the constrained rows ->
                                   sample -> drop rows still prefilling -> output
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from keel.attention import build_attention_metadata, set_forward_context
from keel.attention.backends.torch_paged import PagedAttentionMetadata
from keel.attention.layer import allocate_kv_caches
from keel.config import EngineConfig
from keel.core.sched_output import SchedulerOutput
from keel.model_executor.layers.pooler import Pooler
from keel.model_executor.loader import load_model
from keel.outputs import EMPTY_MODEL_RUNNER_OUTPUT, IntermediateTensors, ModelRunnerOutput
from keel.sample.sampler import Sampler
from keel.trace.recorder import RunnerTrace
from keel.worker.buffers import CpuGpuBuffer
from keel.worker.grammar_bitmask import BatchGrammarBitmask
from keel.worker.input_batch import CachedRequestState, InputBatch
from keel.worker.sample_step import ExecuteModelState, SampleTokensMixin, greedy_lm_head_allowed
from keel.worker.spec_decode import RunnerSpecDecode, calc_spec_decode_metadata

logger = logging.getLogger(__name__)


class ModelRunner(SampleTokensMixin):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        sc, cc = config.scheduler_config, config.cache_config
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_model_len = config.model_config.max_model_len
        self.block_size = cc.block_size
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []

        # The long-lived record (req_id -> state) and the per-pass working set.
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(
            self.max_num_reqs, self.max_model_len, self.max_num_tokens, self.block_size, device,
            vocab_size=config.model_config.vocab_size,
        )
        self.execute_model_state: ExecuteModelState | None = None
        self.sampler = Sampler(self.max_num_reqs)
        self.spec_decode = RunnerSpecDecode(config.speculative_config, self.max_num_reqs,
                                            sc.async_scheduling)

        # Buffers sized once for the largest pass; each pass overwrites a prefix.
        n_tok, n_req = self.max_num_tokens, self.max_num_reqs
        self.arange_np = np.arange(max(n_req + 1, n_tok), dtype=np.int64)
        self.input_ids = CpuGpuBuffer(n_tok, dtype=torch.int32, device=device)
        self.positions = CpuGpuBuffer(n_tok, dtype=torch.int64, device=device)
        self.query_pos = CpuGpuBuffer(n_tok, dtype=torch.int64, device=device)
        self.query_start_loc = CpuGpuBuffer(n_req + 1, dtype=torch.int32, device=device)
        self.seq_lens = CpuGpuBuffer(n_req, dtype=torch.int32, device=device)
        self.optimistic_seq_lens_cpu = torch.zeros(n_req, dtype=torch.int32)
        self.num_computed_np = np.zeros(n_req, dtype=np.int32)  # corrected, for the forward
        self.discard_request_mask = CpuGpuBuffer(n_req, dtype=torch.bool, device=device)
        self.num_scheduled_tokens_np = np.zeros(n_req, dtype=np.int32)
        self._prep_event = torch.cuda.Event() if device.type == "cuda" else None
        self._grammar_bitmask = BatchGrammarBitmask(self.max_num_reqs, device)
        self._greedy_lm_head = greedy_lm_head_allowed()  # sample_step.py
        # Tracing (keel/trace/recorder.py): None when off, and then each hook is one check.
        self.trace = RunnerTrace() if config.trace_path else None
        mc = config.model_config
        self.pooler = Pooler(mc.pooler_config) if mc.runner_type == "pooling" else None

    # ---- set-up -----------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = load_model(self.config.model_config)
        # A model whose LM head may take a greedy step's tokens itself (sample_step.py).
        self._greedy_lm_head &= hasattr(self.model, "greedy_token_ids")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc, cc = self.config.model_config, self.config.cache_config
        self.kv_caches = allocate_kv_caches(
            self.model, num_blocks, self.block_size, cc.kv_torch_dtype or mc.torch_dtype,
            self.device
        )

    # ---- step 2: the diff -------------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> Callable | None:
        """Diff the persistent batch against the scheduler's decision for this pass. Returns
        the deferred state corrections (async scheduling with drafts), else None."""
        # Finished: gone from both the long-lived record and the batch.
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in scheduler_output.finished_req_ids:
            self.input_batch.remove_request(req_id)

        # The persistent batch optimization assumes consecutive batches contain mostly the same
        # requests; with low overlap (alternating between two disjoint sets) it does a removal
        # and an insertion per request every pass. Unscheduled requests (preempted, or simply
        # not scheduled this pass) leave the batch but keep their state in self.requests:
        # they will be scheduled again sometime in the future.
        scheduled_req_ids = scheduler_output.num_scheduled_tokens.keys()
        cached_req_ids = self.input_batch.req_id_to_index.keys()
        resumed_req_ids = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        unscheduled_req_ids = cached_req_ids - (scheduled_req_ids - resumed_req_ids)
        for req_id in unscheduled_req_ids:
            self.input_batch.remove_request(req_id)

        reqs_to_add: list[CachedRequestState] = []
        for new_req_data in scheduler_output.scheduled_new_reqs:
            sp = new_req_data.sampling_params
            generator = None
            if sp.seed is not None and not sp.greedy:
                generator = torch.Generator(device=self.device).manual_seed(sp.seed)
            req_state = CachedRequestState(
                req_id=new_req_data.req_id,
                prompt_token_ids=new_req_data.prompt_token_ids,
                sampling_params=sp,
                generator=generator,
                # The scheduler sent its own copy of the ids: the runner may extend them.
                block_ids=new_req_data.block_ids,
                num_computed_tokens=new_req_data.num_computed_tokens,
                pooling_params=new_req_data.pooling_params,
            )
            self.requests[new_req_data.req_id] = req_state
            reqs_to_add.append(req_state)

        req_data = scheduler_output.scheduled_cached_reqs
        deferred: list[tuple[str, int, CachedRequestState]] = []
        for i, req_id in enumerate(req_data.req_ids):
            req_state = self.requests[req_id]
            num_computed_tokens = req_data.num_computed_tokens[i]
            new_block_ids = req_data.new_block_ids[i]
            if self.spec_decode.defer_corrections and req_id not in resumed_req_ids:
                # Optimistic: the scheduler counted every draft of this request's step still
                # in flight as accepted. The runner's record holds the real count (its own
                # last sample_tokens set it); the difference is corrected after the launch.
                correction = num_computed_tokens - req_state.num_computed_tokens
                if correction:
                    deferred.append((req_id, correction, req_state))
            req_state.num_computed_tokens = num_computed_tokens
            new_token_ids = req_data.new_token_ids[i]
            # Pipeline parallelism: a stage that does not sample learns the sampled tokens
            # from the scheduler (the tokens this pass computes; those it already holds are
            # skipped). On one rank the list is empty: the runner sampled them itself.
            num_new_tokens = 0
            if new_token_ids:
                num_new_tokens = num_computed_tokens + len(new_token_ids) - req_state.num_tokens
            if num_new_tokens > 0:
                new_token_ids = new_token_ids[-num_new_tokens:]
                req_state.output_token_ids.extend(new_token_ids)
            if req_id in resumed_req_ids:
                # Preempted requests lost their blocks: the ids arriving now are the whole
                # allocation, so they replace the old list instead of extending it.
                assert new_block_ids is not None
                req_state.block_ids = new_block_ids
            elif new_block_ids is not None:
                for block_ids, new_ids in zip(req_state.block_ids, new_block_ids):
                    block_ids.extend(new_ids)

            req_index = self.input_batch.req_id_to_index.get(req_id)
            if req_index is None:
                # Not in the batch (preempted earlier, or not scheduled last pass): re-add it
                # from its cached state, tokens and all.
                reqs_to_add.append(req_state)
                continue
            self.input_batch.num_computed_tokens_cpu[req_index] = num_computed_tokens
            if num_new_tokens > 0:
                start = self.input_batch.num_tokens[req_index]
                end = start + num_new_tokens
                self.input_batch.token_ids_cpu[req_index, start:end] = new_token_ids
                self.input_batch.num_tokens[req_index] = end
            if new_block_ids is not None:
                self.input_batch.block_table.append_row(new_block_ids[0], req_index)

        for request in reqs_to_add:
            self.input_batch.add_request(request)

        self.input_batch.condense()
        self._may_reorder_batch(scheduler_output)
        # Rows are final now: drafts go after each row's tokens (keel/worker/spec_decode.py).
        self.spec_decode.write_drafts(self.input_batch,
                                      scheduler_output.scheduled_spec_decode_tokens,
                                      self.requests)
        self.input_batch.refresh_metadata()
        # Without drafts in flight the runner already holds every token it needs: None.
        return self.spec_decode.deferred_corrections(self.input_batch,
                                                     self.optimistic_seq_lens_cpu, deferred)

    def _may_reorder_batch(self, scheduler_output: SchedulerOutput) -> None:
        """Let the attention backend reorder rows. The torch backend takes any order (it pads
        queries per request), so it keeps the condensed order; a backend that wants decodes
        grouped first would call `input_batch.swap_states` here."""
        return

    # ---- step 3: the layout -----------------------------------------------------------------

    def _get_cumsum_and_arange(
        self, num_tokens: np.ndarray, arange_out: np.ndarray
    ) -> np.ndarray:
        """E.g. num_tokens [2, 5, 3] -> cu_num_tokens [2, 7, 10],
        arange_out[:10] = [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]."""
        cu_num_tokens = np.cumsum(num_tokens)
        total = cu_num_tokens[-1]
        cumsums_offsets = np.repeat(cu_num_tokens - num_tokens, num_tokens)
        np.subtract(self.arange_np[:total], cumsums_offsets, out=arange_out[:total])
        return cu_num_tokens

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput, num_scheduled_tokens: np.ndarray
    ) -> tuple[torch.Tensor, Any]:
        # Less the draft placeholders this runner had no draft for (async scheduling).
        total_num_scheduled_tokens = (scheduler_output.total_num_scheduled_tokens
                                      - self.spec_decode.num_unused)
        num_reqs = self.input_batch.num_reqs
        self.input_batch.block_table.commit_block_table(num_reqs)

        # E.g. num_scheduled_tokens [2, 5, 3] -> req_indices [0,0,1,1,1,1,1,2,2,2]
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)
        cu_num_tokens = self._get_cumsum_and_arange(num_scheduled_tokens, self.query_pos.np)
        # The counts the forward pass runs on: the batch's, less the optimistic drafts of a
        # step that was in flight when this one was scheduled (async scheduling with drafts).
        num_computed = self.input_batch.num_computed_tokens_cpu[:num_reqs]
        if self.spec_decode.has_corrections:
            num_computed = np.subtract(num_computed, self.spec_decode.corrections_np[:num_reqs],
                                       out=self.num_computed_np[:num_reqs])
        positions_np = self.positions.np[:total_num_scheduled_tokens]
        np.add(num_computed[req_indices], self.query_pos.np[: cu_num_tokens[-1]],
               out=positions_np)
        # A request's token at position p lives at flat offset req_index * max_model_len + p.
        token_indices = positions_np + req_indices * self.input_batch.token_ids_cpu.shape[1]
        torch.index_select(
            self.input_batch.token_ids_cpu_tensor.flatten(),
            0,
            torch.from_numpy(token_indices),
            out=self.input_ids.cpu[:total_num_scheduled_tokens],
        )
        self.input_ids.copy_to_gpu(total_num_scheduled_tokens)
        self.positions.copy_to_gpu(total_num_scheduled_tokens)

        # query_start_loc [0, 2, 7, 10], padded to the end of its buffer with its last value so
        # it stays non-decreasing for kernels that read past num_reqs.
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        self.query_start_loc.np[num_reqs + 1 :].fill(cu_num_tokens[-1])
        self.query_start_loc.copy_to_gpu()
        query_start_loc = self.query_start_loc.gpu[: num_reqs + 1]

        # Optimistic: how long each sequence is once this pass finishes, if every draft is
        # accepted (and, with a correction pending, every draft of the previous pass too).
        seq_lens = self.optimistic_seq_lens_cpu.numpy()[:num_reqs]
        np.add(self.input_batch.num_computed_tokens_cpu[:num_reqs], num_scheduled_tokens,
               out=seq_lens)
        np.add(num_computed, num_scheduled_tokens, out=self.seq_lens.np[:num_reqs])
        self.seq_lens.copy_to_gpu(num_reqs)

        # Rows still prefilling after this pass are sampled "for simplicity" and then discarded.
        # input_batch.num_tokens[i] == self.requests[req_ids[i]].num_tokens (kept in step).
        # E.g. seq_lens [102, 5, 43] vs num_tokens [102, 600, 60] -> [False, True, True]
        np.less(seq_lens, self.input_batch.num_tokens[:num_reqs],
                out=self.discard_request_mask.np[:num_reqs])
        self.discard_request_mask.copy_to_gpu(num_reqs)

        self.input_batch.block_table.compute_slot_mapping(
            num_reqs, query_start_loc, self.positions.gpu[:total_num_scheduled_tokens],
            req_indices,
        )

        if self.spec_decode.has_drafts:
            # Every draft position and the bonus position (keel/worker/spec_decode.py).
            spec = calc_spec_decode_metadata(self.spec_decode.num_draft_np[:num_reqs],
                                             cu_num_tokens,
                                             self.input_ids.gpu[:total_num_scheduled_tokens])
            return spec.logits_indices, spec
        # [0, 2, 7, 10] -> [1, 6, 9]: the last token of each slice.
        logits_indices = query_start_loc[1:] - 1
        return logits_indices, None

    def _build_attention_metadata(
        self, num_reqs: int, num_tokens: int, max_query_len: int
    ) -> PagedAttentionMetadata:
        return build_attention_metadata(
            query_start_loc=self.query_start_loc.gpu[: num_reqs + 1],
            seq_lens=self.seq_lens.gpu[:num_reqs],
            block_table=self.input_batch.block_table.block_table.gpu[:num_reqs],
            slot_mapping=self.input_batch.block_table.slot_mapping.gpu[:num_tokens],
            block_size=self.block_size,
            max_query_len=max_query_len,
            max_seq_len=int(self.seq_lens.np[:num_reqs].max()),
        )

    @contextmanager
    def synchronize_input_prep(self) -> Iterator[None]:
        """Fence buffer reuse: the previous pass's async host->device copies may still read the
        CPU staging buffers. On CUDA wait on an event before prep and record one after; on the
        CPU there are no async copies and this costs nothing."""
        if self._prep_event is None:
            yield
            return
        self._prep_event.synchronize()
        try:
            yield
        finally:
            self._prep_event.record()

    # ---- step 4: the forward pass -----------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      intermediate_tensors: IntermediateTensors | None = None
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        """None when logits are parked for sample_tokens; on a pipeline stage before the last,
        the IntermediateTensors for the next stage (the worker sends them)."""
        if self.execute_model_state is not None:
            raise RuntimeError(
                "State error: sample_tokens() must be called after execute_model() returns None."
            )
        num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        trace = self.trace
        with self.synchronize_input_prep():
            if trace is not None:
                trace.begin(self)
            deferred_state_corrections_fn = self._update_states(scheduler_output)
            if trace is not None:
                trace.after_diff(self, scheduler_output)
            if not num_scheduled_tokens:
                # The diff ran: finished requests are cleaned.
                if trace is not None:
                    return dataclasses.replace(EMPTY_MODEL_RUNNER_OUTPUT, trace=trace.finish())
                return EMPTY_MODEL_RUNNER_OUTPUT

            num_reqs = self.input_batch.num_reqs
            nst = scheduler_output.num_scheduled_tokens
            num_scheduled_tokens_np = self.num_scheduled_tokens_np[:num_reqs]
            num_scheduled_tokens_np[:] = [nst[r] for r in self.input_batch.req_ids]
            if self.spec_decode.num_unused:  # placeholders without a draft are not computed
                num_scheduled_tokens_np -= self.spec_decode.num_unused_np[:num_reqs]
                num_scheduled_tokens -= self.spec_decode.num_unused
            logits_indices, spec_decode_metadata = self._prepare_inputs(
                scheduler_output, num_scheduled_tokens_np
            )
            if trace is not None:
                trace.after_prepare(self, num_scheduled_tokens_np, logits_indices)
            attn_metadata = self._build_attention_metadata(
                num_reqs, num_scheduled_tokens, int(num_scheduled_tokens_np.max())
            )
            input_ids = self.input_ids.gpu[:num_scheduled_tokens]
            positions = self.positions.gpu[:num_scheduled_tokens]

        # Only the sampled rows are read after the pass, unless a request wants its prompt's
        # logprobs (they read every row) or a pooler reads the hidden states: the model then
        # skips its last layer's projection and MLP for every other token (exact: each of
        # those is computed row by row).
        output_rows = None
        if (self.pooler is None and not self.input_batch.num_prompt_logprobs
                and getattr(self.model, "supports_output_rows", False)
                and logits_indices.shape[0] < num_scheduled_tokens):
            output_rows = logits_indices
        with set_forward_context(attn_metadata, output_rows):
            hidden_states = self.model(input_ids, positions, intermediate_tensors)
        if isinstance(hidden_states, IntermediateTensors):
            return hidden_states  # not the last stage: nothing to sample, nothing parked
        if self.pooler is not None:
            # A pooling model: the output is returned now, nothing is parked, and
            # EngineCore.step skips the second call (sample_tokens).
            return self._pool(hidden_states, num_reqs)

        # Only the rows that will be sampled are projected to the vocabulary; in a step that
        # only takes each row's argmax the LM head may take it itself, without the logits.
        sample_hidden_states = (hidden_states if output_rows is not None
                                else hidden_states[logits_indices])
        greedy = None
        if self._greedy_in_lm_head():
            greedy = self.model.greedy_token_ids(sample_hidden_states)
        logits = (None if greedy is not None
                  else self.model.compute_logits(sample_hidden_states, float32=False))
        if trace is not None:
            trace.after_forward()
        self.execute_model_state = ExecuteModelState(
            scheduler_output, logits, spec_decode_metadata, hidden_states, sample_hidden_states,
            greedy,
        )
        # Now the pass has been launched: apply the corrections from the previous pass.
        if deferred_state_corrections_fn is not None:
            deferred_state_corrections_fn()
        return None
