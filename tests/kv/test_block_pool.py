"""BlockPool / FreeBlockQueue: exact block ids, eviction order and reference counts."""

from __future__ import annotations

import pytest

from rackserve.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def key(n: int) -> tuple[str, bytes]:
    return ("g", bytes([n]))


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def queue_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_queue)


def test_free_queue_linked_operations():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks[:4])
    assert ids(q) == [0, 1, 2, 3] and q.num_free == 4
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3]
    q.remove(blocks[0])  # head
    q.remove(blocks[3])  # tail
    assert ids(q) == [1] and q.num_free == 1
    q.appendleft(blocks[4])
    q.append(blocks[0])
    assert ids(q) == [4, 1, 0]
    assert q.popleft() is blocks[4]
    assert ids(q) == [1, 0] and q.num_free == 2
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[3])
    q.popleft(), q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_null_block_never_handed_out_and_full_pool_returns_none():
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.num_free_blocks == 3
    first = pool.get_new_blocks(2)
    assert ids(first) == [1, 2] and all(b.ref_cnt == 1 for b in first)
    assert pool.get_new_blocks(2) is None  # only one left: nothing taken
    assert pool.num_free_blocks == 1
    assert ids(pool.get_new_blocks(1)) == [3]
    assert pool.get_new_blocks(1) is None
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.free([pool.null_block])
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1)


def test_cached_blocks_go_to_tail_transient_to_head_in_given_order():
    pool = BlockPool(8)
    a, b, c, d, e = pool.get_new_blocks(5)  # ids 1..5; free queue now [6, 7]
    assert pool.cache_block(a, key(1)) and pool.cache_block(c, key(3))
    pool.free([c, b, a, d])  # cached c, a -> tail (c first); transient b, d -> head (b first)
    assert queue_ids(pool) == [2, 4, 6, 7, 3, 1]
    # Reuse order: transient first, then never-used, then LRU cached (c evicted before a).
    assert ids(pool.get_new_blocks(4)) == [2, 4, 6, 7]
    assert pool.get_cached_block(key(3)) is c
    assert ids(pool.get_new_blocks(1)) == [3]
    assert pool.get_cached_block(key(3)) is None and c.block_hash is None  # evicted
    assert pool.get_cached_block(key(1)) is a
    pool.free([e])
    assert queue_ids(pool) == [5, 1]


def test_touch_takes_cached_block_out_of_free_queue():
    pool = BlockPool(5)
    x, y = pool.get_new_blocks(2)
    pool.cache_block(x, key(7))
    pool.free([x, y])
    assert queue_ids(pool) == [2, 3, 4, 1] and pool.num_free_blocks == 4
    hit = pool.get_cached_block(key(7))
    pool.touch([hit])
    assert hit.ref_cnt == 1 and queue_ids(pool) == [2, 3, 4]
    pool.touch([hit])  # a second request shares it
    assert hit.ref_cnt == 2
    pool.free([hit])
    assert hit.ref_cnt == 1 and queue_ids(pool) == [2, 3, 4]
    pool.free([hit])
    assert hit.ref_cnt == 0 and queue_ids(pool) == [2, 3, 4, 1]
    with pytest.raises(ValueError):
        pool.free([hit])


def test_duplicate_key_leaves_second_block_unregistered():
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    assert pool.cache_block(x, key(1))
    assert not pool.cache_block(y, key(1))
    assert y.block_hash is None and pool.get_cached_block(key(1)) is x
    assert not pool.cache_block(x, key(1))  # already registered: no change
    with pytest.raises(ValueError):
        pool.cache_block(x, key(2))
    pool.free([x, y])
    assert queue_ids(pool) == [2, 3, 1]  # the duplicate is transient: reused first
    assert pool.num_cached_blocks == 1


def test_uncache_free_block_demotes_to_head():
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    pool.cache_block(x, key(1))
    assert not pool.uncache_free_block(x)  # held: unchanged
    pool.free([x, y])
    assert queue_ids(pool) == [2, 3, 1]
    assert pool.uncache_free_block(x)
    assert queue_ids(pool) == [1, 2, 3] and pool.get_cached_block(key(1)) is None
    assert not pool.uncache_free_block(x)


def test_reset_prefix_cache_forgets_keys_but_keeps_blocks():
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    pool.cache_block(x, key(1))
    pool.cache_block(y, key(2))
    pool.free([x])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(key(1)) is None and x.block_hash is None
    assert y.ref_cnt == 1 and pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(1 / 3)
