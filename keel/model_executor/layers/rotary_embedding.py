"""Rotary position embedding, indexed by each token's own position (the flat batch has no
"sequence" axis). The inverse frequencies come from transformers' own RoPE functions, so every
`rope_type` they define for a config (default, linear, llama3, yarn, ...) means exactly what it
means there. Types whose frequencies depend on the running sequence length (dynamic,
longrope) are refused rather than silently approximated."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from keel.cpu_ops import cpu_ops_for

_UNSUPPORTED = {"dynamic", "longrope"}


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in _UNSUPPORTED:
        raise NotImplementedError(
            f"rope_type={rope_type!r} is not supported by keel yet (its frequencies change "
            "with sequence length); supported: default, linear, llama3, yarn."
        )
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"Unknown rope_type {rope_type!r} in config.json.")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin cache of [max_pos, rot_dim]."""

    def __init__(self, config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, head_dim)
        self.rot_dim = inv_freq.shape[0] * 2
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # float32 always: the cache is small, and low-precision angles drift at long positions.
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

        self.head_dim = head_dim
        self._cos_sin: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _cos_sin_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin caches in the model's dtype, converted once (the torch path converts
        the rows it gathers, with the same rounding)."""
        pair = self._cos_sin.get(dtype)
        if pair is None or pair[0].device != self.cos_cache.device:
            pair = (self.cos_cache.to(dtype), self.sin_cache.to(dtype))
            self._cos_sin[dtype] = pair
        return pair

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H * D]; k: [T, Hkv * D] (rows may be strided, e.g. views of
        a fused qkv output). Returns them rotated, same shapes; on the CPU kernels path q and
        k are rotated in place."""
        ops = cpu_ops_for(q)
        if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            cos, sin = self._cos_sin_in(q.dtype)
            ops.rotary_neox_(positions, q, k, cos, sin, self.head_dim)
            return q, k
        t, d = q.shape[0], self.head_dim
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)  # [T, 1, rot]
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        r = self.rot_dim

        def apply(x: torch.Tensor) -> torch.Tensor:
            x = x.reshape(t, -1, d)
            if r == d:
                out = x * cos + self._rotate_half(x) * sin
            else:
                rot, rest = x[..., :r], x[..., r:]
                out = torch.cat((rot * cos + self._rotate_half(rot) * sin, rest), dim=-1)
            return out.reshape(t, -1)

        return apply(q), apply(k)
