"""KVCacheManager on the tiny preset's groups: the prefix-hit rule and agent sessions.

Tiny preset: window 16; sliding pages of 8 tokens (swa, hca_state) and C4 state pages of 8
(window 8); full-history blocks of 32 tokens (csa_kv, hca_kv). So A = 32, G = 8.
"""

from __future__ import annotations

import itertools

import pytest
from kv_sim import decode, finish, make_request, prefill, run_turn

from rackserve.kv.hashing import BlockHashChain, block_key
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.spec import cache_groups_for
from rackserve.model.presets import tiny_config

SPECS = cache_groups_for(tiny_config())
SWA, CSA_STATE, HCA_STATE, CSA_KV, HCA_KV = range(5)
PROBE_IDS = itertools.count()


def manager(num_sliding: int = 64, num_full: int = 64, **kwargs) -> KVCacheManager:
    num_blocks = {s.name: num_sliding if s.is_sliding else num_full for s in SPECS}
    return KVCacheManager(SPECS, num_blocks, **kwargs)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 2 for i in range(n)]


def lookup(m: KVCacheManager, prompt: list[int]) -> int:
    """Hit length for a prompt, without allocating."""
    req = make_request(f"probe{next(PROBE_IDS)}", prompt)
    num_hit, _ = m.get_computed_blocks(req)
    m.free(req)
    return num_hit


def assert_all_free(m: KVCacheManager) -> None:
    for spec, pool in zip(m.specs, m.pools, strict=True):
        assert pool.num_free_blocks == pool.num_blocks - 1, spec.name


def test_hit_only_at_aligned_boundaries_below_prompt_end():
    m = manager()
    x = make_request("x", tokens(1, 75))  # prompt checkpoint at floor_32(75) = 64
    run_turn(m, x, num_output=1)
    prompt = x.all_token_ids[:75]
    assert lookup(m, [*prompt, 5, 6, 7]) == 64
    assert lookup(m, prompt[:65]) == 64  # 64 <= 65 - 1
    assert lookup(m, prompt[:64]) == 0  # would need the checkpoint at 32: never cached
    assert lookup(m, [*prompt[:50], 9, 9, 9, 9]) == 0
    assert lookup(m, tokens(2, 75)) == 0


def test_a_repeated_prompt_of_a_multiple_of_the_alignment_hits():
    """A lookup stops at floor_A(len - 1): one alignment below the end of a prompt of k * A
    tokens, where the prompt's own prefill also checkpoints."""
    m = manager()
    for n, expected in ((128, 96), (127, 96), (129, 128), (64, 32)):
        x = make_request(f"x{n}", tokens(n, n))
        run_turn(m, x, num_output=2)
        assert lookup(m, x.all_token_ids[:n]) == expected, n


def test_interval_checkpoints_of_a_long_chunked_prefill():
    for interval, expected in ((None, 0), (64, 128)):
        m = manager(checkpoint_interval=interval)
        x = make_request("x", tokens(3, 200))  # prompt end 192; intervals 64, 128, 192
        run_turn(m, x, num_output=3, chunk=48)
        assert lookup(m, [*x.all_token_ids[:150], 1, 1, 1]) == expected, interval
        assert lookup(m, [*x.all_token_ids[:200], 1]) == 192


def test_missing_checkpoint_or_history_falls_back():
    m = manager(checkpoint_interval=32)
    x = make_request("x", tokens(4, 100))  # checkpoints at 32, 64, 96
    run_turn(m, x, num_output=1)
    chain = BlockHashChain(m.granularity)  # the same hashes as x's
    chain.extend(x.all_token_ids)
    prompt = [*x.all_token_ids[:100], 3, 3]

    def evict(group: int, end: int) -> None:
        block = m.pools[group].get_cached_block(block_key(SPECS[group].name, chain, end))
        assert m.pools[group].uncache_free_block(block)

    assert lookup(m, prompt) == 96
    evict(CSA_STATE, 96)  # one page of one group's checkpoint at 96 is gone
    assert lookup(m, prompt) == 64
    evict(CSA_KV, 64)  # history block [32, 64) gone: the checkpoint at 64 is useless
    assert lookup(m, prompt) == 32
    evict(SWA, 32)  # rows [17, 24) of the last checkpoint
    assert lookup(m, prompt) == 0


