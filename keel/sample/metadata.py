from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of the settled batch. A feature nobody in the batch uses is
    None, so the sampler skips it without a per-row branch."""

    temperature: torch.Tensor | None  # [num_reqs] float32; None when every row is greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [num_reqs]
    top_k: torch.Tensor | None  # [num_reqs] int64, 0 = disabled
    generators: dict[int, torch.Generator]  # row -> seeded generator
