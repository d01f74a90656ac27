"""What a commit does to a request's tables, apart from the manager's public lifecycle
(manager.py): hash the full-history blocks that filled up, move the sliding groups' state
checkpoints, release the window pages no query reads any more, and recompute the request's
fast-path events (records.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from rackserve.kv.block_pool import BlockPool
from rackserve.kv.records import (
    RequestState,
    first_live_slot,
    group_event,
    idle_until,
    next_checkpoint_event,
    slot_key,
)
from rackserve.kv.spec import CacheGroupSpec

if TYPE_CHECKING:
    from rackserve.kv.manager import KVRequest

Group = tuple[int, CacheGroupSpec, BlockPool]  # (index in spec order, spec, its pool)


class CommitMixin:
    """The commit internals of :class:`~rackserve.kv.manager.KVCacheManager`, which sets
    these attributes in its constructor."""

    alignment: int  # A
    checkpoint_interval: int | None
    enable_prefix_caching: bool
    enable_fast_path: bool
    _full: list[Group]
    _sliding: list[Group]

    def _commit(self, req: KVRequest, state: RequestState, num_computed_tokens: int) -> None:
        previous = state.num_computed_tokens
        if num_computed_tokens < previous:
            raise ValueError(
                f"num_computed_tokens went back from {previous} to {num_computed_tokens}"
            )
        state.num_computed_tokens = num_computed_tokens
        if num_computed_tokens < state.next_commit_event:
            return  # nothing to hash, checkpoint or release yet (0 when the fast path is off)
        full, sliding = self._full, self._sliding
        if self.enable_fast_path:  # visit only the groups with work (records.py)
            events = state.group_events
            full = [x for x in full if events[x[0]] <= num_computed_tokens]
            sliding = [x for x in sliding if events[x[0]] <= num_computed_tokens]
        if self.enable_prefix_caching and num_computed_tokens > previous:
            # Checkpoint boundaries (chosen ones and the provisional finish boundary, which
            # is floor_A(previous) until here) are multiples of A: none without a new one.
            crossed = num_computed_tokens // self.alignment != previous // self.alignment
            if full or crossed:
                # Only keys need the chain: hashed here in one go, not a chunk per small
                # sliding-page event (a window page needing a key extends it itself).
                state.chain.extend(req.all_token_ids)
                self._cache_full_blocks(state, full)
            if crossed:
                self._move_checkpoints(req, state, previous)
        self._release_window(req, state, sliding)
        if self.enable_fast_path:
            self._update_events(state, full + sliding if full else sliding)
            req.kv_idle_until = idle_until(state)  # the scheduler's skip bound

    def _update_events(self, state: RequestState, groups: Iterable[Group]) -> None:
        """Recompute the fast-path events of ``groups`` (whose num_done_slots moved)."""
        caching = self.enable_prefix_caching
        for g, spec, _ in groups:
            state.group_events[g] = group_event(spec, state.num_done_slots[g], caching)
        state.next_commit_event = min(state.group_events)
        if caching:
            state.next_commit_event = min(
                state.next_commit_event,
                next_checkpoint_event(state.num_computed_tokens, self.alignment),
            )

    def _move_checkpoints(self, req: KVRequest, state: RequestState, previous: int) -> None:
        current = state.num_computed_tokens
        for boundary in self._chosen_boundaries(req, state, previous, current):
            self._cache_checkpoint(state, boundary)
        latest = self._floor_align(current)
        if latest != state.tentative_boundary:
            # The previous provisional finish checkpoint is superseded: make it transient.
            for pool, block, key in state.tentative_blocks:
                if block.block_hash == key:
                    pool.uncache_free_block(block)
            state.tentative_blocks.clear()
            state.tentative_boundary = latest

    def _chosen_boundaries(
        self, req: KVRequest, state: RequestState, previous: int, current: int
    ) -> list[int]:
        """Checkpoint boundaries reached in (previous, current]."""
        prompt_end = self._floor_align(req.num_prompt_tokens)
        boundaries = [b for b in {prompt_end, state.divergence_boundary} if previous < b <= current]
        if self.checkpoint_interval is not None:
            interval = self.checkpoint_interval
            stop = min(current, req.num_prompt_tokens)
            boundaries += range((previous // interval + 1) * interval, stop + 1, interval)
        return boundaries

    def _cache_full_blocks(self, state: RequestState, groups: Iterable[Group]) -> None:
        for g, spec, pool in groups:
            table = state.block_tables[g]
            num_full = min(state.num_computed_tokens // spec.block_tokens, len(table))
            for i in range(state.num_done_slots[g], num_full):
                pool.cache_block(table[i], slot_key(spec, state.chain, i))
            state.num_done_slots[g] = max(state.num_done_slots[g], num_full)

    def _cache_checkpoint(self, state: RequestState, boundary: int) -> None:
        """Hash the held sliding pages with rows [boundary-W+1, boundary)."""
        if boundary <= 0:
            return
        for g, spec, pool in self._sliding:
            table = state.block_tables[g]
            stop = min(boundary // spec.block_tokens, len(table))
            for i in range(first_live_slot(spec, boundary), stop):
                if table[i] is not pool.null_block and table[i].block_hash is None:
                    pool.cache_block(table[i], slot_key(spec, state.chain, i))

    def _release_window(
        self,
        req: KVRequest,
        state: RequestState,
        groups: Iterable[Group],
    ) -> None:
        """Free sliding pages no future query reads (entirely below L - W + 1).

        ::

            positions   ......[ B-W+1 ...... B)........[ L-W+1 ....... L)
            pages       free  | checkpoint B  |  free  |  kept (window)  |
                        head  | tail (cached) |  head  |                 |
        """
        latest = state.tentative_boundary if self.enable_prefix_caching else 0
        num_computed_tokens = state.num_computed_tokens
        for g, spec, pool in groups:
            table, span, null = state.block_tables[g], spec.block_tokens, pool.null_block
            start = state.num_done_slots[g]
            # min(first_live_slot(spec, L), len(table)), inlined: a decode step's hot path
            stop = min(max(0, num_computed_tokens - spec.window + 1) // span, len(table))
            released = []
            for i in range(start, stop):
                block, table[i] = table[i], null
                if block is null:
                    continue
                overlaps_latest = i * span < latest and (i + 1) * span > latest - spec.window + 1
                if overlaps_latest and block.block_hash is None:
                    if state.chain.num_tokens < (i + 1) * span:  # extended lazily (_commit)
                        state.chain.extend(req.all_token_ids)
                    key = slot_key(spec, state.chain, i)
                    if pool.cache_block(block, key):
                        state.tentative_blocks.append((pool, block, key))
                released.append(block)
            state.num_done_slots[g] = max(start, stop)
            pool.free(released)

    def _floor_align(self, num_tokens: int) -> int:
        return num_tokens // self.alignment * self.alignment
