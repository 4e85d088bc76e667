"""Block hashes for automatic prefix caching, as vLLM v1 computes them.

A full block's hash covers its parent block's hash, its token ids and its extra keys (none
yet: the field is there for LoRA ids or multimodal inputs), so equal hashes mean equal
prefixes up to and including the block. SHA-256 over a canonical byte string (the parent's 32
bytes, the token ids as little-endian int64, the extra keys' repr): a collision would need
SHA-256 to collide. Each hash is computed once per block and kept on the Request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from keel.request import Request

BlockHash = bytes  # 32 bytes

_NONE_HASH = b"\x00" * 32  # the parent of a request's first block


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    h = hashlib.sha256(parent or _NONE_HASH)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def update_block_hashes(request: Request, block_size: int) -> None:
    """Append the hashes of the request's blocks that became full since the last call."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) >= num_full:
        return
    prompt, output = request.prompt_token_ids, request.output_token_ids
    n_prompt = len(prompt)
    for i in range(len(hashes), num_full):
        start, end = i * block_size, (i + 1) * block_size
        if end <= n_prompt:
            tokens = prompt[start:end]
        else:
            tokens = prompt[start:end] + output[max(0, start - n_prompt) : end - n_prompt]
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens))
