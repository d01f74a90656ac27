"""The hybrid KV cache manager: block tables per cache group, allocation, release, prefix hits.

Bookkeeping only (block ids, reference counts, hashes); the runner owns the tensors. A
request's block table of group g (block span T) maps slot i to token positions
``[i*T, (i+1)*T)``, absolute: a sliding group's table starts with null blocks for the pages
it has released.

Lifecycle, driven by the scheduler::

    num_hit, hit = get_computed_blocks(req)           # once, before the first allocation
    new = allocate_slots(req, n, num_hit, hit)        # None: cache full, nothing changed
    ... runner computes tokens [num_computed, num_computed + n) ...
    commit(req, num_computed + n)                     # hash full blocks, release window pages
    ... allocate_slots / commit per step ...
    free(req, num_computed)                           # finished, aborted or preempted

State checkpoints (the sliding rows ``[B-W+1, B)`` of every sliding group, needed for an exact
hit at B) are kept only at chosen boundaries B: the prompt end ``floor_A(num_prompt_tokens)``,
every ``checkpoint_interval`` tokens of the prompt, and the finish boundary
``floor_A(num_computed)``. The finish boundary is unknown until the request ends, so the
latest A-boundary is cached provisionally when its pages leave the window and demoted to
transient once the request passes the next one: at most one such checkpoint per request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from rackserve.kv.block_pool import BlockPool, KVCacheBlock
from rackserve.kv.commit import CommitMixin
from rackserve.kv.hashing import BlockHashChain, check_hash_algo
from rackserve.kv.records import (
    HitBlocks,
    NewBlocks,
    PrefixCacheStats,
    RequestState,
    first_live_slot,
    idle_until,
    slot_key,
)
from rackserve.kv.spec import CacheGroupSpec, hash_granularity, prefix_alignment

__all__ = ["HitBlocks", "KVCacheManager", "KVRequest", "NewBlocks", "PrefixCacheStats"]


class KVRequest(Protocol):
    """What the manager reads from a request, and the one field it writes."""

    request_id: str
    all_token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    cache_salt: str | None
    # Written by the manager (fast path on; 0 when the request holds no blocks): an
    # allocate_slots(req, n, L) with L + n <= kv_idle_until would return an empty append and a
    # commit(req, L') with L' < kv_idle_until would do nothing, so the scheduler may skip
    # those calls (records.idle_until says why the count the manager keeps may then lag).
    kv_idle_until: int


class KVCacheManager(CommitMixin):
    """Block tables of every running request over all cache groups (one BlockPool each)."""

    def __init__(
        self,
        specs: Sequence[CacheGroupSpec],
        num_blocks: Mapping[str, int],
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        checkpoint_interval: int | None = None,
        enable_fast_path: bool = True,
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
        self.alignment = prefix_alignment(self.specs)  # A
        self.granularity = hash_granularity(self.specs)  # G
        if checkpoint_interval is not None and (
            checkpoint_interval <= 0 or checkpoint_interval % self.alignment
        ):
            raise ValueError(
                f"checkpoint_interval must be a positive multiple of the prefix alignment "
                f"{self.alignment}, got {checkpoint_interval}"
            )
        self.pools = tuple(BlockPool(num_blocks[name]) for name in names)
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self.checkpoint_interval = checkpoint_interval
        # Skip commits and allocations with nothing to do (records.py); off in the tests
        # that check the fast path against the full one.
        self.enable_fast_path = enable_fast_path
        self._no_block_ids: tuple[tuple[int, ...], ...] = tuple(() for _ in self.specs)
        self._group_index = {name: g for g, name in enumerate(names)}
        self._sliding = [(g, s, self.pools[g]) for g, s in enumerate(self.specs) if s.is_sliding]
        self._full = [(g, s, self.pools[g]) for g, s in enumerate(self.specs) if not s.is_sliding]
        self._groups = [(g, s, self.pools[g]) for g, s in enumerate(self.specs)]
        self._states: dict[str, RequestState] = {}
        self._num_queries = self._num_queried_tokens = self._num_hit_tokens = 0

    # ---- prefix lookup -------------------------------------------------------------------
    def get_computed_blocks(self, req: KVRequest) -> tuple[int, HitBlocks]:
        """The longest exact prefix hit B, with the blocks to reuse.

        ::

            [0 ............................ B)[B ....... len-1][len-1]
            full-history groups: all of [0, B)                  ^ at least one token is
            sliding groups:      [B-W+1, B)  (state checkpoint)   computed (for logits)

        B is a multiple of A and <= len(all_token_ids) - 1 (the prompt of a new request; the
        prompt + output of a preempted one, which is recomputed as a prompt).
        """
        state = self._states.get(req.request_id)
        if state is not None and state.allocated:
            raise ValueError(f"request {req.request_id} already holds blocks; free it first")
        empty = HitBlocks(0, tuple(() for _ in self.specs))
        if not self.enable_prefix_caching:
            return 0, empty
        if state is None:
            state = self._states[req.request_id] = self._new_state(req)
        state.chain.extend(req.all_token_ids)
        limit = self._floor_align(max(0, len(req.all_token_ids) - 1))
        history: dict[int, list[KVCacheBlock]] = {}
        for g, spec, pool in self._full:
            history[g] = blocks = []
            while (len(blocks) + 1) * spec.block_tokens <= limit:
                block = pool.get_cached_block(slot_key(spec, state.chain, len(blocks)))
                if block is None:
                    break
                blocks.append(block)
            limit = self._floor_align(min(limit, len(blocks) * spec.block_tokens))
        state.divergence_boundary = limit
        # Longest first: an evicted checkpoint falls back to the previous boundary with one.
        for boundary in range(limit, 0, -self.alignment):
            sliding = self._find_checkpoint(state.chain, boundary)
            if sliding is None:
                continue
            tables = tuple(
                tuple(sliding[g] if s.is_sliding else history[g][: boundary // s.block_tokens])
                for g, s in enumerate(self.specs)
            )
            return boundary, HitBlocks(boundary, tables)
        return 0, empty

    def _find_checkpoint(
        self, chain: BlockHashChain, boundary: int
    ) -> dict[int, list[KVCacheBlock]] | None:
        """Sliding tables for a hit at ``boundary``: nulls, then the cached pages holding
        rows [boundary-W+1, boundary); None when any page is missing."""
        tables = {}
        for g, spec, pool in self._sliding:
            first = first_live_slot(spec, boundary)
            table = [pool.null_block] * first
            for i in range(first, boundary // spec.block_tokens):
                block = pool.get_cached_block(slot_key(spec, chain, i))
                if block is None:
                    return None
                table.append(block)
            tables[g] = table
        return tables

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        req: KVRequest,
        num_new_tokens: int,
        num_computed_tokens: int,
        hit: HitBlocks | None = None,
    ) -> NewBlocks | None:
        """Blocks for writing tokens [num_computed, num_computed + num_new); all or nothing.

        ::

            positions  0 ...... L-W+1 ........ L ============== L+n        (L = num_computed)
            full       [ kept ................ )[ new ............)
            sliding    null ... [ window rows  )[ new ............)
                                ^ slot (L-W+1) // T: first slot a query of this step reads

        ``hit`` (from :meth:`get_computed_blocks`, first call only) starts the table.
        Returns None, changing nothing, when any group lacks free blocks.
        """
        state = self._states.get(req.request_id)
        if (  # the decode fast path (records.py): no commit work, no new block
            state is not None
            and state.num_computed_tokens <= num_computed_tokens < state.next_commit_event
            and 0 <= num_new_tokens <= state.capacity_tokens - num_computed_tokens
            and (hit is None or not hit.num_tokens)
        ):
            state.num_computed_tokens = num_computed_tokens
            return state.no_new_blocks or self._no_new_blocks(state)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if state is None:
            state = self._states[req.request_id] = self._new_state(req)
        first_call = not state.allocated
        if first_call:
            start = hit.num_tokens if hit is not None else 0
            if num_computed_tokens != start:
                raise ValueError(
                    f"first allocation of {req.request_id} must start at the hit ({start} "
                    f"tokens), got num_computed_tokens={num_computed_tokens}"
                )
            if hit is not None and hit.num_tokens:
                self._check_hit(state, hit)
                tables = [list(blocks) for blocks in hit.blocks]
            else:
                tables = [[] for _ in self.specs]
        else:
            if hit is not None and hit.num_tokens:
                raise ValueError("a prefix hit can only start a request's first allocation")
            if self.enable_fast_path and (
                state.num_computed_tokens <= num_computed_tokens < state.next_commit_event
            ):
                state.num_computed_tokens = num_computed_tokens  # no commit work (records.py)
            else:
                self._commit(req, state, num_computed_tokens)  # frees pages that left the window
            if self.enable_fast_path:
                end = num_computed_tokens + num_new_tokens
                new = self._grow(state, num_computed_tokens, end)
                req.kv_idle_until = idle_until(state)
                return new
            tables = state.block_tables

        end = num_computed_tokens + num_new_tokens
        plan = []  # (group, first slot to fill, number of new blocks)
        for g in range(len(self.specs)):
            spec, pool, table = self.specs[g], self.pools[g], tables[g]
            first = len(table)
            if spec.is_sliding:
                first = max(first, first_live_slot(spec, num_computed_tokens))
            num_new = max(0, -(-end // spec.block_tokens) - first)
            # Hit blocks sitting in the free queue stop being free when touched.
            num_touched = sum(b.ref_cnt == 0 for b in table) if first_call else 0
            if num_new + num_touched > pool.free_queue.num_free:
                return None
            plan.append((g, first, num_new))

        if first_call:
            for pool, table in zip(self.pools, tables, strict=True):
                pool.touch([b for b in table if b is not pool.null_block])
            state.allocated = True
            state.block_tables = tables
            state.num_computed_tokens = num_computed_tokens
            state.num_done_slots = [  # hit slots are hashed (full) or released (sliding)
                first_live_slot(s, num_computed_tokens) if s.is_sliding else len(t)
                for s, t in zip(self.specs, tables, strict=True)
            ]
            state.tentative_boundary = self._floor_align(num_computed_tokens)
            if self.enable_prefix_caching:  # counted once admitted, not per retried lookup
                self._num_queries += 1
                self._num_queried_tokens += len(req.all_token_ids)
                self._num_hit_tokens += num_computed_tokens
        offsets = (0,) * len(tables) if first_call else tuple(map(len, tables))
        block_ids = list(self._no_block_ids)
        for g, first, num_new in plan:
            pool, table = self.pools[g], tables[g]
            table.extend([pool.null_block] * (first - len(table)))
            new_blocks = pool.get_new_blocks(num_new)
            assert new_blocks is not None  # checked above
            table.extend(new_blocks)
            block_ids[g] = tuple([b.block_id for b in table[offsets[g] :]])
        if self.enable_fast_path:  # first call: later ones take _grow
            state.group_events = [0] * len(tables)
            self._update_events(state, self._groups)
            state.group_capacity = [
                len(t) * s.block_tokens for s, t in zip(self.specs, tables, strict=True)
            ]
            state.capacity_tokens = min(state.group_capacity)
            state.no_new_blocks = None  # built when first asked for (_no_new_blocks)
            req.kv_idle_until = idle_until(state)
        return NewBlocks(offsets, tuple(block_ids))

    def _grow(self, state: RequestState, num_computed_tokens: int, end: int) -> NewBlocks | None:
        """allocate_slots with the fast path, after the first call: only the groups whose
        tables end before ``end`` grow. The others neither grow nor pad (their live slots
        are below end / T), so their NewBlocks entry is an empty append."""
        if end <= state.capacity_tokens:
            return state.no_new_blocks or self._no_new_blocks(state)
        tables, capacity = state.block_tables, state.group_capacity
        # Usually one group (a decode step reaching the end of an 8-token csa_state page).
        growing = [g for g, group_capacity in enumerate(capacity) if group_capacity < end]
        plan = []  # (group, first slot to fill, number of new blocks)
        for g in growing:
            spec, first = self.specs[g], len(tables[g])
            if spec.window is not None:  # max(first, first_live_slot(spec, L)), inlined
                first = max(first, (num_computed_tokens - spec.window + 1) // spec.block_tokens)
            num_new = -(-end // spec.block_tokens) - first  # > 0: capacity < end
            if num_new > self.pools[g].free_queue.num_free:
                return None
            plan.append((g, first, num_new))
        offsets = tuple(map(len, tables))
        block_ids = list(self._no_block_ids)
        for g, first, num_new in plan:
            pool, table = self.pools[g], tables[g]
            if first > len(table):
                table.extend([pool.null_block] * (first - len(table)))
            table.extend(pool.get_new_blocks(num_new))
            block_ids[g] = tuple([b.block_id for b in table[offsets[g] :]])
            capacity[g] = len(table) * self.specs[g].block_tokens
        state.capacity_tokens = min(capacity)
        # Built when first asked for: the scheduler skips most calls that would return it.
        state.no_new_blocks = None
        return NewBlocks(offsets, tuple(block_ids))

    def _no_new_blocks(self, state: RequestState) -> NewBlocks:
        state.no_new_blocks = NewBlocks(tuple(map(len, state.block_tables)), self._no_block_ids)
        return state.no_new_blocks

    def commit(self, req: KVRequest, num_computed_tokens: int) -> None:
        """After a step: tokens [0, num_computed_tokens) have their KV in the cache."""
        state = self._states.get(req.request_id)
        if state is not None and (
            state.num_computed_tokens <= num_computed_tokens < state.next_commit_event
        ):
            state.num_computed_tokens = num_computed_tokens  # fast path: nothing to do yet
            return
        if state is None or not state.allocated:
            raise ValueError(f"request {req.request_id} holds no blocks")
        self._commit(req, state, num_computed_tokens)

    def free(self, req: KVRequest, num_computed_tokens: int | None = None) -> None:
        """Release every block of a finished, aborted or preempted request (idempotent).

        The finish checkpoint ``floor_A(num_computed)`` and all full history blocks stay
        cached, so the next turn (or the preempted request itself) can hit them. Each pool
        gets the table in reverse: the request's last blocks are evicted first.
        """
        state = self._states.pop(req.request_id, None)
        if state is None or not state.allocated:
            return
        if self.enable_fast_path:
            req.kv_idle_until = 0  # re-admitted (preempted) requests allocate first
        if num_computed_tokens is not None:
            self._commit(req, state, num_computed_tokens)
        if self.enable_prefix_caching:
            self._cache_checkpoint(state, self._floor_align(state.num_computed_tokens))
        for pool, table in zip(self.pools, state.block_tables, strict=True):
            pool.free([b for b in reversed(table) if b is not pool.null_block])

    # ---- helpers and queries -------------------------------------------------------------
    def _new_state(self, req: KVRequest) -> RequestState:
        return RequestState(BlockHashChain(self.granularity, req.cache_salt, self.hash_algo))

    def _check_hit(self, state: RequestState, hit: HitBlocks) -> None:
        # A hit is only valid until the next allocation may evict its blocks.
        if not self.enable_prefix_caching:
            raise ValueError("a prefix hit needs enable_prefix_caching=True")
        for spec, pool, blocks in zip(self.specs, self.pools, hit.blocks, strict=True):
            for i, block in enumerate(blocks):
                key = slot_key(spec, state.chain, i)
                if block is not pool.null_block and pool.get_cached_block(key) is not block:
                    raise RuntimeError(
                        "stale HitBlocks: call allocate_slots right after get_computed_blocks"
                    )

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

    def usage_by_group(self) -> dict[str, float]:
        return {spec.name: pool.usage for spec, pool in zip(self.specs, self.pools, strict=True)}

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_queries, self._num_queried_tokens, self._num_hit_tokens)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after a weight update); held blocks stay valid."""
        for pool in self.pools:
            pool.reset_prefix_cache()
