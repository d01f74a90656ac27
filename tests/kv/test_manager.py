"""KVCacheManager on two small groups, with exact block ids, offsets and reference counts.

Groups: ``swa`` (4-token pages, window 8) and ``kv`` (full history, 8-token blocks, ratio 2),
so A = 8 and G = 4.
"""

from __future__ import annotations

import pytest
from kv_sim import decode, make_request, prefill, start, step

from rackserve.kv.hashing import BlockHashChain, block_key
from rackserve.kv.manager import KVCacheManager, NewBlocks
from rackserve.kv.spec import CacheGroupSpec

SPECS = (
    CacheGroupSpec("swa", (0, 1), 4, 1, 8, 16, 2),
    CacheGroupSpec("kv", (0,), 8, 2, None, 32, 2),
)


def manager(num_swa: int = 16, num_kv: int = 16, **kwargs) -> KVCacheManager:
    return KVCacheManager(SPECS, {"swa": num_swa, "kv": num_kv}, **kwargs)


def queue_ids(m: KVCacheManager, group: int) -> list[int]:
    return [b.block_id for b in m.pools[group].free_queue]


def test_exact_ids_offsets_release_and_free_order():
    m = manager()
    a = make_request("a", list(range(20)))
    assert start(m, a)[0] == 0
    new = step(m, a, 20)  # computes [0, 20), commits, samples token 21
    assert new == NewBlocks((0, 0), ((1, 2, 3, 4, 5), (1, 2, 3)))
    # Window after 20 tokens: rows [13, 20) -> pages 3, 4. Page 2 ([8, 12)) holds rows of the
    # prompt checkpoint B = floor_8(20) = 16 (rows [9, 16)): cached, freed to the tail.
    # Pages 0 and 1 are transient: freed to the head, reused first.
    assert m.get_block_ids(a) == ([0, 0, 0, 4, 5], [1, 2, 3])
    assert queue_ids(m, 0) == [1, 2, *range(6, 16), 3]
    assert step(m, a, 1) == NewBlocks((5, 3), ((1,), ()))  # position 20 opens page 5
    step(m, a, 1)
    step(m, a, 1)
    step(m, a, 1)  # 24 computed: page 3 ([12, 16)) leaves the window, already cached
    assert queue_ids(m, 0) == [2, *range(6, 16), 3, 4]
    assert step(m, a, 1) == NewBlocks((6, 3), ((2,), (4,)))
    assert m.get_block_ids(a) == ([0, 0, 0, 0, 5, 1, 2], [1, 2, 3, 4])
    # Finish at 25 computed: the checkpoint B = 24 (rows [17, 24): pages 4, 5 = blocks 5, 1)
    # is hashed; each pool gets the table reversed (last blocks evicted first).
    m.free(a, 25)
    assert queue_ids(m, 0) == [2, *range(6, 16), 3, 4, 1, 5]
    assert queue_ids(m, 1) == [4, *range(5, 16), 3, 2, 1]
    assert m.get_block_ids(a) == ([], [])

    # The next turn hits at 24 and starts its table with nulls, the hit pages and new pages.
    b = make_request("b", [*a.all_token_ids, 900, 901, 902])  # 29 tokens
    num_hit, hit = start(m, b)
    assert num_hit == 24
    assert [[x.block_id for x in blocks] for blocks in hit.blocks] == [
        [0, 0, 0, 0, 5, 1],
        [1, 2, 3],
    ]
    new = m.allocate_slots(b, 5, 24, hit)
    assert new == NewBlocks((0, 0), ((0, 0, 0, 0, 5, 1, 2, 6), (1, 2, 3, 4)))
    assert [blk.ref_cnt for blk in hit.blocks[1]] == [1, 1, 1]
    stats = m.stats
    assert (stats.num_queries, stats.num_queried_tokens, stats.num_hit_tokens) == (2, 49, 24)
    assert stats.hit_rate == pytest.approx(24 / 49)


