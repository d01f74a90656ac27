"""The engine side of the host KV pool: evicted blocks out, pool hits back in.

Offload: when the device cache hands out a free cached block of a full-history group (an
eviction, recorded by the block pool), the engine core calls :meth:`KVOffloader.offload`
after scheduling and before the forward that overwrites it: its rows are gathered into a
fresh host tensor (on a GPU: pinned, copied on a side stream while the forward runs) and a
worker thread stores them in the pool. State checkpoint pages (sliding groups) are copied
when keyed (write-through).

Load: a waiting request whose hit grows with the pool (plan.py) is parked
(``WAITING_FOR_POOL_KV``) by :meth:`start_load`: the device blocks of the hit are held, new
blocks are taken for the missing ones and the worker fetches their bytes (on a GPU, and
copies them to the device on the side stream; an event says when they are there). A later
:meth:`take_loaded` (the scheduler, at the start of a step, before any forward) writes
them into the new blocks, keys them and hands the request back to the waiting queue,
whose next lookup finds the whole hit on the device::

    engine thread:  schedule [take_loaded | start_load] -> offload -> forward
    load thread:                   fetch (-> H2D) ----->
    store thread:                                     (D2H ->) store -------->
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from rackserve.kv.block_pool import BlockEvent, BlockEventKind, KVCacheBlock
from rackserve.kv.events import BlockRemoved, BlockStored, KVEvent
from rackserve.kv.hashing import BlockKey
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.offload.blocks import gather_blocks, scatter_blocks
from rackserve.kv.offload.plan import plan_pool_hit
from rackserve.kv.offload.pool import KVPool, pool_key
from rackserve.model.batch import KVCacheTensors
from rackserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# Loads of one request before it falls back to recompute (landed blocks can be evicted by
# other requests' allocations before its admission when the cache is full).
MAX_LOAD_ATTEMPTS = 3
POOL_RETRY_S = 5  # after a failed lookup (a pool server gone), lookups skip the pool this long


class LoadStart(enum.Enum):
    NONE = "none"  # nothing to load: admit with the device hit
    STARTED = "started"  # parked while blocks load
    NO_ROOM = "no_room"  # the pool has more, the device no free blocks for it yet


@dataclass(frozen=True)
class OffloadStats:
    """Cumulative counts (blocks, bytes) and the pool's fill; the pool tier's hit tokens
    are the KV manager's (PrefixCacheStats.num_pool_hit_tokens, counted at admission)."""

    num_blocks_offloaded: int = 0
    num_blocks_loaded: int = 0
    bytes_offloaded: int = 0
    bytes_loaded: int = 0
    pool_used_bytes: int = 0
    pool_capacity_bytes: int = 0


@dataclass(eq=False)
class _Load:
    req: Request
    previous_status: RequestStatus
    device_hit: int  # the hit before loading
    num_tokens: int  # the hit once loaded
    # per group: (new device block, its key), in slot order
    blocks: list[list[tuple[KVCacheBlock, BlockKey]]]
    result: Future = field(default_factory=Future)
    landed: bool = False
    attempt: int = 0  # loads of this request before this one (since its last admission)


