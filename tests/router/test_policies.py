"""The router's pure parts: policies, the KV index (events and approximate), keyers."""

from __future__ import annotations

import msgspec
import pytest

from rackserve.router.engines import EnginePool
from rackserve.router.kv_index import KVIndex, TextKeyer
from rackserve.router.policies import Candidate, pick


# A local copy of the contract's Structs (kv/events.py is helper kvpool's): the index only
# reads the class names and fields, as the engine's decode_batch yields them.
class BlockStored(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[bytes]
    parent_hash: bytes | None
    num_tokens: int
    medium: str


class BlockRemoved(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[bytes]
    medium: str


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    seq: int
    engine_id: str
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decode_batch(data: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(data, type=KVEventBatch)


def test_pick_policies():
    c = [Candidate(0, 500, 2), Candidate(1, 100, 1), Candidate(2, 100, 1, device_hit_tokens=900)]
    assert [pick("round-robin", c, 1000, t, None) for t in range(4)] == [0, 1, 2, 0]
    assert pick("least-load", c, 1000, 0, None) == 1
    assert pick("session", c, 1000, 0, 0) == 0  # affinity wins
    assert pick("session", c, 1000, 0, None) == 1  # no session: least load
    assert pick("kv-aware", c, 1000, 0, None) == 2  # the prefix is there
    # a big hit is not worth an engine with far more queued work
    busy = [Candidate(0, 10_000, 9, device_hit_tokens=900), Candidate(1, 0, 0)]
    assert pick("kv-aware", busy, 1000, 0, None) == 1
    # pool hits count, less than device hits
    tiers = [Candidate(0, 0, 0, pool_hit_tokens=800), Candidate(1, 0, 0, device_hit_tokens=800)]
    assert pick("kv-aware", tiers, 1000, 0, None) == 1
    # equal cost: the session's engine
    assert pick("kv-aware", [Candidate(0, 0, 0), Candidate(1, 0, 0)], 10, 0, 1) == 1
    with pytest.raises(ValueError, match="no healthy engine"):
        pick("kv-aware", [], 10, 0, None)
    with pytest.raises(ValueError, match="unknown policy"):
        pick("random", c, 10, 0, None)


def test_index_from_events_tiers_and_clear():
    index = KVIndex(2)
    h = [bytes([i]) * 16 for i in range(6)]
    batch = KVEventBatch(0.0, 0, "e0", [BlockStored(h[:3], None, 96, "device")])
    index.apply(0, decode_batch(msgspec.msgpack.encode(batch)))
    index.apply(0, KVEventBatch(0.0, 1, "e0", [BlockStored(h[3:5], None, 64, "pool")]))
    assert index.match(0, h) == (3, 2)
    assert index.match(1, h) == (0, 0)
    index.apply(0, KVEventBatch(0.0, 2, "e0", [BlockRemoved([h[1]], "device")]))
    assert index.match(0, h) == (1, 0)  # a hole ends the device prefix
    index.apply(0, KVEventBatch(0.0, 5, "e0", [AllBlocksCleared()]))
    assert index.match(0, h) == (0, 0)
    assert index.num_gaps == 1  # seq 2 -> 5


def test_approximate_index_lru_and_forget():
    index = KVIndex(1, approx_capacity=4)
    index.record_routed(0, [b"a", b"b", b"c"])
    index.record_routed(0, [b"a", b"d", b"e"])  # b is evicted (oldest)
    assert index.match(0, [b"a", b"b"]) == (1, 0)
    assert index.match(0, [b"a", b"d", b"e"]) == (3, 0)
    index.forget_engine(0)
    assert index.match(0, [b"a"]) == (0, 0)


def test_text_keyer_prefix_property():
    keyer = TextKeyer()
    turn1 = {"messages": [{"role": "user", "content": "x" * 200}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "y" * 100}]}
    k1, block = keyer.keys(turn1)
    k2, _ = keyer.keys(turn2)
    assert block == 64 and len(k1) == 3 and k2[: len(k1)] == k1
    salted, _ = keyer.keys(dict(turn1, cache_salt="s"))
    assert salted[0] != k1[0]


def test_text_keyer_keys_token_id_prompts():
    """A prompt of token ids is keyed by its ids (it used to key as the text of its first
    id: no blocks, so no prefix routing); prefixes share keys; a batch keys its first."""
    keyer = TextKeyer()
    ids = list(range(1000, 1000 + 80))
    k1, block = keyer.keys({"prompt": ids})
    k2, _ = keyer.keys({"prompt": ids + [7] * 40})
    assert block == 64 and len(k1) == 5 and len(k2) == 7 and k2[:5] == k1
    assert keyer.keys({"prompt": [ids, [1, 2]]})[0] == k1
    changed, _ = keyer.keys({"prompt": [*ids[:79], 5]})  # the last id differs
    assert changed[:4] == k1[:4] and changed[4] != k1[4]
    assert not set(k1) & set(keyer.keys({"prompt": "x" * 640})[0])
    pool = EnginePool([f"http://e{i}" for i in range(3)], "engine", "kv-aware")
    homes = []
    for s in range(3):
        choice = pool.choose({"prompt": [s] * 200}, None, set())
        pool.start(choice, None)
        pool.finish(choice)
        homes.append(choice.index)
    assert len(set(homes)) == 3
    for s, home in enumerate(homes):  # a longer turn of each goes where its prefix is
        assert pool.choose({"prompt": [s] * 200 + [9] * 50}, None, set()).index == home
    assert pool.choose({"prompt": ["not", "ids", 3]}, None, set()).units == 1  # by load


def test_pool_routes_sessions_to_their_prefix_and_around_down_engines():
    pool = EnginePool([f"http://e{i}" for i in range(4)], "engine", "kv-aware")
    bodies = [{"prompt": f"session {s} " + "z" * 300} for s in range(8)]
    first = []
    for body in bodies:
        choice = pool.choose(body, None, set())
        pool.start(choice, None)
        pool.finish(choice)
        first.append(choice.index)
    assert len(set(first)) == 4  # spread by load while nothing is cached
    for body, engine in zip(bodies, first, strict=True):
        longer = {"prompt": body["prompt"] + " more text " * 20}
        assert pool.choose(longer, None, set()).index == engine
    pool.mark_down(first[0], "test")
    assert pool.choose(bodies[0], None, set()).index != first[0]
    with pytest.raises(ValueError, match="no healthy"):
        pool.choose(bodies[0], None, {0, 1, 2, 3})


def _in_flight(pool: EnginePool, prompts: list[str]) -> list[int]:
    """Route ``prompts`` one after another, none finishing; the engine of each."""
    chosen = []
    for prompt in prompts:
        choice = pool.choose({"prompt": prompt}, None, set())
        pool.start(choice, None)
        chosen.append(choice.index)
    return chosen


def test_load_term_spreads_a_hot_prefix_and_keeps_hits_home():
    keyer = TextKeyer()
    shared = "s" * 640  # 10 blocks every request starts with, cached on engine 0 only
    tails = [f"{i:04d}" * 320 for i in range(12)]  # 20 blocks of its own each

    def pool(load_weight: float) -> EnginePool:
        index = KVIndex(4)
        index.record_routed(0, keyer.keys({"prompt": shared})[0])
        urls = [f"http://e{i}" for i in range(4)]
        return EnginePool(urls, "engine", "kv-aware", keyer, index, False, load_weight)

    # Without a load term every request piles onto the engine with the shared prefix ...
    assert _in_flight(pool(0.0), [shared + t for t in tails]) == [0] * 12
    # ... with it, queued prefill work spreads them (engine 0 keeps the largest share).
    chosen = _in_flight(pool(0.5), [shared + t for t in tails])
    counts = [chosen.count(i) for i in range(4)]
    assert max(counts) <= 4 and counts[0] == max(counts) and min(counts) >= 2

    # Load counts the tokens an engine must compute: requests in flight that hit their
    # prefix weigh little, so a session still goes back to its engine behind three of them.
    p = pool(0.5)
    session = "u" * 1920
    p.index.record_routed(1, keyer.keys({"prompt": session})[0])
    assert _in_flight(p, [session + f" turn {i}" * 8 for i in range(4)]) == [1] * 4
    assert p.engines[1].load_units < 4 * 200
