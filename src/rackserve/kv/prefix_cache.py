"""The prefix cache: which blocks carry a key, where state checkpoints go, and lookups.

The manager (manager.py) owns what each request holds; this class owns what stays findable
after it is freed. A prefix hit of B tokens needs every full-history block of [0, B) and a
state checkpoint at B: the sliding rows ``[B-W+1, B)`` of every sliding group, cached as
pages of their own. Checkpoints are kept only at chosen boundaries (all multiples of the
alignment A):

- the prompt end ``floor_A(num_prompt_tokens)``, and ``floor_A(num_prompt_tokens - 1)``,
  where a repeat of the same prompt looks (a lookup stops at ``len - 1``: at least one token
  is computed for the logits);
- the divergence point, where a request's chain leaves the cached history (a shared
  system prompt), so the next request with that prefix hits it;
- every ``checkpoint_interval`` tokens of a long prompt;
- the finish boundary ``floor_A(num_computed)``, unknown until the request ends: the latest
  A-boundary is cached provisionally (tentative) when its pages leave the window and
  demoted to transient once the request passes the next one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from rackserve.kv.block_pool import BlockPool, KVCacheBlock
from rackserve.kv.hashing import BlockHashChain
from rackserve.kv.records import HitBlocks, RequestState, slot_key
from rackserve.kv.spec import CacheGroupSpec, prefix_alignment

Group = tuple[int, CacheGroupSpec, BlockPool]  # (index in spec order, spec, its pool)


class PromptRequest(Protocol):
    num_prompt_tokens: int


class PrefixCache:
    """Keys and checkpoints over the pools of all cache groups (spec order)."""

    def __init__(
        self,
        specs: Sequence[CacheGroupSpec],
        pools: Sequence[BlockPool],
        checkpoint_interval: int | None,
    ) -> None:
        self.specs = tuple(specs)
        self.pools = tuple(pools)
        self.alignment = prefix_alignment(self.specs)  # A
        if checkpoint_interval is not None and (
            checkpoint_interval <= 0 or checkpoint_interval % self.alignment
        ):
            raise ValueError(
                f"checkpoint_interval must be a positive multiple of the prefix alignment "
                f"{self.alignment}, got {checkpoint_interval}"
            )
        self.checkpoint_interval = checkpoint_interval
        groups = [(g, s, self.pools[g]) for g, s in enumerate(self.specs)]
        self.sliding: list[Group] = [x for x in groups if x[1].is_sliding]
        self.full: list[Group] = [x for x in groups if not x[1].is_sliding]

    def floor_align(self, num_tokens: int) -> int:
        return num_tokens // self.alignment * self.alignment

    # ---- lookup ----------------------------------------------------------------------------
    def find(self, chain: BlockHashChain, num_tokens: int) -> tuple[HitBlocks, int]:
        """The longest hit B <= floor_A(num_tokens - 1) and the divergence boundary (where
        the cached history ends). ``chain`` covers the request's known tokens."""
        limit = self.floor_align(max(0, num_tokens - 1))
        history: dict[int, list[KVCacheBlock]] = {}
        for g, spec, pool in self.full:
            history[g] = blocks = []
            while (len(blocks) + 1) * spec.block_tokens <= limit:
                block = pool.get_cached_block(slot_key(spec, chain, len(blocks)))
                if block is None:
                    break
                blocks.append(block)
            limit = self.floor_align(min(limit, len(blocks) * spec.block_tokens))
        # Longest first: an evicted checkpoint falls back to the previous boundary with one.
        for boundary in range(limit, 0, -self.alignment):
            sliding = self._find_checkpoint(chain, boundary)
            if sliding is None:
                continue
            tables = tuple(
                tuple(sliding[g] if s.is_sliding else history[g][: boundary // s.block_tokens])
                for g, s in enumerate(self.specs)
            )
            return HitBlocks(boundary, tables), limit
        return HitBlocks(0, tuple(() for _ in self.specs)), limit

    def _find_checkpoint(
        self, chain: BlockHashChain, boundary: int
    ) -> dict[int, list[KVCacheBlock]] | None:
        """Sliding tables for a hit at ``boundary``: nulls, then the cached pages holding
        rows [boundary-W+1, boundary); None when any page is missing."""
        tables = {}
        for g, spec, pool in self.sliding:
            first = spec.first_live_slot(boundary)
            table = [pool.null_block] * first
            for i in range(first, boundary // spec.block_tokens):
                block = pool.get_cached_block(slot_key(spec, chain, i))
                if block is None:
                    return None
                table.append(block)
            tables[g] = table
        return tables

    def verify(self, chain: BlockHashChain, hit: HitBlocks) -> None:
        """A hit is only valid until the next allocation may evict its blocks."""
        for spec, pool, blocks in zip(self.specs, self.pools, hit.blocks, strict=True):
            for i, block in enumerate(blocks):
                key = slot_key(spec, chain, i)
                if block is not pool.null_block and pool.get_cached_block(key) is not block:
                    raise RuntimeError(
                        "stale HitBlocks: call allocate_slots right after get_computed_blocks"
                    )

    # ---- caching ---------------------------------------------------------------------------
    def cache_full_blocks(self, state: RequestState, groups: Iterable[Group]) -> None:
        """Key the full-history blocks that filled up since the last call."""
        for g, spec, pool in groups:
            table = state.block_tables[g]
            num_full = min(state.num_computed_tokens // spec.block_tokens, len(table))
            for i in range(state.num_done_slots[g], num_full):
                pool.cache_block(table[i], slot_key(spec, state.chain, i))
            state.num_done_slots[g] = max(state.num_done_slots[g], num_full)

    def cache_checkpoint(self, state: RequestState, boundary: int) -> None:
        """Key the held sliding pages with rows [boundary-W+1, boundary)."""
        if boundary <= 0:
            return
        for g, spec, pool in self.sliding:
            table = state.block_tables[g]
            stop = min(boundary // spec.block_tokens, len(table))
            for i in range(spec.first_live_slot(boundary), stop):
                if table[i] is not pool.null_block and table[i].block_hash is None:
                    pool.cache_block(table[i], slot_key(spec, state.chain, i))

    def cache_tentative(
        self, state: RequestState, group: Group, slot: int, block: KVCacheBlock
    ) -> None:
        """Key a page leaving the window that holds rows of the latest A-boundary's
        checkpoint (the provisional finish checkpoint)."""
        _, spec, pool = group
        key = slot_key(spec, state.chain, slot)
        if block.block_hash is None and pool.cache_block(block, key):
            state.tentative_blocks.append((pool, block, key))

    def move_checkpoints(self, req: PromptRequest, state: RequestState, previous: int) -> None:
        """The count went from ``previous`` past an A-boundary: cache the chosen boundaries
        reached, and make the superseded provisional finish checkpoint transient."""
        current = state.num_computed_tokens
        for boundary in self._chosen_boundaries(req, state, previous, current):
            self.cache_checkpoint(state, boundary)
        latest = self.floor_align(current)
        if latest != state.tentative_boundary:
            for pool, block, key in state.tentative_blocks:
                if block.block_hash == key:
                    pool.uncache_free_block(block)
            state.tentative_blocks.clear()
            self.set_tentative(state, latest)

    def set_tentative(self, state: RequestState, boundary: int) -> None:
        """The provisional finish checkpoint moves to ``boundary`` (a multiple of A)."""
        state.tentative_boundary = boundary
        state.tentative_slots = [
            (s.first_live_slot(boundary), boundary // s.block_tokens) if s.is_sliding else (0, 0)
            for s in self.specs
        ]

    def _chosen_boundaries(
        self, req: PromptRequest, state: RequestState, previous: int, current: int
    ) -> list[int]:
        """Checkpoint boundaries reached in (previous, current]."""
        num_prompt = req.num_prompt_tokens
        chosen = {
            self.floor_align(num_prompt),
            self.floor_align(num_prompt - 1),  # where a repeat of this prompt looks
            state.divergence_boundary,
        }
        boundaries = [b for b in chosen if previous < b <= current]
        if self.checkpoint_interval is not None:
            interval = self.checkpoint_interval
            stop = min(current, num_prompt)
            boundaries += range((previous // interval + 1) * interval, stop + 1, interval)
        return boundaries

    def reset(self) -> None:
        """Forget every key (held blocks stay valid)."""
        for pool in self.pools:
            pool.reset_prefix_cache()
