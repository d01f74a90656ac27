"""The host KV pool (second tier): blocks the device cache evicts go to host memory and
come back on a later prefix hit, exactly as if recomputed (shared/KV_CACHE.md's rule).

- pool.py: the pool interface and the in-process LRU pool;
- server.py: a pool server process shared by the engines of a host (ZMQ), and its client;
- plan.py: how far a hit reaches over device + pool;
- blocks.py: block rows between the paged tensors and pool values;
- offloader.py: the engine side (evictions out, hits back in, asynchronously).
"""

from rackserve.kv.offload.offloader import KVOffloader, LoadStart, OffloadStats
from rackserve.kv.offload.pool import KVPool, LocalKVPool, PoolUsage, pool_key

__all__ = [
    "KVOffloader",
    "KVPool",
    "LoadStart",
    "LocalKVPool",
    "OffloadStats",
    "PoolUsage",
    "pool_key",
]
