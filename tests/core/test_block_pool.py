"""BlockPool against a reference model: LRU eviction in the order blocks were freed, cached
blocks reclaimable until evicted, a block some request holds never handed out, and the blocks
of one allocation handed out in ascending ids."""

from __future__ import annotations

import random

import pytest

from keel.core.kv_cache_manager import BlockPool


class ReferencePool:
    """The pool's contract in the plainest terms: a list for the free order, a dict of
    reference counts, a dict for the cache."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))  # front: evicted first
        self.ref = dict.fromkeys(range(n), 0)
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}

    def get_new_blocks(self, k: int) -> list[int]:
        taken, self.free = sorted(self.free[:k]), self.free[k:]
        for b in taken:
            h = self.hash_of.pop(b, None)
            if h is not None:
                del self.block_of[h]
            self.ref[b] = 1
        return taken

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1

    def free_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)

    def cache_block(self, b: int, h: bytes) -> None:
        if b not in self.hash_of and h not in self.block_of:
            self.hash_of[b], self.block_of[h] = h, b


@pytest.mark.parametrize("seed", range(5))
def test_block_pool_matches_reference_over_random_operations(seed):
    rng = random.Random(seed)
    n = 24
    pool, ref = BlockPool(n), ReferencePool(n)
    held: list[list[int]] = []  # each "request"'s blocks (one reference each)
    hashes = [bytes([i]) * 32 for i in range(40)]
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and ref.free:
            k = rng.randint(1, min(4, len(ref.free)))
            got = [b.block_id for b in pool.get_new_blocks(k)]
            assert got == ref.get_new_blocks(k)
            assert all(b not in {x for req in held for x in req} for b in got)
            held.append(got)
        elif op < 0.6 and held:
            req = held.pop(rng.randrange(len(held)))
            order = list(reversed(req))  # as KVCacheManager.free does
            pool.free_blocks([pool.blocks[b] for b in order])
            ref.free_blocks(order)
        elif op < 0.8 and ref.block_of:
            # A new request hits some cached blocks (held or free).
            hit = rng.sample(sorted(ref.block_of.values()), rng.randint(1, min(3, len(
                ref.block_of))))
            for b in hit:
                assert pool.get_cached_block(ref.hash_of[b]) is pool.blocks[b]
            pool.touch([pool.blocks[b] for b in hit])
            ref.touch(hit)
            held.append(hit)
        elif held:
            req = rng.choice(held)
            b, h = rng.choice(req), rng.choice(hashes)
            pool.cache_block(pool.blocks[b], h)
            ref.cache_block(b, h)
        # The whole state agrees after every operation.
        assert list(pool.free_block_queue) == ref.free
        assert {b.block_id: b.ref_cnt for b in pool.blocks} == ref.ref
        assert {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()} == ref.block_of
        assert all(pool.blocks[b].block_hash == h for b, h in ref.hash_of.items())


def test_reset_only_when_nothing_is_held():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h" * 32)
    assert not pool.reset_prefix_cache()  # held
    pool.free_blocks([b])
    assert pool.get_cached_block(b"h" * 32) is b  # free but still cached
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h" * 32) is None and b.block_hash is None


def test_getting_more_blocks_than_free_raises():
    with pytest.raises(ValueError, match="cannot get 5 free blocks"):
        BlockPool(4).get_new_blocks(5)


def test_a_request_freed_in_reverse_comes_back_ascending():
    """KVCacheManager frees a request's blocks tail first; the next request that takes them
    gets them in ascending ids, so its consecutive blocks are consecutive in memory."""
    pool = BlockPool(8)
    first = pool.get_new_blocks(6)
    assert [b.block_id for b in first] == [0, 1, 2, 3, 4, 5]
    pool.free_blocks(list(reversed(first)))
    assert [b.block_id for b in pool.get_new_blocks(2)] == [6, 7]  # the queue's front first
    assert [b.block_id for b in pool.get_new_blocks(6)] == [0, 1, 2, 3, 4, 5]  # not 5, 4, ...
