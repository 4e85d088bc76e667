"""Pooling: one vector per prompt from the hidden states of its tokens.

The pooling a folder declares (sentence-transformers' `modules.json`, `1_Pooling/config.json`
and a `Normalize` module) or, without one, vLLM's defaults: CLS for a BERT encoder, the last
token for a decoder (as Qwen3-Embedding uses), normalised. `Pooler` pools the rows of one pass
whose prompt is complete; it never loops over tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# sentence-transformers' Pooling config keys -> keel's pooling types
_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
          "pooling_mode_lasttoken": "LAST"}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # "CLS" | "MEAN" | "LAST"
    normalize: bool  # for task "embed"; "encode" never normalises
    source: str  # where the choice came from (for the start-up log)

    @property
    def needs_whole_prompt(self) -> bool:
        """CLS and MEAN read every prompt token's hidden state in one pass: no chunked
        prefill, no prefix caching. LAST reads one token: both work."""
        return self.pooling_type != "LAST"


def resolve_pooler_config(folder: Path, encoder_only: bool) -> PoolerConfig:
    modules_path = folder / "modules.json"
    if modules_path.is_file():
        try:
            modules = json.loads(modules_path.read_text())
            kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{modules_path} is not a sentence-transformers modules list: {e}"
                             ) from e
        pooling = kinds.get("Pooling")
        normalize = "Normalize" in kinds
        if pooling is not None:
            cfg_path = folder / pooling.get("path", "") / "config.json"
            try:
                cfg: dict[str, Any] = json.loads(cfg_path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"Cannot read the Pooling module's config {cfg_path}: {e}"
                                 ) from e
            chosen = [kind for key, kind in _MODES.items() if cfg.get(key)]
            odd = [key for key in _UNSUPPORTED if cfg.get(key)]
            if odd or len(chosen) != 1:
                raise NotImplementedError(
                    f"{cfg_path} asks for pooling {odd or chosen or 'none'}; keel pools with "
                    "exactly one of CLS, mean or last token.")
            return PoolerConfig(chosen[0], normalize, str(cfg_path))
    if encoder_only:
        return PoolerConfig("CLS", True, "default for an encoder")
    return PoolerConfig("LAST", True, "default for a decoder")


class Pooler:
    """pooled = pool(hidden [T, H]) over each row's slice of the flat token axis."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, query_start_loc: np.ndarray,
                 finished: np.ndarray, normalize: np.ndarray) -> list[torch.Tensor | None]:
        """query_start_loc [R + 1] (E.g. [0, 2, 7, 10]); finished [R] bool: the row's prompt
        is complete after this pass (the others get None); normalize [R] bool."""
        num_reqs = len(finished)
        qsl = torch.from_numpy(query_start_loc.astype(np.int64))
        kind = self.config.pooling_type
        if kind == "LAST":  # [0, 2, 7, 10] -> rows [1, 6, 9]
            pooled = hidden[qsl[1:] - 1].float()
        elif kind == "CLS":  # [0, 2, 7, 10] -> rows [0, 2, 7]
            pooled = hidden[qsl[:-1]].float()
        else:  # MEAN: [2, 5, 3] tokens -> req_indices [0,0,1,1,1,1,1,2,2,2], summed per row
            counts = qsl[1:] - qsl[:-1]
            req_indices = torch.repeat_interleave(torch.arange(num_reqs), counts)
            pooled = torch.zeros(num_reqs, hidden.shape[1], dtype=torch.float32,
                                 device=hidden.device)
            pooled.index_add_(0, req_indices.to(hidden.device), hidden.float())
            pooled /= counts.to(pooled)[:, None]
        if normalize.any():
            mask = torch.from_numpy(normalize).to(pooled.device)[:, None]
            pooled = torch.where(mask, F.normalize(pooled, p=2, dim=-1), pooled)
        pooled = pooled.cpu()
        return [pooled[i] if done else None for i, done in enumerate(finished.tolist())]
