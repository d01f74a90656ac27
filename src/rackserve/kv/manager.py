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

The class is assembled from three modules: ``kv/manager_state.py`` (its state, held blocks
and queries), ``kv/manager_commit.py`` (``commit``, window release, ``free``) and this one
(admission and allocation).
"""

from __future__ import annotations

from rackserve.kv.manager_commit import KVManagerCommit
from rackserve.kv.manager_state import KVRequest
from rackserve.kv.records import HitBlocks, NewBlocks, PrefixCacheStats, RequestState

__all__ = ["HitBlocks", "KVCacheManager", "KVRequest", "NewBlocks", "PrefixCacheStats"]


class KVCacheManager(KVManagerCommit):
    """Block tables of every running request over all cache groups (one BlockPool each).

    ``idle_until[req_id]`` (read-only for callers; present while the request holds blocks)
    is a token count E such that ``allocate_slots(req, n, L)`` with ``n >= 1`` and
    ``L + n <= E`` returns an empty append and ``commit(req, L')`` with ``L' < E`` does
    nothing but record the count, so a scheduler may skip both calls (most decode steps).
    The count the manager keeps then lags, never past an A-boundary (the next checkpoint
    event bounds E), and what reads it sees the same: free() caches the finish checkpoint
    floor_A(count), and the next real commit's checkpoint range (previous, current] holds
    multiples of A only, none in between.

    The constructor is ``KVManagerState.__init__`` (manager_state.py).
    """

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
