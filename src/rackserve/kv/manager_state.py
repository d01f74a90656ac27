"""The KV cache manager's state: what it is built from and what it answers without changing.

``KVManagerState`` holds the cache groups, their block pools, the prefix cache, each
request's ``RequestState`` and ``idle_until``, the blocks held for a request before its
admission (host KV pool loads) and the prefix-cache counters; its queries read them. The
manager (manager.py) adds admission and allocation, ``KVManagerCommit`` (manager_commit.py)
commits and release.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from rackserve.kv.block_pool import BlockPool, KVCacheBlock
from rackserve.kv.hashing import BlockHashChain, check_hash_algo
from rackserve.kv.prefix_cache import Group, PrefixCache
from rackserve.kv.records import PrefixCacheStats, RequestState
from rackserve.kv.spec import CacheGroupSpec, hash_granularity

__all__ = ["KVManagerState", "KVRequest"]


class KVRequest(Protocol):
    """What the manager reads from a request (it writes nothing there)."""

    request_id: str
    all_token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    cache_salt: str | None


class KVManagerState:
    """The manager's state and queries (``KVCacheManager`` is built on it: manager.py)."""

    def __init__(
        self,
        specs: Sequence[CacheGroupSpec],
        num_blocks: Mapping[str, int],
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        checkpoint_interval: int | None = None,
        record_events: bool = False,
    ) -> None:
        self.specs = tuple(specs)
        names = [s.name for s in self.specs]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"cache group names must be non-empty and unique, got {names}")
        if set(num_blocks) != set(names):
            raise ValueError(
                f"num_blocks must have exactly the groups {names}, got {list(num_blocks)}"
            )
        check_hash_algo(hash_algo)
        self.pools = tuple(BlockPool(num_blocks[name], record_events) for name in names)
        self.prefix_cache = PrefixCache(self.specs, self.pools, checkpoint_interval)
        self.alignment = self.prefix_cache.alignment  # A
        self.granularity = hash_granularity(self.specs)  # G
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self._groups: list[Group] = [(g, s, self.pools[g]) for g, s in enumerate(self.specs)]
        self._sliding, self._full = self.prefix_cache.sliding, self.prefix_cache.full
        self._no_block_ids: tuple[tuple[int, ...], ...] = tuple(() for _ in self.specs)
        self._group_index = {name: g for g, name in enumerate(names)}
        self._states: dict[str, RequestState] = {}
        self.idle_until: dict[str, int] = {}
        # Blocks taken for a request before its admission (host KV pool loads): released
        # once its first allocation has touched them, or when it is freed.
        self._held: dict[str, list[tuple[BlockPool, list[KVCacheBlock]]]] = {}
        self._num_queries = self._num_queried_tokens = self._num_hit_tokens = 0
        # Tokens of a request's next hit that the host KV pool loaded (kv/offload), counted
        # when it is admitted.
        self._pool_hit_tokens: dict[str, int] = {}
        self._num_pool_hit_tokens = 0

    # ---- held blocks (host KV pool loads) -----------------------------------------------
    def hold(self, req: KVRequest, blocks: Sequence[Sequence[KVCacheBlock]]) -> None:
        """Record that ``req`` owns one reference (taken by the caller: ``get_new_blocks`` or
        ``touch``) on these blocks (per group, spec order), so that its next lookup finds
        them (host KV pool loads). Released by its admission or by :meth:`free`."""
        held = self._held.setdefault(req.request_id, [])
        held += [(pool, list(b)) for pool, b in zip(self.pools, blocks, strict=True) if b]

    def note_pool_hit(self, req: KVRequest, num_tokens: int) -> None:
        """``num_tokens`` of ``req``'s next hit came from the host KV pool (stats only)."""
        self._pool_hit_tokens[req.request_id] = (
            self._pool_hit_tokens.get(req.request_id, 0) + num_tokens
        )

    def release_held(self, req: KVRequest) -> None:
        for pool, blocks in self._held.pop(req.request_id, ()):
            pool.free(blocks)

    # ---- queries -------------------------------------------------------------------------
    def _new_state(self, req: KVRequest) -> RequestState:
        return RequestState(BlockHashChain(self.granularity, req.cache_salt, self.hash_algo))

    def lookup_chain(self, req: KVRequest) -> BlockHashChain | None:
        """The hash chain of a request looked up (get_computed_blocks) and not yet freed."""
        state = self._states.get(req.request_id)
        return None if state is None else state.chain

    def get_block_ids(self, req: KVRequest) -> tuple[list[int], ...]:
        """The request's block table per group (null block ids in released slots)."""
        state = self._states.get(req.request_id)
        if state is None or not state.allocated:
            return tuple([] for _ in self.specs)
        return tuple([b.block_id for b in table] for table in state.block_tables)

    def num_free_blocks(self, group: str) -> int:
        return self.pools[self._group_index[group]].num_free_blocks

    @property
    def usage(self) -> float:
        """The fullest group's fraction of blocks held by requests."""
        return max(pool.usage for pool in self.pools)

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self._num_queries,
            self._num_queried_tokens,
            self._num_hit_tokens,
            self._num_pool_hit_tokens,
        )

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after a weight update); held blocks stay valid."""
        self.prefix_cache.reset()
