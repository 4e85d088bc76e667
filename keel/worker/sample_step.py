"""How a pass's output is made, after the forward pass: `ModelRunner.sample_tokens`, the
second call of a pass (the seed's step 5) with the grammar bitmask it applies, and, for a
pooling model, `ModelRunner._pool`, which `execute_model` returns directly (no second call).
A mixin of ModelRunner (keel/worker/model_runner.py), which holds the state these read: the
parked `execute_model_state` (an `ExecuteModelState`, defined here with the call that
unparks it), the persistent batch, the sampler, the pooler.

  sample_tokens(grammar_output)    unpark -> grammar bitmask onto the constrained rows ->
                                   sample -> drop rows still prefilling -> output

A step whose every row takes its argmax (greedy, no logits processors, no logprobs, no
grammar in the batch; with or without drafts, whose greedy rule only compares each draft with
its target's argmax) may have its tokens taken by the LM head itself, in its GEMM's
epilogue, without the [num_reqs, vocab] logits (`_greedy_in_lm_head`; the LM head decides
whether it can: ParallelLMHead.greedy_token_ids). The same tokens as the sampler's argmax of
those logits. `KEEL_GREEDY_LM_HEAD=0` turns it off.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import NamedTuple

import numpy as np
import torch

from keel.core.sched_output import GrammarOutput, SchedulerOutput
from keel.outputs import ModelRunnerOutput
from keel.sample.rejection_sampler import SpecDecodeMetadata, rejection_sample
from keel.sample.sampler import SamplerOutput
from keel.worker.prompt_logprobs import get_prompt_logprobs_dict
from keel.worker.spec_decode import append_token_lists


class ExecuteModelState(NamedTuple):
    """Ephemeral cached state transferred between execute_model() and sample_tokens(), after
    execute_model() returns None."""

    scheduler_output: SchedulerOutput
    # [num_reqs, vocab], the LM head's dtype (sample_tokens widens it); None where the LM head
    # took a greedy step's tokens itself (greedy_token_ids)
    logits: torch.Tensor | None
    spec_decode_metadata: SpecDecodeMetadata | None  # None: no drafts this pass
    hidden_states: torch.Tensor  # [num_tokens, hidden]; the logits rows only with output_rows
    sample_hidden_states: torch.Tensor  # [num_reqs, hidden]
    greedy_token_ids: torch.Tensor | None = None  # [num_reqs] int64 where logits is None


def greedy_lm_head_allowed() -> bool:
    mode = os.environ.get("KEEL_GREEDY_LM_HEAD", "1")
    if mode not in ("0", "1"):
        raise ValueError(f"KEEL_GREEDY_LM_HEAD must be 0 or 1, got {mode!r}.")
    return mode == "1"


class SampleTokensMixin:
    def _greedy_in_lm_head(self) -> bool:
        """Whether this step's sampling is each row's argmax of the logits and nothing else,
        so that the LM head may take the tokens itself (model.greedy_token_ids). With drafts
        too: the greedy rule accepts a draft while it equals the target's argmax, and the
        bonus token is its row's argmax (rejection_sampler.py)."""
        meta = self.input_batch.sampling_metadata
        return (meta.all_greedy and meta.no_processing and meta.max_num_logprobs is None
                and not self.input_batch.structured_reqs and self._greedy_lm_head)

    def _apply_grammar_bitmask(self, logits: torch.Tensor, grammar_output: GrammarOutput) -> None:
        """Mask the logits of the constrained rows (keel/worker/grammar_bitmask.py)."""
        batch = self.input_batch
        self._grammar_bitmask.apply(logits, grammar_output, batch.req_id_to_index,
                                    batch.num_reqs)

    # ---- step 5: the second call ------------------------------------------------------------

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None
                      ) -> ModelRunnerOutput | None:
        if self.execute_model_state is None:
            return None  # nothing parked (e.g. a rank that returned hidden states)
        sample_start = time.monotonic_ns() / 1000.0 if self.trace is not None else None
        state = self.execute_model_state
        self.execute_model_state = None
        spec = state.spec_decode_metadata
        logits = state.logits
        if logits is None and grammar_output is not None:
            # The scheduler sends a grammar only for a structured request, which keeps the LM
            # head from taking the tokens; should one come anyway, the logits are made here.
            logits = self.model.compute_logits(state.sample_hidden_states, float32=False)
        target_logits = target_argmax = None
        greedy_ids = state.greedy_token_ids
        if spec is not None and logits is not None:
            # One row per request for the Sampler (the bonus position: all a request without
            # drafts has); the draft targets go to the rejection sampler.
            target_logits = logits[spec.target_logits_indices]
            logits = logits[spec.bonus_logits_indices]
        elif spec is not None:  # the LM head's own argmax of every row, targets and bonus
            target_argmax = greedy_ids[spec.target_logits_indices]
            greedy_ids = greedy_ids[spec.bonus_logits_indices]
        batch = self.input_batch
        num_reqs = batch.num_reqs
        discard = self.discard_request_mask.np[:num_reqs]
        meta = batch.sampling_metadata
        if logits is not None and logits.dtype != torch.float32 and not (
                spec is None and grammar_output is None and meta.all_greedy
                and meta.no_processing and meta.max_num_logprobs is None):
            # Anything beyond a greedy argmax reads float32 logits (the argmax of bfloat16
            # logits is their float32 upcast's: the same tokens; a bfloat16 model's [64, 49152]
            # float32 copy was ~1 ms a step).
            logits = logits.float()
            if spec is not None:
                target_logits = target_logits.float()
        if grammar_output is not None:
            self._apply_grammar_bitmask(logits, grammar_output)
        if meta.generators and discard.any():
            # A seeded request's generator must only advance for tokens it keeps, or its
            # output would depend on how its prompt was chunked (or whether it was preempted).
            kept = {row: g for row, g in meta.generators.items() if not discard[row]}
            meta = dataclasses.replace(meta, generators=kept)
        if logits is None:  # the LM head's own argmax (execute_model)
            sampler_output = SamplerOutput(sampled_token_ids=greedy_ids, logprobs=None)
        else:
            sampler_output = self.sampler(logits, meta)
        kept_rows = np.flatnonzero(~discard)
        req_ids = batch.req_ids  # exactly the batch, in row order, after condense()
        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        if spec is None:
            sampled_np = sampler_output.sampled_token_ids.cpu().numpy()  # [num_reqs]
            kept_tokens = sampled_np[kept_rows]
            batch.append_sampled_tokens(kept_rows, kept_tokens)
            for row, token in zip(kept_rows.tolist(), kept_tokens.tolist()):
                self.requests[req_ids[row]].output_token_ids.append(token)
                sampled_token_ids[row] = [token]
        else:
            tokens, num_accepted = rejection_sample(target_logits, spec,
                                                    sampler_output.sampled_token_ids.cpu(), meta,
                                                    target_argmax)
            append_token_lists(batch, kept_rows, tokens)
            for row in kept_rows.tolist():
                self.requests[req_ids[row]].output_token_ids.extend(tokens[row])
                sampled_token_ids[row] = tokens[row]
            self.spec_decode.num_accepted = num_accepted
        # Drafts for the next step, from the updated rows (None without a drafter).
        spec_token_ids, num_draft_tokens = self.spec_decode.propose(
            batch, self.requests, kept_rows, self.num_scheduled_tokens_np, spec)
        prompt_logprobs_dict = {}
        if batch.num_prompt_logprobs:  # only requests that asked pay for this
            prompt_logprobs_dict = get_prompt_logprobs_dict(
                batch, self.requests, self.query_start_loc.np, self.num_scheduled_tokens_np,
                self.model.compute_logits, state.hidden_states,
            )
        return ModelRunnerOutput(
            req_ids=list(req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=sampled_token_ids,
            logprobs=sampler_output.logprobs,
            prompt_logprobs_dict=prompt_logprobs_dict,
            spec_token_ids=spec_token_ids,
            num_draft_tokens=num_draft_tokens,
            trace=None if self.trace is None else self.trace.finish(sampled_token_ids,
                                                                    sample_start),
        )

    def _pool(self, hidden_states: torch.Tensor, num_reqs: int) -> ModelRunnerOutput:
        """Pool each row whose prompt is complete after this pass (keel/model_executor/layers/
        pooler.py); rows still prefilling get None and go on next pass."""
        batch = self.input_batch
        finished = ~self.discard_request_mask.np[:num_reqs]
        default = self.pooler.config.normalize
        normalize = np.array([p.task == "embed" and (default if p.normalize is None
                                                     else p.normalize)
                              for p in (self.requests[r].pooling_params
                                        for r in batch.req_ids)], dtype=bool)
        pooled = self.pooler(hidden_states, self.query_start_loc.np[: num_reqs + 1], finished,
                             normalize)
        trace = None
        if self.trace is not None:
            self.trace.after_forward()
            trace = self.trace.finish()
        return ModelRunnerOutput(req_ids=list(batch.req_ids),
                                 req_id_to_index=dict(batch.req_id_to_index),
                                 sampled_token_ids=[[] for _ in range(num_reqs)],
                                 pooler_output=pooled, trace=trace)
