"""The KV cache manager's records: what it hands out (HitBlocks, NewBlocks, PrefixCacheStats),
what it keeps per request (RequestState), and when a request's next commit has work to do.

A decode step grows a request by one token, and almost every such step changes nothing in
the manager: a full-history group keys a block only when one fills up, a sliding group
releases a page only when it leaves the window, and checkpoints sit at a few chosen
boundaries. The smallest V4 block is 8 tokens, so at least 7 steps in 8 are no-ops.
The manager keeps, per request and group, the first token count at which a commit has
work there (:func:`group_event`, :func:`next_checkpoint_event`); below the least of them
(and within the tables' capacity) commits and allocations only record the count, and at an
event only the groups that have one are visited::

    committed L ----------------------------------> next event E
    full g:     (num_done_slots[g] + 1) * T          the next block to key is full
    sliding g:  spec.release_point(num_done_slots[g]) the next page leaves the window
    caching:    the next multiple of A above L       a checkpoint boundary
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from rackserve.kv.block_pool import BlockPool, KVCacheBlock
from rackserve.kv.hashing import BlockHashChain, BlockKey, block_key
from rackserve.kv.spec import CacheGroupSpec

# A token count no request reaches: the event of a group that never has commit work.
NEVER = 1 << 62


@dataclass(frozen=True)
class HitBlocks:
    """A prefix hit of ``num_tokens`` tokens: per group (spec order), the block table prefix
    covering ``[0, num_tokens)``, null blocks where a sliding group needs no rows."""

    num_tokens: int
    blocks: tuple[tuple[KVCacheBlock, ...], ...]


class NewBlocks(NamedTuple):  # immutable, and built 3x faster than a frozen dataclass
    """Per group (spec order): the block table slot ``offsets[g]`` from which ``block_ids[g]``
    are to be written. Offset 0 on a request's first allocation (its whole table, hit and
    null blocks included); afterwards the current table length (append)."""

    offsets: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counted when a request is admitted (its first allocate_slots succeeds)."""

    num_queries: int  # admitted requests (a preempted one counts again on re-admission)
    num_queried_tokens: int
    num_hit_tokens: int
    num_pool_hit_tokens: int = 0  # of num_hit_tokens, loaded back from the host KV pool

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


@dataclass(eq=False, slots=True)  # slots: read per request per step, keep it compact
class RequestState:
    chain: BlockHashChain  # extended only when prefix caching is on
    allocated: bool = False
    block_tables: list[list[KVCacheBlock]] = field(default_factory=list)
    num_computed_tokens: int = 0  # as of the last commit
    # Full groups: leading slots already hashed. Sliding groups: leading slots released.
    num_done_slots: list[int] = field(default_factory=list)
    tentative_boundary: int = 0
    # Per group, the slots [first, stop) holding rows of the tentative checkpoint (sliding
    # groups; (0, 0) elsewhere): kept with the boundary, read by every page release.
    tentative_slots: list[tuple[int, int]] = field(default_factory=list)
    tentative_blocks: list[tuple[BlockPool, KVCacheBlock, BlockKey]] = field(default_factory=list)
    # Where this request's chain leaves the cached history without a checkpoint there (a
    # shared system prompt): it checkpoints that boundary so the next request hits it.
    divergence_boundary: int = 0
    # KV written from outside (KVCacheManager.reserve) and not yet known to be in place:
    # nothing of this request is keyed until its first commit().
    kv_pending: bool = False
    # A commit to fewer than `next_commit_event` tokens only records the count; an
    # allocation ending within `capacity_tokens` needs no block and returns `no_new_blocks`,
    # the NewBlocks of an empty append (None until asked).
    group_events: list[int] = field(default_factory=list)  # group_event() per group
    next_commit_event: int = 0  # min(group_events, next_checkpoint_event)
    group_capacity: list[int] = field(default_factory=list)  # len(table) * T per group
    capacity_tokens: int = 0  # min(group_capacity)
    no_new_blocks: NewBlocks | None = None


def group_event(spec: CacheGroupSpec, num_done_slots: int, enable_prefix_caching: bool) -> int:
    """The least committed token count L at which a commit has work in this group, given
    its ``num_done_slots``. Conservative: the table length is ignored, so growing the table
    later never makes it wrong.

    - full group: keys slots [num_done, min(L // T, len(table))), empty while
      L < (num_done + 1) * T (and never without prefix caching);
    - sliding group: releases slots [num_done, min(first_live_slot(L), len(table))), empty
      while L < release_point(num_done).
    """
    if spec.window is not None:
        return spec.release_point(num_done_slots)
    return (num_done_slots + 1) * spec.block_tokens if enable_prefix_caching else NEVER


def next_checkpoint_event(num_computed_tokens: int, alignment: int) -> int:
    """With prefix caching, the least L at which a commit moves checkpoints. The chosen
    boundaries (prompt end, divergence point, every checkpoint_interval) and the provisional
    finish boundary floor_A(L) are all multiples of A: none is reached before the next
    multiple of A. The hash chain is extended lazily by the next full commit; a free() in
    between only needs hashes up to floor_A(L), which the last full commit (or the prefix
    lookup) covered."""
    return (num_computed_tokens // alignment + 1) * alignment


def slot_key(spec: CacheGroupSpec, chain: BlockHashChain, slot: int) -> BlockKey:
    """Cache key of block table slot ``slot``: the prefix hash at the block's end."""
    return block_key(spec.name, chain, (slot + 1) * spec.block_tokens)
