"""The forward context: how attention layers get paging metadata without it being an argument.

The runner does `with set_forward_context(attn_metadata): model(input_ids, positions)`; each
attention layer calls `get_forward_context()` to read it. The context exists only for the
duration of that `with` block, so a stale batch's metadata can never leak into the next pass.
It is per thread: an engine whose passes run on a worker thread (async scheduling) and another
engine in the same process never see each other's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: Any  # PagedAttentionMetadata, or None for a run without KV cache
    # The only rows of the model's output anyone reads (the runner's logits_indices), or None
    # for all. A model that honours it (`supports_output_rows`) returns just these rows, in
    # this order, and may skip the work of its last layer for every other token.
    output_rows: Any = None


_local = threading.local()


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError(
            "No forward context: run the model inside `with set_forward_context(metadata):`."
        )
    return context


@contextmanager
def set_forward_context(attn_metadata: Any, output_rows: Any = None
                        ) -> Iterator[ForwardContext]:
    prev = getattr(_local, "context", None)
    _local.context = ForwardContext(attn_metadata, output_rows)
    try:
        yield _local.context
    finally:
        _local.context = prev
