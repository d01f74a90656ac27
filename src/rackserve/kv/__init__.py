"""Paged KV cache bookkeeping: cache group specs, block pools, prefix hashing, the manager.

See ../shared/KV_CACHE.md for the design. Data lives in the runner's tensors; this package
only decides which block ids each request holds in each cache group.
"""

from rackserve.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from rackserve.kv.hashing import BlockHashChain, BlockKey, hash_tokens, root_hash
from rackserve.kv.manager import (
    HitBlocks,
    KVCacheManager,
    KVRequest,
    NewBlocks,
    PrefixCacheStats,
)
from rackserve.kv.spec import (
    CacheGroupSpec,
    bytes_per_request,
    bytes_per_token,
    cache_groups_for,
    capacity_tokens,
    hash_granularity,
    plan_num_blocks,
    prefix_alignment,
)

__all__ = [
    "BlockHashChain",
    "BlockKey",
    "BlockPool",
    "CacheGroupSpec",
    "FreeBlockQueue",
    "HitBlocks",
    "KVCacheBlock",
    "KVCacheManager",
    "KVRequest",
    "NewBlocks",
    "PrefixCacheStats",
    "bytes_per_request",
    "bytes_per_token",
    "cache_groups_for",
    "capacity_tokens",
    "hash_granularity",
    "hash_tokens",
    "plan_num_blocks",
    "prefix_alignment",
    "root_hash",
]
