from keel.attention.backends.torch_paged import (
    PagedAttentionMetadata,
    build_attention_metadata,
)
from keel.attention.forward_context import get_forward_context, set_forward_context
from keel.attention.layer import Attention

__all__ = [
    "Attention",
    "PagedAttentionMetadata",
    "build_attention_metadata",
    "get_forward_context",
    "set_forward_context",
]
