"""The block pool of one cache group: reference counts, an LRU free queue and the prefix map.

Blocks live in a doubly linked free queue (links stored on the blocks, so ``remove`` is O(1)).
Allocation pops from the head. Freed blocks that carry a prefix-cache key go to the tail (kept
longest, evicted in LRU order); freed blocks without one (transient window pages, partial
blocks) go to the head, so they are reused before any cached block is evicted.

::

    head -> [transient ...][cached, least recently freed ... most recently freed] <- tail
            reused first    evicted in this order
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from rackserve.kv.hashing import BlockKey


class BlockEventKind(Enum):
    STORED = "stored"  # a block got a key: findable
    EVICTED = "evicted"  # a free cached block was handed out: its rows stay intact until
    #                      the next forward writes to it (the host KV pool copies them first)
    REMOVED = "removed"  # a free cached block was demoted to transient (rows superseded)
    CLEARED = "cleared"  # every key dropped (reset)


class BlockEvent(NamedTuple):
    """What happened to a key of this pool (recorded only with ``record_events``)."""

    kind: BlockEventKind
    key: BlockKey | None = None
    block_id: int = 0


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One block of a cache group. Identity matters (``eq=False``): ids are unique per pool."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockKey | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly linked queue of free blocks; every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head
        if block is None:
            raise IndexError("no free blocks")
        # remove(block) for the head, inlined: a decode step's allocations all come here
        self._head = nxt = block.next_free
        if nxt is None:
            self._tail = None
        else:
            nxt.prev_free = None
            block.next_free = None
        self.num_free -= 1
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None and self._head is not block:
            raise ValueError(f"{block} is not in the free queue")
        if prev is None:
            self._head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Insert at the tail (evicted last)."""
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Insert at the head (handed out next)."""
        block.prev_free, block.next_free = None, self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head to tail (O(n); for tests and debugging)."""
        block = self._head
        while block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """``num_blocks`` blocks of one cache group; block 0 is the null block.

    The null block is never handed out: a request's block table holds it in the slots of
    sliding-window pages it has released.
    """

    def __init__(self, num_blocks: int, record_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs >= 2 blocks (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # held forever, so it never enters the free queue
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self._cached: dict[BlockKey, KVCacheBlock] = {}
        # Key changes in order, drained by take_events() (KV events, host KV pool).
        self.events: list[BlockEvent] | None = [] if record_events else None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Pop ``num_blocks`` blocks from the head (ref 1 each); ``None`` if too few are free."""
        if num_blocks > self.free_queue.num_free:
            return None
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict: its content is about to be overwritten
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.append(
                        BlockEvent(BlockEventKind.EVICTED, block.block_hash, block.block_id)
                    )
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop a reference. Blocks reaching 0 return to the queue, the first passed nearest
        the head: cached blocks at the tail (first passed is evicted first), the others at
        the head (first passed is reused first)."""
        transient = []
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"cannot free {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    transient.append(block)
                else:
                    self.free_queue.append(block)
        for block in reversed(transient):
            self.free_queue.appendleft(block)

    def cache_block(self, block: KVCacheBlock, key: BlockKey) -> bool:
        """Register ``block`` under ``key``. Returns False (block left unregistered) when
        another block already holds the key; the duplicate is then freed as transient."""
        if block.block_hash is not None:
            if block.block_hash != key:
                raise ValueError(f"{block} is already cached under another key")
            return False
        if key in self._cached:
            return False
        self._cached[key] = block
        block.block_hash = key
        if self.events is not None:
            self.events.append(BlockEvent(BlockEventKind.STORED, key, block.block_id))
        return True

    def get_cached_block(self, key: BlockKey) -> KVCacheBlock | None:
        return self._cached.get(key)

    def uncache_free_block(self, block: KVCacheBlock) -> bool:
        """Demote a free cached block to transient (drop its key, move it to the head).
        Returns False, changing nothing, when the block is held or not cached."""
        if block.ref_cnt != 0 or block.block_hash is None:
            return False
        del self._cached[block.block_hash]
        if self.events is not None:
            self.events.append(BlockEvent(BlockEventKind.REMOVED, block.block_hash, block.block_id))
        block.block_hash = None
        self.free_queue.remove(block)
        self.free_queue.appendleft(block)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every key (held blocks keep working); returns how many were dropped."""
        for block in self._cached.values():
            block.block_hash = None
        num_dropped = len(self._cached)
        self._cached.clear()
        if self.events is not None:
            self.events.append(BlockEvent(BlockEventKind.CLEARED))
        return num_dropped

    def take_events(self) -> list[BlockEvent]:
        """The events recorded since the last call, oldest first (empty when not recording)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events