class KVOffloader:
    """Moves blocks between one engine's device cache and a host pool (in-process or a
    shared server); only the engine thread calls its methods."""

    def __init__(
        self,
        kv: KVCacheManager,
        caches: KVCacheTensors,
        pool: KVPool,
        namespace: bytes,
        anchor_group: str | None = None,
    ) -> None:
        if not kv.enable_prefix_caching:
            raise ValueError("the KV pool keeps prefix-cache blocks: enable prefix caching")
        self.kv, self.caches, self.pool = kv, caches, pool
        self.namespace = namespace
        self.device = next(iter(next(iter(caches.tensors.values())).values())).device
        # On a GPU: pinned host buffers and copies on a side stream (an event says when
        # one is done), so neither direction stalls the engine thread or the forward.
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Pool events are published for the anchor group's blocks only (kv/events.py).
        names = [spec.name for spec in kv.specs]
        if anchor_group is not None and anchor_group not in names:
            raise ValueError(f"anchor group {anchor_group!r} is not one of {names}")
        self._anchor = pool_key(namespace, (anchor_group, b"")) if anchor_group else None
        self._anchor_tokens = (
            kv.specs[names.index(anchor_group)].block_tokens if anchor_group else 0
        )
        # Stores and loads on their own threads: a load never queues behind the stores of
        # a burst of evictions (a request waits for it; nobody waits for a store).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._lock = threading.Lock()  # guards the fields the worker writes
        self._staged: dict[bytes, torch.Tensor] = {}  # gathered, not yet in the pool
        self._events: list[KVEvent] = []  # pool-tier events of anchor blocks (worker side)
        self._pool_used = 0
        self._loads: dict[str, _Load] = {}
        # Landed loads per request, until its next lookup, which counts the pool tier's hit
        # (and loads again only if other allocations evicted the landed blocks meanwhile).
        self._just_loaded: dict[str, _Load] = {}
        self._stats = OffloadStats(pool_capacity_bytes=getattr(pool, "capacity_bytes", 0))
        self.error: BaseException | None = None  # the last failure (also logged)
        self._pool_down_until = 0.0  # monotonic time before which lookups skip the pool
        # Hands the block pools' events since the last call to offload() (KVEvents.drain):
        # a block evicted earlier in this schedule() is copied before a lookup asks for it.
        self.before_lookup: Callable[[], None] = lambda: None

    # ---- offload -------------------------------------------------------------------------
    def offload(self, events_per_group: Sequence[Sequence[BlockEvent]]) -> None:
        """Copy blocks to the pool, in the background, given the block pools' events since
        the last call: full-history blocks when the device evicts them (their rows are
        intact until the next forward), state checkpoint pages (sliding groups) when they
        are keyed. A checkpoint is a few pages at chosen boundaries, and sliding groups
        rarely evict, so written through, the pool holds the checkpoint that makes its
        history usable (and another engine sharing the pool can use it)."""
        entries: list[tuple[bytes, torch.Tensor]] = []
        done: list[torch.cuda.Event] = []
        for spec, events in zip(self.kv.specs, events_per_group, strict=True):
            kind = BlockEventKind.STORED if spec.is_sliding else BlockEventKind.EVICTED
            evicted = [e for e in events if e.kind is kind]
            if not evicted:
                continue
            rows = gather_blocks(self.caches, spec.name, [e.block_id for e in evicted])
            rows = rows.contiguous().view(torch.uint8)  # [n, bytes per block]
            if self._side is not None:  # D2H on the side stream, overlapping the forward
                host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
                self._side.wait_stream(torch.cuda.current_stream(self.device))  # the gather
                with torch.cuda.stream(self._side):
                    host.copy_(rows, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._side)
                rows.record_stream(self._side)  # not reused before the copy has read it
                done.append(event)
                rows = host  # entries are views of one pinned buffer: no per-block alloc
            else:  # a copy each, so the pool's byte count is what it really keeps
                rows = [row.clone() for row in rows]
            for e, row in zip(evicted, rows, strict=True):
                entries.append((pool_key(self.namespace, e.key), row))
        if not entries:
            return
        with self._lock:
            self._staged.update(entries)
        nbytes = sum(v.numel() for _, v in entries)
        self._bump(num_blocks_offloaded=len(entries), bytes_offloaded=nbytes)
        self._worker.submit(self._store, entries, done)

    def _store(self, entries: list[tuple[bytes, torch.Tensor]], done: list) -> None:
        try:
            for event in done:
                event.synchronize()
            evicted = self.pool.put(entries)
            used = self.pool.usage().used_bytes
        except Exception as e:  # a pool server gone: the blocks are lost, not the engine
            logger.warning("KV pool: storing %d blocks failed: %s", len(entries), e)
            self.error, evicted, used = e, [], self._pool_used
        with self._lock:
            for key, _ in entries:
                self._staged.pop(key, None)
            self._pool_used = used
            if self._anchor is not None:
                self._events += self._anchor_events(entries, evicted)

    def _anchor_events(self, entries: list, evicted: list[bytes]) -> list[KVEvent]:
        anchor, size = self._anchor, len(self._anchor or b"")
        stored = [k[size:] for k, _ in entries if k.startswith(anchor)]
        removed = [k[size:] for k in evicted if k.startswith(anchor)]
        block_tokens = self._anchor_tokens
        out: list[KVEvent] = []
        if removed:
            out.append(BlockRemoved(removed, "pool"))
        if stored:
            out.append(BlockStored(stored, None, len(stored) * block_tokens, "pool"))
        return out

    # ---- load ----------------------------------------------------------------------------
    def _in_pool(self, keys: Sequence[BlockKey]) -> list[bool]:
        names = [pool_key(self.namespace, k) for k in keys]
        with self._lock:
            staged = [n in self._staged for n in names]
        ask = [n for n, s in zip(names, staged, strict=True) if not s]
        found = [False] * len(ask)
        if ask and time.monotonic() >= self._pool_down_until:
            try:
                found = self.pool.contains(ask)
            except Exception as e:  # the engine loop goes on: these requests recompute
                logger.warning("KV pool: lookup failed, pool skipped for %d s: %s", POOL_RETRY_S, e)
                self.error, self._pool_down_until = e, time.monotonic() + POOL_RETRY_S
        answers = iter(found)
        return [s or next(answers) for s in staged]

    def start_load(self, req: Request, device_hit: int) -> LoadStart:
        """Park ``req`` (just looked up, device hit ``device_hit``) while the pool blocks
        that lengthen its hit load (STARTED). NONE (nothing changed): the pool adds
        nothing, or this is the lookup right after a load that still finds what it loaded.
        NO_ROOM: the pool would add, but the device lacks free blocks for it now."""
        attempt = 0
        landed = self._just_loaded.pop(req.request_id, None)
        if landed is not None:
            before, after = landed.device_hit, landed.num_tokens if landed.landed else 0
            self.kv.note_pool_hit(req, max(0, min(device_hit, after) - before))
            # Landed blocks evicted before this lookup (a full cache): load again, a few
            # times at most, so that a thrashing cache ends in recompute, not a loop.
            if device_hit >= after or landed.attempt + 1 >= MAX_LOAD_ATTEMPTS:
                return LoadStart.NONE
            attempt = landed.attempt + 1
        chain = self.kv.lookup_chain(req)
        if chain is None or req.request_id in self._loads:
            return LoadStart.NONE
        self.before_lookup()
        hit = plan_pool_hit(
            self.kv.prefix_cache, chain, len(req.all_token_ids), device_hit, self._in_pool
        )
        if hit is None or not hit.num_missing:
            return LoadStart.NONE
        pools = self.kv.pools
        for pool, present, missing in zip(pools, hit.present, hit.missing, strict=True):
            # Touching a free present block takes it out of the free queue too.
            if len(missing) + sum(b.ref_cnt == 0 for b in present) > pool.free_queue.num_free:
                return LoadStart.NO_ROOM
        new: list[list[KVCacheBlock]] = []
        for pool, present in zip(pools, hit.present, strict=True):
            pool.touch(present)  # first: the allocations below must not evict them
        for pool, missing in zip(pools, hit.missing, strict=True):
            blocks = pool.get_new_blocks(len(missing))
            assert blocks is not None  # checked above
            new.append(blocks)
        self.kv.hold(req, hit.present)
        self.kv.hold(req, new)
        load = _Load(
            req,
            req.status,
            device_hit,
            hit.num_tokens,
            [
                list(zip(blocks, (key for _, key in missing), strict=True))
                for blocks, missing in zip(new, hit.missing, strict=True)
            ],
        )
        load.attempt = attempt
        self._loads[req.request_id] = load
        req.status = RequestStatus.WAITING_FOR_POOL_KV
        keys = [[pool_key(self.namespace, key) for _, key in group] for group in load.blocks]
        self._loader.submit(self._fetch, keys, load.result)
        return LoadStart.STARTED

    def _fetch(self, keys: list[list[bytes]], result: Future) -> None:
        """Worker: the blocks' bytes per group as ``[n, bytes per block]`` uint8 tensors
        (empty groups: None), and the event of their copy to the device (GPU) or None; the
        result is None when a key is gone (the request recomputes: slower, never wrong)."""
        try:
            flat = [k for group in keys for k in group]
            with self._lock:
                values = [self._staged.get(k) for k in flat]
            ask = [k for k, v in zip(flat, values, strict=True) if v is None]
            fetched = iter(self.pool.get(ask) if ask else [])
            values = [v if v is not None else next(fetched) for v in values]
            if any(v is None for v in values):
                result.set_result(None)
                return
            it = iter(values)
            rows = [torch.stack([next(it) for _ in group]) if group else None for group in keys]
            result.set_result(self._to_device(rows))
        except Exception as e:
            logger.warning("KV pool: loading %d blocks failed: %s", len(flat), e)
            self.error = e
            result.set_result(None)

    def _to_device(self, rows: list[torch.Tensor | None]) -> tuple[list, torch.cuda.Event | None]:
        """Worker: on a GPU, H2D from pinned memory on the side stream (the engine lands the
        load once the event has completed); on a CPU the rows as they are."""
        if self._side is None:
            return rows, None
        with torch.cuda.stream(self._side):
            on_device = []
            for r in rows:
                if r is not None:
                    r = r.pin_memory().to(self.device, non_blocking=True)
                on_device.append(r)
            event = torch.cuda.Event()
            event.record(self._side)
        return on_device, event

    def take_loaded(self) -> list[Request]:
        """Requests whose loads finished, written into their blocks and keyed (engine
        thread, before the next forward): back to the waiting queue. A failed load (a key
        gone from the pool) returns its request too, for a shorter hit or recompute."""
        ready = [load for load in self._loads.values() if _done(load.result)]
        if ready:  # forget requests aborted between landing and their next lookup
            gone = [k for k, v in self._just_loaded.items() if v.req.status.is_finished]
            for req_id in gone:
                del self._just_loaded[req_id]
        requests = []
        for load in ready:
            req = load.req
            del self._loads[req.request_id]
            if req.status is not RequestStatus.WAITING_FOR_POOL_KV:
                continue  # aborted meanwhile: its blocks went back with kv.free
            loaded = load.result.result()
            if loaded is not None:
                self._land(load, loaded[0])
                load.landed = True
            self._just_loaded[req.request_id] = load
            # Keyed now, the blocks wait in the free queue's most recently used end: the
            # request is admitted first thing in this schedule(). Holding them until then
            # could leave the cache full of blocks for requests that cannot run yet.
            self.kv.release_held(req)
            req.status = load.previous_status
            requests.append(req)
        return requests

    def _land(self, load: _Load, rows_per_group: list[torch.Tensor | None]) -> None:
        nbytes = 0
        for spec, pool, group, rows in zip(
            self.kv.specs, self.kv.pools, load.blocks, rows_per_group, strict=True
        ):
            if not group:
                continue
            assert rows is not None
            nbytes += rows.numel()
            dtype = next(iter(self.caches.tensors[spec.name].values())).dtype
            if self._side is not None:  # allocated on the side stream, read on this one
                rows.record_stream(torch.cuda.current_stream(self.device))
            rows = rows.view(dtype).view(len(group), -1)
            scatter_blocks(self.caches, spec.name, [b.block_id for b, _ in group], rows)
            for block, key in group:
                pool.cache_block(block, key)  # False: recomputed meanwhile, stays transient
        self._bump(
            num_blocks_loaded=sum(map(len, load.blocks)),
            bytes_loaded=nbytes,
        )

    # ---- state ---------------------------------------------------------------------------
    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a load in flight has fetched its blocks, ``timeout_s`` at most
        (nothing in flight: return at once). The engine calls it when a step had nothing to
        schedule, so that it naps instead of spinning while loads are its only work."""
        pending = [load.result for load in self._loads.values()]
        if not pending:
            return
        fetched, _ = wait(pending, timeout_s, return_when=FIRST_COMPLETED)
        for result in fetched:  # on a GPU, then its copy to the device (a few ms at most)
            loaded = result.result()
            if loaded is not None and loaded[1] is not None:
                loaded[1].synchronize()
                return

    def _bump(self, **counts: int) -> None:
        s = self._stats
        fields = s.__dataclass_fields__
        self._stats = OffloadStats(**{k: getattr(s, k) + counts.get(k, 0) for k in fields})

    @property
    def stats(self) -> OffloadStats:
        with self._lock:
            used = self._pool_used
        s = self._stats
        return OffloadStats(**{**s.__dict__, "pool_used_bytes": used})

    def take_events(self) -> list[KVEvent]:
        """Pool-tier events of anchor blocks since the last call."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def flush(self) -> None:
        """Wait until every store and fetch submitted so far is done, copies included
        (tests, shutdown)."""
        self._worker.submit(lambda: None).result()
        self._loader.submit(lambda: None).result()
        if self._side is not None:
            self._side.synchronize()

    def clear(self) -> None:
        """The device prefix cache was reset: this engine's pool entries are stale too."""
        self._worker.submit(self.pool.clear, self.namespace)

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._worker.shutdown(wait=True)
        self.pool.close()


def _done(result: Future) -> bool:
    """A load is done when its fetch is and, on a GPU, its copy to the device too."""
    if not result.done():
        return False
    loaded = result.result()
    return loaded is None or loaded[1] is None or loaded[1].query()
