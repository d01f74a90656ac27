"""The hybrid KV cache manager: what each request holds in every cache group.

Bookkeeping only (block ids, reference counts, keys); the runner owns the tensors. A
request's block table of group g (block span T) maps slot i to token positions
``[i*T, (i+1)*T)``, absolute: a sliding group's table starts with null blocks for the pages
it has released. What stays findable after a request is freed (keys, state checkpoints,
lookups) is the prefix cache's business (prefix_cache.py).

Lifecycle, driven by the scheduler::

    num_hit, hit = get_computed_blocks(req)           # once, before the first allocation
    new = allocate_slots(req, n, num_hit, hit)        # None: cache full, nothing changed
    ... runner computes tokens [num_computed, num_computed + n) ...
    commit(req, num_computed + n)                     # key full blocks, release window pages
    ... allocate_slots / commit per step ...
    free(req)                                         # finished, aborted or preempted

A request whose KV arrives from outside (P/D transfer) is admitted with ``reserve`` instead
of the lookup and first allocation; nothing of it is keyed before its first ``commit``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from rackserve.kv.block_pool import BlockPool, KVCacheBlock
from rackserve.kv.hashing import BlockHashChain, check_hash_algo
from rackserve.kv.prefix_cache import Group, PrefixCache
from rackserve.kv.records import (
    HitBlocks,
    NewBlocks,
    PrefixCacheStats,
    RequestState,
    group_event,
    next_checkpoint_event,
)
from rackserve.kv.spec import CacheGroupSpec, hash_granularity

__all__ = ["HitBlocks", "KVCacheManager", "KVRequest", "NewBlocks", "PrefixCacheStats"]


class KVRequest(Protocol):
    """What the manager reads from a request (it writes nothing there)."""

    request_id: str
    all_token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    cache_salt: str | None


class KVCacheManager:
    """Block tables of every running request over all cache groups (one BlockPool each).

    ``idle_until[req_id]`` (read-only for callers; present while the request holds blocks)
    is a token count E such that ``allocate_slots(req, n, L)`` with ``n >= 1`` and
    ``L + n <= E`` returns an empty append and ``commit(req, L')`` with ``L' < E`` does
    nothing but record the count, so a scheduler may skip both calls (most decode steps).
    The count the manager keeps then lags, never past an A-boundary (the next checkpoint
    event bounds E), and what reads it sees the same: free() caches the finish checkpoint
    floor_A(count), and the next real commit's checkpoint range (previous, current] holds
    multiples of A only, none in between.
    """

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

    # ---- admission -----------------------------------------------------------------------
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
        if not self.enable_prefix_caching:
            return 0, HitBlocks(0, self._no_block_ids)
        if state is None:
            state = self._states[req.request_id] = self._new_state(req)
        state.chain.extend(req.all_token_ids)
        hit, state.divergence_boundary = self.prefix_cache.find(state.chain, len(req.all_token_ids))
        return hit.num_tokens, hit

    def reserve(
        self, req: KVRequest, num_tokens: int, max_chunk: int, hit: HitBlocks | None = None
    ) -> bool:
        """Blocks for a request whose first ``num_tokens`` tokens get their KV written from
        outside (P/D transfer, synthetic contexts), allocated ``max_chunk`` tokens at a time
        with window pages released as a prefill would; all or nothing (False: no room).
        ``hit`` (from :meth:`get_computed_blocks`) starts the table with cached blocks: only
        the blocks after it need writing (the P/D decode side asks for those only).

        Nothing of the request is keyed, so no other request can hit it, until its first
        :meth:`commit`: the scheduler commits only after a step has run on the KV, which the
        caller must have written before that step. Window pages released here were never
        keyed, so its first state checkpoint is the first A-boundary it computes past.
        """
        if num_tokens < 1 or max_chunk < 1:
            raise ValueError("num_tokens and max_chunk must be >= 1")
        state = self._states.get(req.request_id)
        if state is not None and state.allocated:
            raise ValueError(f"request {req.request_id} already holds blocks; free it first")
        done = hit.num_tokens if hit is not None else 0
        if done >= num_tokens:
            raise ValueError(f"the hit ({done} tokens) leaves nothing of {num_tokens} to reserve")
        if not done or state is None:  # a hit keeps the lookup's chain (verified on use)
            state = self._states[req.request_id] = self._new_state(req)
        state.kv_pending = True
        while done < num_tokens:
            num_new = min(max_chunk, num_tokens - done)
            first = hit if not state.allocated else None
            if self.allocate_slots(req, num_new, done, first) is None:
                self.free(req)
                return False
            done += num_new
            self._commit(req, state, done)  # keys nothing (kv_pending); releases pages
        return True

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
                                ^ first_live_slot(L): the first slot a query of this step reads

        ``hit`` (from :meth:`get_computed_blocks`, first call only) starts the table. Only
        groups whose table ends before L+n grow. Returns None, changing nothing, when any
        group lacks free blocks.
        """
        state = self._states.get(req.request_id)
        end = num_computed_tokens + num_new_tokens
        if (  # most decode steps: nothing to commit, and the tables already reach `end`
            state is not None
            and state.num_computed_tokens <= num_computed_tokens < state.next_commit_event
            and num_computed_tokens <= end <= state.capacity_tokens
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
            tables = [[] for _ in self.specs]
            if hit is not None and hit.num_tokens:
                if not self.enable_prefix_caching:
                    raise ValueError("a prefix hit needs enable_prefix_caching=True")
                self.prefix_cache.verify(state.chain, hit)
                tables = [list(blocks) for blocks in hit.blocks]
            capacity = [len(t) * s.block_tokens for s, t in zip(self.specs, tables, strict=True)]
        else:
            if hit is not None and hit.num_tokens:
                raise ValueError("a prefix hit can only start a request's first allocation")
            if state.num_computed_tokens <= num_computed_tokens < state.next_commit_event:
                state.num_computed_tokens = num_computed_tokens  # _commit would only do this
            else:
                self._commit(req, state, num_computed_tokens)  # frees pages left behind
            tables, capacity = state.block_tables, state.group_capacity

        # Every group on the first call; later only those whose table ends before `end`
        # (usually one: a decode step filling an 8-token csa_state page).
        groups = self._groups
        if not first_call:
            groups = [
                groups[g] for g, group_capacity in enumerate(capacity) if group_capacity < end
            ]
        plan = []  # (group, first slot to fill, number of new blocks)
        for g, spec, pool in groups:
            table, first = tables[g], len(tables[g])
            if spec.window is not None:
                first = max(first, spec.first_live_slot(num_computed_tokens))
            num_new = max(0, -(-end // spec.block_tokens) - first)
            # Hit blocks sitting in the free queue stop being free when touched.
            num_touched = sum(b.ref_cnt == 0 for b in table) if first_call else 0
            if num_new + num_touched > pool.free_queue.num_free:
                return None
            plan.append((g, first, num_new))

        if first_call:
            self._admit(req, state, tables, capacity, num_computed_tokens)
        elif not plan:  # the commit had work, but no group grows
            return state.no_new_blocks or self._no_new_blocks(state)
        offsets = (0,) * len(tables) if first_call else tuple(map(len, tables))
        block_ids = list(self._no_block_ids)
        for g, first, num_new in plan:
            pool, table = self.pools[g], tables[g]
            if first > len(table):
                table.extend([pool.null_block] * (first - len(table)))
            if num_new:
                table.extend(pool.get_new_blocks(num_new))
            block_ids[g] = tuple([b.block_id for b in table[offsets[g] :]])
            capacity[g] = len(table) * self.specs[g].block_tokens
        state.capacity_tokens = min(capacity)
        state.no_new_blocks = None  # built when first asked for (_no_new_blocks)
        if first_call:
            self._update_events(state, self._groups)
        self.idle_until[req.request_id] = min(state.next_commit_event, state.capacity_tokens)
        return NewBlocks(offsets, tuple(block_ids))

    def _admit(
        self,
        req: KVRequest,
        state: RequestState,
        tables: list[list],
        capacity: list[int],
        num_computed_tokens: int,
    ) -> None:
        """A request's first allocation succeeds: take the hit blocks, start its records."""
        for pool, table in zip(self.pools, tables, strict=True):
            pool.touch([b for b in table if b is not pool.null_block])
        state.allocated = True
        state.block_tables = tables
        state.group_capacity = capacity
        state.num_computed_tokens = num_computed_tokens
        state.num_done_slots = [  # hit slots are keyed (full) or released (sliding)
            s.first_live_slot(num_computed_tokens) if s.is_sliding else len(t)
            for s, t in zip(self.specs, tables, strict=True)
        ]
        state.group_events = [0] * len(tables)
        self.release_held(req)  # touched above: the request holds them now
        self.prefix_cache.set_tentative(state, self.prefix_cache.floor_align(num_computed_tokens))
        if self.enable_prefix_caching and not state.kv_pending:  # once admitted, not per lookup
            self._num_queries += 1
            self._num_queried_tokens += len(req.all_token_ids)
            self._num_hit_tokens += num_computed_tokens
            noted = self._pool_hit_tokens.get(req.request_id, 0)
            self._num_pool_hit_tokens += min(noted, num_computed_tokens)
        self._pool_hit_tokens.pop(req.request_id, None)

    def _no_new_blocks(self, state: RequestState) -> NewBlocks:
        state.no_new_blocks = NewBlocks(tuple(map(len, state.block_tables)), self._no_block_ids)
        return state.no_new_blocks

    # ---- commit --------------------------------------------------------------------------
    def commit(self, req: KVRequest, num_computed_tokens: int) -> None:
        """After a step: tokens [0, num_computed_tokens) have their KV in the cache."""
        state = self._states.get(req.request_id)
        if state is not None and (
            state.num_computed_tokens <= num_computed_tokens < state.next_commit_event
        ):
            state.num_computed_tokens = num_computed_tokens  # nothing to do yet (records.py)
            return
        if state is None or not state.allocated:
            raise ValueError(f"request {req.request_id} holds no blocks")
        state.kv_pending = False  # a step ran on it: the KV is in place
        self._commit(req, state, num_computed_tokens)

    def _commit(self, req: KVRequest, state: RequestState, num_computed_tokens: int) -> None:
        previous = state.num_computed_tokens
        if num_computed_tokens < previous:
            raise ValueError(
                f"num_computed_tokens went back from {previous} to {num_computed_tokens}"
            )
        state.num_computed_tokens = num_computed_tokens
        if num_computed_tokens < state.next_commit_event:
            return  # nothing to key, checkpoint or release yet
        events = state.group_events  # visit only the groups with work (records.py)
        full = [x for x in self._full if events[x[0]] <= num_computed_tokens]
        sliding = [x for x in self._sliding if events[x[0]] <= num_computed_tokens]
        caching = self.enable_prefix_caching and not state.kv_pending
        if caching and num_computed_tokens > previous:
            # Checkpoint boundaries (chosen ones and the provisional finish boundary, which
            # is floor_A(previous) until here) are multiples of A: none without a new one.
            crossed = num_computed_tokens // self.alignment != previous // self.alignment
            if full or crossed:
                # Only keys need the chain: hashed here in one go, not a chunk per small
                # sliding-page event (a window page needing a key extends it itself).
                state.chain.extend(req.all_token_ids)
                self.prefix_cache.cache_full_blocks(state, full)
            if crossed:
                self.prefix_cache.move_checkpoints(req, state, previous)
        self._release_window(req, state, sliding, caching)
        self._update_events(state, full + sliding if full else sliding)
        self.idle_until[req.request_id] = min(state.next_commit_event, state.capacity_tokens)

    def _release_window(
        self, req: KVRequest, state: RequestState, groups: list[Group], caching: bool
    ) -> None:
        """Free sliding pages no future query reads (entirely below L - W + 1).

        ::

            positions   ......[ B-W+1 ...... B)........[ L-W+1 ....... L)
            pages       free  | checkpoint B  |  free  |  kept (window)  |
                        head  | tail (cached) |  head  |                 |
        """
        for group in groups:
            g, spec, pool = group
            table, null = state.block_tables[g], pool.null_block
            start = state.num_done_slots[g]
            stop = min(spec.first_live_slot(state.num_computed_tokens), len(table))
            # Slots holding rows [B-W+1, B) of the provisional finish checkpoint B.
            first_latest, stop_latest = state.tentative_slots[g] if caching else (0, 0)
            released = []
            for i in range(start, stop):
                block, table[i] = table[i], null
                if block is null:
                    continue
                if first_latest <= i < stop_latest and block.block_hash is None:
                    if state.chain.num_tokens < (i + 1) * spec.block_tokens:  # lazily extended
                        state.chain.extend(req.all_token_ids)
                    self.prefix_cache.cache_tentative(state, group, i, block)
                released.append(block)
            state.num_done_slots[g] = max(start, stop)
            pool.free(released)

    def _update_events(self, state: RequestState, groups: list[Group]) -> None:
        """Recompute the events of ``groups`` (whose num_done_slots moved)."""
        caching = self.enable_prefix_caching
        for g, spec, _ in groups:
            state.group_events[g] = group_event(spec, state.num_done_slots[g], caching)
        state.next_commit_event = min(state.group_events)
        if caching:
            state.next_commit_event = min(
                state.next_commit_event,
                next_checkpoint_event(state.num_computed_tokens, self.alignment),
            )

    # ---- release -------------------------------------------------------------------------
    def free(self, req: KVRequest, num_computed_tokens: int | None = None) -> None:
        """Release every block of a finished, aborted or preempted request (idempotent).

        The finish checkpoint ``floor_A(num_computed)`` and all full history blocks stay
        cached, so the next turn (or the preempted request itself) can hit them. Each pool
        gets the table in reverse: the request's last blocks are evicted first.
        """
        self.release_held(req)
        self._pool_hit_tokens.pop(req.request_id, None)
        state = self._states.pop(req.request_id, None)
        self.idle_until.pop(req.request_id, None)
        if state is None or not state.allocated:
            return
        if num_computed_tokens is not None:
            state.kv_pending = False  # a final count: computed, so in place
            self._commit(req, state, num_computed_tokens)
        if self.enable_prefix_caching and not state.kv_pending:
            finish = self.prefix_cache.floor_align(state.num_computed_tokens)
            self.prefix_cache.cache_checkpoint(state, finish)
        for pool, table in zip(self.pools, state.block_tables, strict=True):
            pool.free([b for b in reversed(table) if b is not pool.null_block])

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

    def lookup_chain(self, req: KVRequest) -> BlockHashChain | None:
        """The hash chain of a request looked up (get_computed_blocks) and not yet freed."""
        state = self._states.get(req.request_id)
        return None if state is None else state.chain

    # ---- queries -------------------------------------------------------------------------
    def _new_state(self, req: KVRequest) -> RequestState:
        return RequestState(BlockHashChain(self.granularity, req.cache_salt, self.hash_algo))

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
