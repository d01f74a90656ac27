"""Where a request's prefix hit can reach with the host pool as a second tier: the exact
rule of shared/KV_CACHE.md (prefix_cache.find) over the union of device and pool.

A hit of B tokens needs every full-history block of [0, B) and the state checkpoint at B
(the sliding pages with rows [B-W+1, B)), each either cached on the device or held by the
pool. A pure function of the cache's keys and a pool membership test::

    [0 ......... device hit H)[H ........ B)[B ... len-1]
    full groups:   on device   | device or pool (pool ones are loaded)
    sliding:                     checkpoint pages at B, device or pool
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rackserve.kv.block_pool import KVCacheBlock
from rackserve.kv.hashing import BlockHashChain, BlockKey
from rackserve.kv.prefix_cache import PrefixCache
from rackserve.kv.records import slot_key

InPool = Callable[[Sequence[BlockKey]], list[bool]]


@dataclass(frozen=True)
class PoolHit:
    """A hit of ``num_tokens`` tokens: per group (spec order) the device blocks it reuses
    (``present``) and the ``(slot, key)`` of the blocks to load from the pool (``missing``)."""

    num_tokens: int
    present: tuple[tuple[KVCacheBlock, ...], ...]
    missing: tuple[tuple[tuple[int, BlockKey], ...], ...]

    @property
    def num_missing(self) -> int:
        return sum(map(len, self.missing))


def _split(cache: PrefixCache, g: int, chain: BlockHashChain, slots: range) -> tuple[list, list]:
    """(slot, key, device block or None) for ``slots`` of group g, and the keys not on the
    device."""
    pool, spec = cache.pools[g], cache.specs[g]
    rows, off_device = [], []
    for i in slots:
        key = slot_key(spec, chain, i)
        block = pool.get_cached_block(key)
        rows.append((i, key, block))
        if block is None:
            off_device.append(key)
    return rows, off_device


def plan_pool_hit(
    cache: PrefixCache, chain: BlockHashChain, num_tokens: int, device_hit: int, in_pool: InPool
) -> PoolHit | None:
    """The longest hit B > ``device_hit`` over device + pool, or None. ``chain`` covers the
    request's ``num_tokens`` known tokens; ``in_pool`` answers for many keys at once (one
    round trip to a pool server)."""
    limit = cache.floor_align(max(0, num_tokens - 1))
    if limit <= device_hit:
        return None
    # Cheap reject first (one key per full group): any B > device_hit needs the first block
    # past the device hit in every full-history group.
    first = [(g, device_hit // s.block_tokens) for g, s, _ in cache.full]
    probe = [
        key
        for g, i in first
        if cache.pools[g].get_cached_block(key := slot_key(cache.specs[g], chain, i)) is None
    ]
    if probe and not all(in_pool(probe)):
        return None

    # Full-history groups: how far the two tiers together reach from slot 0.
    full_rows: dict[int, list] = {}
    wanted: list[BlockKey] = []
    for g, spec, _ in cache.full:
        rows, off_device = _split(cache, g, chain, range(limit // spec.block_tokens))
        full_rows[g] = rows
        wanted += off_device
    sliding_rows: dict[tuple[int, int], list] = {}
    held = dict(zip(wanted, in_pool(wanted), strict=True)) if wanted else {}
    for g, spec, _ in cache.full:
        rows = full_rows[g]
        n = next((k for k, (_, key, b) in enumerate(rows) if b is None and not held[key]), None)
        if n is not None:
            limit = cache.floor_align(min(limit, n * spec.block_tokens))
    boundaries = range(limit, device_hit, -cache.alignment)
    wanted = []
    for b in boundaries:
        for g, spec, _ in cache.sliding:
            slots = range(spec.first_live_slot(b), b // spec.block_tokens)
            rows, off_device = _split(cache, g, chain, slots)
            sliding_rows[(g, b)] = rows
            wanted += off_device
    wanted = list(dict.fromkeys(wanted))
    held.update(zip(wanted, in_pool(wanted), strict=True) if wanted else ())
    for b in boundaries:
        if all(
            block is not None or held[key]
            for g, _, _ in cache.sliding
            for _, key, block in sliding_rows[(g, b)]
        ):
            return _hit(cache, b, full_rows, sliding_rows)
    return None


def _hit(cache: PrefixCache, boundary: int, full_rows: dict, sliding_rows: dict) -> PoolHit:
    present: list[tuple[KVCacheBlock, ...]] = []
    missing: list[tuple[tuple[int, BlockKey], ...]] = []
    for g, spec in enumerate(cache.specs):
        if spec.is_sliding:
            rows = sliding_rows[(g, boundary)]
        else:
            rows = full_rows[g][: boundary // spec.block_tokens]
        present.append(tuple(b for _, _, b in rows if b is not None))
        missing.append(tuple((i, key) for i, key, b in rows if b is None))
    return PoolHit(boundary, tuple(present), tuple(missing))
