"""The engine side of the host KV pool on two small groups (no model): which blocks a pool
hit needs (plan.py), and evicted rows coming back byte for byte into new blocks.

Groups as in test_manager.py: ``swa`` (4-token pages, window 8) and ``kv`` (full history,
8-token blocks), so A = 8.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch
from kv_sim import decode, make_request, prefill, start

from rackserve.kv.block_pool import BlockEventKind
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.offload import KVOffloader, LoadStart, LocalKVPool
from rackserve.kv.offload.plan import plan_pool_hit
from rackserve.kv.records import slot_key
from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import KVCacheTensors
from rackserve.request import RequestStatus

SPECS = (
    CacheGroupSpec("swa", (0, 1), 4, 1, 8, 16, 2),
    CacheGroupSpec("kv", (0,), 8, 2, None, 32, 2),
)
NUM_BLOCKS = {"swa": 16, "kv": 16}


@dataclass
class Waiting:  # what the offloader reads and sets on a request
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING


def finished_turn(m: KVCacheManager) -> list[int]:
    """A 20-token prompt decoded to 25 tokens and freed: checkpoints at 16 and 24 cached
    (test_manager.py's first test). Returns its tokens."""
    a = make_request("a", list(range(20)))
    prefill(m, a)
    decode(m, a, 5)
    m.free(a, 25)
    return a.all_token_ids


def evict_all(m: KVCacheManager) -> list:
    """Take every free block (evicting every cached one) and give them back as transient;
    returns the evicted events per group."""
    taken = [pool.get_new_blocks(pool.num_free_blocks) for pool in m.pools]
    events = [pool.take_events() for pool in m.pools]
    for pool, blocks in zip(m.pools, taken, strict=True):
        pool.free(blocks)
    return events


def test_plan_reaches_over_the_pool_and_falls_back_to_an_earlier_checkpoint():
    m = KVCacheManager(SPECS, NUM_BLOCKS, record_events=True)
    tokens = finished_turn(m)
    events = evict_all(m)
    in_pool = {e.key for group in events for e in group if e.kind is BlockEventKind.EVICTED}
    b = Waiting("b", [*tokens, 900, 901, 902], 29)
    assert start(m, b)[0] == 0  # nothing left on the device
    chain = m.lookup_chain(b)

    hit = plan_pool_hit(m.prefix_cache, chain, 29, 0, lambda keys: [k in in_pool for k in keys])
    assert hit is not None and hit.num_tokens == 24
    # window rows [17, 24): swa pages 4, 5; kv blocks 0..2
    assert [[slot for slot, _ in group] for group in hit.missing] == [[4, 5], [0, 1, 2]]
    assert hit.present == ((), ())

    # Without page 5 the checkpoint at 24 is incomplete: the prompt's one at 16 serves.
    gone = slot_key(SPECS[0], chain, 5)
    hit = plan_pool_hit(
        m.prefix_cache, chain, 29, 0, lambda keys: [k in in_pool and k != gone for k in keys]
    )
    assert hit.num_tokens == 16
    assert [[slot for slot, _ in group] for group in hit.missing] == [[2, 3], [0, 1]]
    # Nothing beyond the device hit: no plan.
    assert plan_pool_hit(m.prefix_cache, chain, 29, 24, lambda keys: [True] * len(keys)) is None
    assert plan_pool_hit(m.prefix_cache, chain, 29, 0, lambda keys: [False] * len(keys)) is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_evicted_rows_come_back_byte_for_byte(device):
    """On a GPU the same path runs with pinned host buffers and side-stream copies."""
    m = KVCacheManager(SPECS, NUM_BLOCKS, record_events=True)
    caches = KVCacheTensors(SPECS, NUM_BLOCKS, torch.float32, device)
    for group in caches.tensors.values():
        for t in group.values():
            t.copy_(torch.randn(t.shape))
    tokens = finished_turn(m)
    cached = {  # key -> rows of every layer, before eviction
        block.block_hash: [t[block.block_id].clone() for t in caches.tensors[spec.name].values()]
        for spec, pool in zip(SPECS, m.pools, strict=True)
        for block in pool.blocks
        if block.block_hash is not None
    }
    pool = LocalKVPool(1 << 20)
    offload = KVOffloader(m, caches, pool, b"ns")
    offload.offload(evict_all(m))
    for group in caches.tensors.values():  # the next forward overwrites every block
        for t in group.values():
            t.zero_()
    offload.flush()
    assert len(pool.keys()) == len(cached)
    values = pool.get(pool.keys())
    assert all(v.device.type == "cpu" and v.is_pinned() == (device == "cuda") for v in values)
    stats = offload.stats
    assert stats.num_blocks_offloaded == len(cached)
    assert stats.bytes_offloaded == stats.pool_used_bytes > 0

    b = Waiting("b", [*tokens, 900, 901, 902], 29)
    num_hit, _ = m.get_computed_blocks(b)
    assert num_hit == 0
    assert offload.start_load(b, num_hit) is LoadStart.STARTED
    assert b.status is RequestStatus.WAITING_FOR_POOL_KV and offload.num_loading == 1
    offload.flush()
    assert offload.take_loaded() == [b]
    assert b.status is RequestStatus.WAITING and offload.num_loading == 0
    num_hit, hit = m.get_computed_blocks(b)
    assert num_hit == 24
    # the lookup after a load counts the pool's tokens and loads nothing
    assert offload.start_load(b, num_hit) is LoadStart.NONE
    for spec, blocks in zip(SPECS, hit.blocks, strict=True):
        for block in blocks:
            if block.block_id == 0:
                continue  # null block: window rows not needed
            rows = [t[block.block_id] for t in caches.tensors[spec.name].values()]
            assert all(
                torch.equal(x, y) for x, y in zip(rows, cached[block.block_hash], strict=True)
            )
    assert m.allocate_slots(b, 5, 24, hit) is not None
    assert m.stats.num_pool_hit_tokens == m.stats.num_hit_tokens == 24  # at admission
    offload.close()


def test_an_aborted_load_writes_nothing_and_frees_its_blocks():
    m = KVCacheManager(SPECS, NUM_BLOCKS, record_events=True)
    caches = KVCacheTensors(SPECS, NUM_BLOCKS, torch.float32, "cpu")
    tokens = finished_turn(m)
    offload = KVOffloader(m, caches, LocalKVPool(1 << 20), b"ns")
    offload.offload(evict_all(m))
    offload.flush()
    free_before = [pool.num_free_blocks for pool in m.pools]
    b = Waiting("b", [*tokens, 900], 27)
    assert offload.start_load(b, m.get_computed_blocks(b)[0]) is LoadStart.STARTED
    assert [pool.num_free_blocks for pool in m.pools] < free_before
    b.status = RequestStatus.FINISHED_ABORTED  # as Scheduler.finish_requests does
    m.free(b)
    assert [pool.num_free_blocks for pool in m.pools] == free_before
    offload.flush()
    assert offload.take_loaded() == []
    assert all(not t.any() for g in caches.tensors.values() for t in g.values())
    offload.close()


def test_no_room_on_the_device_is_reported_not_recomputed():
    m = KVCacheManager(SPECS, NUM_BLOCKS, record_events=True)
    caches = KVCacheTensors(SPECS, NUM_BLOCKS, torch.float32, "cpu")
    tokens = finished_turn(m)
    offload = KVOffloader(m, caches, LocalKVPool(1 << 20), b"ns")
    offload.offload(evict_all(m))
    offload.flush()
    taken = m.pools[1].get_new_blocks(m.pools[1].num_free_blocks - 2)  # a busy cache
    b = Waiting("b", [*tokens, 900], 27)
    assert offload.start_load(b, m.get_computed_blocks(b)[0]) is LoadStart.NO_ROOM
    assert b.status is RequestStatus.WAITING and offload.num_loading == 0
    m.pools[1].free(taken)
    assert offload.start_load(b, m.get_computed_blocks(b)[0]) is LoadStart.STARTED
    offload.close()


class DeadPool(LocalKVPool):
    def contains(self, keys):
        raise ConnectionError("pool server gone")


def test_a_dead_pool_makes_lookups_miss_not_fail():
    m = KVCacheManager(SPECS, NUM_BLOCKS, record_events=True)
    caches = KVCacheTensors(SPECS, NUM_BLOCKS, torch.float32, "cpu")
    tokens = finished_turn(m)
    offload = KVOffloader(m, caches, DeadPool(1 << 20), b"ns")
    offload.offload(evict_all(m))
    offload.flush()
    b = Waiting("b", [*tokens, 900], 27)
    assert offload.start_load(b, m.get_computed_blocks(b)[0]) is LoadStart.NONE
    assert isinstance(offload.error, ConnectionError)
    offload.close()


class GatedPool(LocalKVPool):
    """Its gets wait for ``gate``: a load in flight for as long as a test wants."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.gate = threading.Event()

    def get(self, keys):
        self.gate.wait(10)
        return super().get(keys)


def test_an_idle_engine_naps_until_a_load_lands():
    m = KVCacheManager(SPECS, NUM_BLOCKS, record_events=True)
    caches = KVCacheTensors(SPECS, NUM_BLOCKS, torch.float32, "cpu")
    tokens = finished_turn(m)
    pool = GatedPool(1 << 20)
    offload = KVOffloader(m, caches, pool, b"ns")
    start = time.monotonic()
    offload.wait_for_loads(5)  # nothing in flight: returns at once
    assert time.monotonic() - start < 1
    offload.offload(evict_all(m))
    offload.flush()
    b = Waiting("b", [*tokens, 900], 27)
    assert offload.start_load(b, m.get_computed_blocks(b)[0]) is LoadStart.STARTED
    start = time.monotonic()
    offload.wait_for_loads(0.2)  # still fetching: naps the whole timeout
    assert time.monotonic() - start >= 0.2 and offload.take_loaded() == []
    threading.Timer(0.1, pool.gate.set).start()
    offload.wait_for_loads(5)  # wakes when the fetch is done, not after 5 s
    assert time.monotonic() - start < 3
    assert offload.take_loaded() == [b]
    offload.close()