def test_multi_turn_agent_session_hits_end_of_previous_output():
    m = manager()
    turn = make_request("t1", tokens(5, 70))
    assert run_turn(m, turn, num_output=40, chunk=16) == 0
    hits = []
    for k, (num_new_text, num_output) in enumerate(((20, 30), (15, 12), (40, 5))):
        # Turn k+1 prompt = turn k prompt + output + new text (a tool result).
        computed = turn.num_computed_tokens
        turn = make_request(f"t{k + 2}", [*turn.all_token_ids, *tokens(k + 10, num_new_text)])
        hits.append(run_turn(m, turn, num_output=num_output, chunk=16))
        assert hits[-1] == computed // 32 * 32  # floor_A of what the previous turn computed
    assert hits == [96, 128, 160]
    stats = m.stats
    assert stats.num_hit_tokens == sum(hits)
    assert stats.num_queried_tokens == 70 + 130 + 175 + 227
    assert_all_free(m)


def test_superseded_finish_checkpoints_become_transient():
    m = manager()
    x = make_request("x", tokens(6, 40))  # prompt checkpoint at 32
    run_turn(m, x, num_output=100)  # 139 computed: passes 64, 96, 128; finishes at 128
    assert lookup(m, [*x.all_token_ids[:100], 7, 7]) == 32  # 64 and 96 were demoted
    assert lookup(m, [*x.all_token_ids, 7]) == 128
    # Cached state pages: exactly the checkpoints at 32 and 128.
    # swa / hca_state (page 8, window 16): 2 pages each; csa_state (window 8): 1 page each.
    assert [m.pools[g].num_cached_blocks for g in (SWA, CSA_STATE, HCA_STATE)] == [4, 2, 4]
    assert [m.pools[g].num_cached_blocks for g in (CSA_KV, HCA_KV)] == [4, 4]


def all_to_tail(pool, blocks) -> None:
    for block in blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            pool.free_queue.append(block)


@pytest.mark.parametrize("transient_to_head", [True, False])
def test_long_request_churn_does_not_evict_cached_sessions(transient_to_head):
    m = manager(num_sliding=17, num_full=200)  # 16 usable pages per state group
    if not transient_to_head:  # control: a plain LRU that queues every freed page at the tail
        for pool in m.pools[:3]:
            pool.free = lambda blocks, pool=pool: all_to_tail(pool, blocks)
    session = make_request("s", tokens(7, 70))
    run_turn(m, session, num_output=10)  # cached: history [0, 64) and the checkpoint at 64
    long = make_request("long", tokens(8, 300))
    prefill(m, long, chunk=32)
    decode(m, long, 200)  # ~60 window pages per group pass through a 16-page pool
    next_turn = [*session.all_token_ids, *tokens(9, 30)]
    assert lookup(m, next_turn) == (64 if transient_to_head else 0)
    finish(m, long)
    assert lookup(m, [*long.all_token_ids, 1]) == 480


def test_preempt_and_recompute_hits_own_prefix():
    m = manager()
    req = make_request("r", tokens(11, 50))
    prefill(m, req, chunk=16)
    decode(m, req, 29)
    assert (req.num_computed_tokens, len(req.all_token_ids)) == (79, 80)
    before = m.get_block_ids(req)
    m.free(req, req.num_computed_tokens)  # preempted: recomputed later from its tokens
    assert_all_free(m)
    num_hit, hit = m.get_computed_blocks(req)
    assert num_hit == 64  # floor_32(79): its own history and finish checkpoint
    new = m.allocate_slots(req, 80 - 64, 64, hit)
    assert new is not None and new.offsets == (0, 0, 0, 0, 0)
    swa = list(new.block_ids[SWA])
    # Slots 6, 7 (rows [49, 64)) had left the window before the preemption: they come back
    # from the cache; 8, 9 (rows [64, 80)) are recomputed into new pages.
    assert swa[:6] == [0] * 6 and swa[6:8] == [b.block_id for b in hit.blocks[SWA][6:]]
    assert before[SWA][6:8] == [0, 0] and len(swa) == 10
    assert list(new.block_ids[CSA_KV][:2]) == before[CSA_KV][:2]
    req.num_computed_tokens = 80
    m.commit(req, 80)
    req.all_token_ids.append(5)
    decode(m, req, 10)
    finish(m, req)
    assert_all_free(m)