def test_window_keeps_exactly_the_rows_the_next_step_reads():
    m = manager(num_swa=32, num_kv=32)
    req = make_request("r", list(range(37)))
    start(m, req)
    for num_new in (5, 11, 1, 20, *([1] * 13)):
        step(m, req, num_new)
        computed = req.num_computed_tokens
        swa, kv = m.get_block_ids(req)
        live = [i for i, block_id in enumerate(swa) if block_id != 0]
        first = max(0, computed - 8 + 1) // 4  # rows [L-W+1, L)
        assert live == list(range(first, -(-computed // 4)))
        assert len(kv) == -(-computed // 8) and 0 not in kv


def test_two_requests_share_prefix_blocks_with_ref_counts():
    m = manager()
    x = make_request("x", list(range(20)))
    prefill(m, x)  # x keeps running; its prompt checkpoint (B=16) is cached at once
    y = make_request("y", [*range(20), 77])
    z = make_request("z", [*range(17), 66, 66])
    assert prefill(m, y) == 16 and prefill(m, z) == 16
    kv_x, kv_y, kv_z = (m.get_block_ids(r)[1] for r in (x, y, z))
    assert kv_x[:2] == kv_y[:2] == kv_z[:2] and len({kv_x[2], kv_y[2], kv_z[2]}) == 3
    shared = [m.pools[1].blocks[i] for i in kv_x[:2]]
    assert [blk.ref_cnt for blk in shared] == [3, 3]
    m.free(y, y.num_computed_tokens)
    m.free(x, x.num_computed_tokens)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    m.free(z, z.num_computed_tokens)
    assert [blk.ref_cnt for blk in shared] == [0, 0]
    assert m.num_free_blocks("swa") == 15 and m.num_free_blocks("kv") == 15
    assert m.usage == 0.0


def test_allocation_is_all_or_nothing():
    m = manager(num_swa=16, num_kv=4)  # 3 usable kv blocks: 24 tokens of history
    big = make_request("big", list(range(30)))
    start(m, big)
    assert m.allocate_slots(big, 30, 0) is None
    assert m.num_free_blocks("swa") == 15 and m.num_free_blocks("kv") == 3
    assert m.get_block_ids(big) == ([], [])
    assert m.allocate_slots(big, 24, 0) is not None  # a smaller chunk fits
    m.free(big)
    assert m.num_free_blocks("kv") == 3


def test_all_or_nothing_counts_hit_blocks_leaving_the_free_queue():
    m = manager(num_swa=16, num_kv=5)
    x = make_request("x", list(range(20)))
    prefill(m, x)
    m.free(x, 20)  # kv: [16, 24) transient at the head; [0, 8), [8, 16) cached at the tail
    y = make_request("y", [*range(20), *range(100, 120)])  # 40 tokens
    num_hit, hit = start(m, y)
    assert num_hit == 16
    # 5 kv blocks for [0, 40): 2 hit (free, so touching them uses 2 of the 4 free) + 3 new.
    assert m.allocate_slots(y, 24, 16, hit) is None
    assert [blk.ref_cnt for blk in hit.blocks[1]] == [0, 0] and m.num_free_blocks("kv") == 4
    assert m.stats.num_queries == 1  # a lookup is counted once the request is admitted
    assert m.get_computed_blocks(y)[0] == 16  # the scheduler retries next step
    new = m.allocate_slots(y, 8, 16, hit)
    assert new is not None and new.block_ids[1] == (1, 2, 3)
    assert m.num_free_blocks("kv") == 1
    assert (m.stats.num_queries, m.stats.num_queried_tokens, m.stats.num_hit_tokens) == (2, 60, 16)


def test_stale_hit_is_a_caller_bug():
    m = manager()
    x = make_request("x", list(range(20)))
    prefill(m, x)
    m.free(x, 20)
    y = make_request("y", list(range(20)))
    num_hit, hit = start(m, y)
    assert num_hit == 16
    m.pools[1].uncache_free_block(hit.blocks[1][0])  # evicted before allocate_slots
    with pytest.raises(RuntimeError, match="stale"):
        m.allocate_slots(y, 4, 16, hit)


def test_prefix_caching_disabled():
    m = manager(enable_prefix_caching=False)
    for name in ("x", "y"):
        req = make_request(name, list(range(20)))
        assert prefill(m, req) == 0
        decode(m, req, 6)
        m.free(req, req.num_computed_tokens)
    assert m.pools[0].num_cached_blocks == m.pools[1].num_cached_blocks == 0
    assert m.stats.num_queries == 0
    assert m.num_free_blocks("swa") == 15 and m.num_free_blocks("kv") == 15


def test_reset_prefix_cache_and_free_is_idempotent():
    m = manager()
    x = make_request("x", list(range(20)))
    prefill(m, x)
    m.free(x, 20)
    m.free(x)  # a second free (abort after finish) is a no-op
    m.reset_prefix_cache()
    assert prefill(m, make_request("y", list(range(20)))) == 0


def test_hit_keys_are_per_group_and_salted():
    m = manager()
    x = make_request("x", list(range(20)), cache_salt="alice")
    prefill(m, x)
    m.free(x, 20)
    assert prefill(m, make_request("bob", list(range(20)), cache_salt="bob")) == 0
    alice = make_request("alice2", list(range(20)), cache_salt="alice")
    num_hit, hit = m.get_computed_blocks(alice)
    assert num_hit == 16
    chain = BlockHashChain(m.granularity, "alice")
    chain.extend(alice.all_token_ids)
    assert hit.blocks[1][1].block_hash == block_key("kv", chain, 16)


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly the groups"):
        KVCacheManager(SPECS, {"swa": 4})
    with pytest.raises(ValueError, match="multiple of the prefix alignment 8"):
        manager(checkpoint_interval=12)
    with pytest.raises(ValueError, match="choose one of"):
        manager(hash_algo="md5")
    m = manager()
    req = make_request("r", list(range(10)))
    with pytest.raises(ValueError, match="must start at the hit"):
        m.allocate_slots(req, 4, 3)
    m.allocate_slots(req, 4, 0)
    with pytest.raises(ValueError, match="holds blocks"):
        m.get_computed_blocks(req)
    m.commit(req, 4)
    with pytest.raises(ValueError, match="went back"):
        m.commit(req, 2)
