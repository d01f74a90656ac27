"""The host KV pool: exact LRU order within a byte budget, in process and over ZMQ."""

from __future__ import annotations

import pytest
import torch

from rackserve.kv.offload.pool import LocalKVPool, pool_key
from rackserve.kv.offload.server import KVPoolServer, RemoteKVPool


def value(n: int, fill: int = 1) -> torch.Tensor:
    return torch.full((n,), fill, dtype=torch.uint8)


def test_pool_key_names_namespace_group_and_hash():
    assert pool_key(b"ns", ("csa_kv", b"\x01\x02")) == b"nscsa_kv/\x01\x02"


def test_local_pool_lru_within_budget():
    pool = LocalKVPool(100)
    assert pool.put([(b"a", value(40)), (b"b", value(40))]) == []
    assert pool.get([b"a"])[0] is not None  # a is now the most recently used
    assert pool.put([(b"c", value(40))]) == [b"b"]  # 120 > 100: the LRU one goes
    assert pool.keys() == [b"a", b"c"]
    assert pool.contains([b"a", b"b", b"c"]) == [True, False, True]
    assert pool.put([(b"a", value(40, 7))]) == []  # present: refreshed, not replaced
    assert pool.keys() == [b"c", b"a"] and int(pool.get([b"a"])[0][0]) == 1
    assert pool.put([(b"big", value(101))]) == []  # larger than the pool: dropped
    assert pool.contains([b"big"]) == [False]
    usage = pool.usage()
    assert (usage.num_entries, usage.used_bytes, usage.capacity_bytes) == (2, 80, 100)
    assert usage.fraction == 0.8
    pool.put([(b"xa", value(10))])
    pool.clear(b"x")
    assert pool.keys() == [b"c", b"a"]


def test_local_pool_refuses_bad_input():
    with pytest.raises(ValueError, match="positive size"):
        LocalKVPool(0)
    with pytest.raises(ValueError, match="uint8"):
        LocalKVPool(10).put([(b"a", torch.zeros(2))])


def test_remote_pool_matches_local_over_zmq():
    server = KVPoolServer(100, "tcp://127.0.0.1:*")
    server.start()
    pool = RemoteKVPool(server.endpoint, timeout_ms=5000)
    try:
        assert pool.capacity_bytes == 100
        assert pool.put([(b"a", value(40, 3)), (b"b", value(40))]) == []
        assert torch.equal(pool.get([b"a"])[0], value(40, 3))
        assert pool.put([(b"c", value(40))]) == [b"b"]
        assert pool.get([b"b", b"c"])[0] is None
        assert pool.contains([b"a", b"b"]) == [True, False]
        assert pool.usage().used_bytes == 80
        pool.clear()
        assert pool.usage().num_entries == 0
    finally:
        pool.close()
        server.stop()


def test_remote_pool_without_server_fails_clearly():
    with pytest.raises(ConnectionError, match="did not answer"):
        RemoteKVPool("tcp://127.0.0.1:9", timeout_ms=200)
