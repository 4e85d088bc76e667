"""KV cache bookkeeping on the scheduler side: which blocks each request holds, and which
full blocks hold a prefix that another request may reuse (automatic prefix caching).

BlockPool owns every `KVCacheBlock`: its reference count, its hash once it is full and
cached, and the free queue. The free queue is ordered for LRU eviction: a block whose last
holder let go goes to the back, `get_new_blocks` takes from the front, and a cached block is
only un-hashed (evicted) when it is taken. A free block that is still cached can be taken back
by a later request without recomputing it (`touch`) until then. A block a running request
references (ref_cnt > 0) is never in the free queue, so it is never handed out.

KVCacheManager grows a request's block list as its tokens grow, finds the longest cached
prefix of a new request (`get_computed_blocks`), caches the request's blocks as they fill, and
frees a request's blocks in reverse order, so that the tail of a sequence is evicted before its
head. The worker owns the memory; this side only owns the ids."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from keel.core.kv_cache_utils import BlockHash
from keel.request import Request


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix cache


def _block_id(block: KVCacheBlock) -> int:
    return block.block_id


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, least recently freed first.
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the front of the free queue, evicting any that were cached, in
        ascending id order: which blocks are taken is the queue's (LRU) choice, but a request's
        consecutive blocks then lie in ascending addresses where the ids allow. A request's
        blocks are freed in reverse order, so the queue hands a later request runs of
        descending ids. Decode attention read 64 rows' contexts from a bfloat16 cache in 0.85x
        the time in ascending blocks as in descending ones (float32: 0.97x; BENCHMARKS.md,
        thirty-fourth round)."""
        if n > len(self.free_block_queue):
            raise ValueError(f"cannot get {n} free blocks from the pool")
        out = []
        for _ in range(n):
            _, block = self.free_block_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if n > 1:
            out.sort(key=_block_id)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """A request takes cached blocks: out of the free queue if nobody held them."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks) -> None:
        """Release one reference to each block; those nobody holds join the back of the free
        queue in the order given (evicted in that order)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Make a full block findable by its hash (a block with the same content that is
        already cached stays the one found)."""
        if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only when no block is in use (False otherwise)."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size is None:  # a CacheConfig that EngineConfig has not resolved
            raise ValueError("block_size is unset: EngineConfig resolves it "
                             "(config.default_block_size), or name one.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up, cumulative
        self.prefix_cache_hits = 0  # of which found cached

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of the request's leading full blocks that is cached, and how many
        tokens it covers. At least one prompt token is always left to compute, so the request
        has a logit to sample from. Requests that want prompt logprobs compute everything."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one scheduled request's lookup (not every retry while blocks are short)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`, after taking the cache hits
        `new_computed_blocks` (covering `num_new_computed_tokens` tokens). Returns the ids of
        the newly allocated blocks (possibly empty), or None when the pool cannot cover them
        (nothing changes then)."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        missing = self.num_blocks_needed(total) - len(blocks) - len(new_computed_blocks)
        # Hits nobody holds are in the free queue: taking them uses up free blocks too.
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(missing, 0) > self.block_pool.get_num_free_blocks() - reclaimed:
            return None
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(missing) if missing > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Blocks that will be full once this step has computed its tokens. Another request
            # may hit them in this same step: attention writes a pass's K/V before reading.
            self._cache_full_blocks(request, min(total, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        start = self.num_cached_block.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        blocks = self.req_to_blocks[rid]
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_block[rid] = end

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (evicted before the head)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
