from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class TokenHistory:
    """References to the persistent batch's token state (updated in place every pass), so the
    metadata stays valid while membership does: row r holds prompt ids at [0, num_prompt_tokens)
    and output ids at [num_prompt_tokens, num_tokens)."""

    token_ids_cpu_tensor: torch.Tensor  # [max_num_reqs, max_model_len] int32
    num_tokens: np.ndarray  # [max_num_reqs] int32
    num_prompt_tokens: np.ndarray  # [max_num_reqs] int32


@dataclass(slots=True)
class Penalties:
    rows: torch.Tensor  # [k] int64: the rows with any penalty
    rows_np: np.ndarray  # the same rows, for the token-history lookups
    presence: torch.Tensor  # [k] float32
    frequency: torch.Tensor  # [k] float32
    repetition: torch.Tensor  # [k] float32


@dataclass(slots=True)
class MinTokens:
    """Rows that must not stop before `min_tokens` outputs: while a row is short of its minimum,
    its stop ids (EOS and stop_token_ids) are masked. Pairs are flattened over the rows."""

    rows_np: np.ndarray  # [k] int64
    min_tokens: np.ndarray  # [k] int64
    pair_row_pos: np.ndarray  # [p] index into rows_np
    pair_token_ids: np.ndarray  # [p] int64


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of the settled batch. A feature nobody in the batch uses is
    None (or empty), so the sampler skips it without a per-row branch: an all-greedy batch with
    no processing costs one argmax."""

    temperature: torch.Tensor | None  # [num_reqs] float32; None when every row is greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [num_reqs]
    top_k: torch.Tensor | None  # [num_reqs] int64, 0 = disabled
    generators: dict[int, torch.Generator]  # row -> seeded generator
    min_p: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [k], min_p [k])
    penalties: Penalties | None = None
    # logits[rows, token_ids] += values, for every (row, token) with a bias
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows [k], mask [k, vocab] True where the token is NOT allowed)
    allowed_token_ids_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    bad_words_token_ids: dict[int, list[list[int]]] | None = None  # row -> token sequences
    min_tokens: MinTokens | None = None
    max_num_logprobs: int | None = None  # top-k logprobs to return; None: nobody asked
    logprobs_rows: torch.Tensor | None = None  # [k] rows that asked; None: all rows (or none)
    history: TokenHistory | None = None  # set when penalties, bad words or min_tokens need it

    @property
    def no_processing(self) -> bool:
        """True when no row changes its logits before sampling."""
        return (self.penalties is None and self.logit_bias is None
                and self.allowed_token_ids_mask is None and self.bad_words_token_ids is None
                and self.min_tokens is None)
