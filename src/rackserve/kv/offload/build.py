"""Building the host KV pool of one engine from its CacheConfig."""

from __future__ import annotations

import hashlib

import torch

from rackserve.config import CacheConfig
from rackserve.kv.events import anchor_group
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.offload.offloader import KVOffloader
from rackserve.kv.offload.pool import KVPool, LocalKVPool
from rackserve.model.batch import KVCacheTensors


def pool_namespace(kv: KVCacheManager, dtype: torch.dtype) -> bytes:
    """8 bytes naming the cache layout (groups, block shapes, dtype, hash algorithm): only
    engines with the same layout share pool entries."""
    layout = repr((kv.specs, str(dtype), kv.hash_algo)).encode()
    return hashlib.sha256(layout).digest()[:8]


def build_offloader(
    cache: CacheConfig, kv: KVCacheManager, caches: KVCacheTensors, dtype: torch.dtype
) -> KVOffloader | None:
    """The engine's offloader (None without ``--kv-offload-memory`` / ``--kv-offload-server``);
    pool-tier KV events are kept for the anchor group when events are on."""
    pool: KVPool
    if cache.kv_offload_server is not None and cache.kv_offload_server.startswith("mooncake://"):
        from rackserve.kv.offload.mooncake import MooncakeKVPool

        pool = MooncakeKVPool(cache.kv_offload_server)
    elif cache.kv_offload_server is not None:
        from rackserve.kv.offload.server import RemoteKVPool

        pool = RemoteKVPool(cache.kv_offload_server)
    elif cache.kv_offload_memory is not None:
        pool = LocalKVPool(cache.kv_offload_memory)
    else:
        return None
    anchor = anchor_group(kv.specs).name if cache.kv_events_endpoint else None
    return KVOffloader(kv, caches, pool, pool_namespace(kv, dtype), anchor)
