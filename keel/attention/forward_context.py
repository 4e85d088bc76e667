"""The forward context: how attention layers get paging metadata without it being an argument.

The runner does `with set_forward_context(attn_metadata): model(input_ids, positions)`; each
attention layer calls `get_forward_context()` to read it. The context exists only for the
duration of that `with` block, so a stale batch's metadata can never leak into the next pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: Any  # PagedAttentionMetadata, or None for a run without KV cache


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError(
            "No forward context: run the model inside `with set_forward_context(metadata):`."
        )
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = prev
