"""The KV cache manager's commit and release: what changes after a step and at the end.

``KVManagerCommit`` keys the full blocks a step completed, moves state checkpoints, frees
the sliding pages no future query reads, recomputes a request's commit events (when it
next has work: records.py) and frees a finished, aborted or preempted request's blocks.
"""

from __future__ import annotations

from rackserve.kv.manager_state import KVManagerState, KVRequest
from rackserve.kv.prefix_cache import Group
from rackserve.kv.records import RequestState, group_event, next_checkpoint_event

__all__ = ["KVManagerCommit"]


class KVManagerCommit(KVManagerState):
    """Commits and release of the manager (``KVCacheManager`` is built on it: manager.py)."""

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
