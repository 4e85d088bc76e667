"""KV cache bookkeeping on the scheduler side: which blocks each request holds.

BlockPool hands out block ids from a free queue; KVCacheManager grows a request's block list
as its tokens grow and returns the blocks when it finishes or is preempted. The worker owns the
memory; this side only owns the ids."""

from __future__ import annotations

from collections import deque

from keel.request import Request


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_block_queue: deque[int] = deque(range(num_blocks))

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_new_blocks(self, n: int) -> list[int]:
        if n > len(self.free_block_queue):
            raise ValueError(f"cannot get {n} free blocks from the pool")
        q = self.free_block_queue
        return [q.popleft() for _ in range(n)]

    def free_blocks(self, block_ids: list[int]) -> None:
        self.free_block_queue.extend(block_ids)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`. Returns the newly allocated
        block ids (possibly empty), or None when the pool cannot cover them (nothing changes)."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
        missing = needed - len(blocks)
        if missing <= 0:
            return []
        if missing > self.block_pool.get_num_free_blocks():
            return None
        new_blocks = self.block_pool.get_new_blocks(missing)
        blocks.extend(new_blocks)
        return new_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def free(self, request: Request) -> None:
        self.block_pool.free_blocks(self.req_to_blocks.pop(request.request_id, []))
