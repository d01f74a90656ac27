"""KV cache events: which prefix blocks an engine holds, published for the KV-aware router.

Modelled on vLLM's KV events. Each engine binds a ZMQ PUB socket (``--kv-events-endpoint
tcp://HOST:PORT``) and publishes one :class:`KVEventBatch` per engine step that changed
anything. Block hashes are the chained prefix hashes of :mod:`rackserve.kv.hashing` (the
engine's hash algorithm and granularity, the request's cache salt), one per block of the
*anchor* cache group (the first full-history group): a router hashes a prompt's tokens the
same way and looks the hashes up at multiples of the anchor block size. ``medium`` says
which tier holds the block: ``"device"`` (the engine's KV cache) or ``"pool"`` (the host
KV pool, kv/offload).

Wire format: msgpack of the Structs below (a tagged union for the events); subscribers
receive one frame per batch.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import socket
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from rackserve.kv.block_pool import BlockEvent, BlockEventKind
from rackserve.kv.spec import CacheGroupSpec

if TYPE_CHECKING:
    from rackserve.kv.manager import KVCacheManager
    from rackserve.kv.offload import KVOffloader

MEDIUMS = ("device", "pool")


class BlockStored(msgspec.Struct, tag=True, array_like=True):
    """Blocks that became findable. ``num_tokens``: tokens the listed blocks cover
    (``len(block_hashes)`` x the anchor block size). ``parent_hash``: the prefix hash before
    the first block when known, else None (pool-level events do not track it)."""

    block_hashes: list[bytes]
    parent_hash: bytes | None
    num_tokens: int
    medium: str


class BlockRemoved(msgspec.Struct, tag=True, array_like=True):
    """Blocks no longer findable in ``medium`` (evicted, or dropped as superseded)."""

    block_hashes: list[bytes]
    medium: str


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    """Every block of the engine is gone (prefix cache reset, e.g. after a weight update)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    """The events of one engine step, in order. ``seq`` counts batches from 0 per engine (a
    gap tells a subscriber it missed some: then it should treat its view as stale).
    ``engine_id`` names the engine instance (host, pid, a random suffix): a new id on an
    endpoint means the engine restarted with an empty cache."""

    ts: float
    seq: int
    engine_id: str
    events: list[KVEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    """ValueError (msgspec.DecodeError) for anything that is not a KVEventBatch."""
    return _decoder.decode(data)


class KVEventPublisher:
    """A ZMQ PUB socket bound at ``endpoint``; :meth:`publish` sends one batch (never
    blocks: a slow subscriber drops messages at its high-water mark, as PUB does)."""

    def __init__(self, endpoint: str, engine_id: str) -> None:
        import zmq

        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"--kv-events-endpoint must be a ZMQ address like tcp://127.0.0.1:5557, "
                f"got {endpoint!r}"
            )
        self.engine_id = engine_id
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"--kv-events-endpoint {endpoint}: cannot bind ({e})") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0

    def publish(self, events: list[KVEvent]) -> KVEventBatch | None:
        """Send ``events`` as the next batch; nothing for an empty list."""
        if not events:
            return None
        import zmq

        batch = KVEventBatch(time.time(), self._seq, self.engine_id, events)
        self._seq += 1
        # No room at the high-water mark: dropped, and the subscriber sees a seq gap.
        with contextlib.suppress(zmq.Again):
            self._socket.send(encode_batch(batch), flags=zmq.NOBLOCK)
        return batch

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()


def rank_endpoint(endpoint: str, rank: int) -> str:
    """DP rank r of an engine publishes on ``tcp://host:(port + r)`` (ranks of one host
    cannot share a port); other addresses get a ``-r`` suffix for r > 0."""
    if rank == 0:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit():
        return f"{head}:{int(port) + rank}"
    return f"{endpoint}-{rank}"


def anchor_group(specs: Sequence[CacheGroupSpec]) -> CacheGroupSpec:
    """The group whose block hashes are published: the first full-history group (every
    hit needs all of its blocks), or the first group of a model without one."""
    return next((s for s in specs if not s.is_sliding), specs[0])


def device_events(events: Iterable[BlockEvent], block_tokens: int) -> list[KVEvent]:
    """The anchor pool's block events as KV events (medium "device"), runs of one kind
    merged into one event."""
    out: list[KVEvent] = []
    for kind, run in itertools.groupby(events, key=lambda e: e.kind):
        hashes = [e.key[1] for e in run if e.key is not None]
        if kind is BlockEventKind.STORED:
            out.append(BlockStored(hashes, None, len(hashes) * block_tokens, "device"))
        elif kind is BlockEventKind.CLEARED:
            out.append(AllBlocksCleared())
        else:  # evicted, or demoted to transient
            out.append(BlockRemoved(hashes, "device"))
    return out


class KVEvents:
    """The engine's one reader of its block pools' events: blocks evicted from the device go
    to the host pool (``offload``), and the anchor group's key changes (plus the pool-tier
    ones) are published when ``endpoint`` is given. The engine core calls :meth:`drain`
    after scheduling (before the forward overwrites evicted blocks) and after each step."""

    def __init__(
        self,
        kv: KVCacheManager,
        endpoint: str | None,
        offload: KVOffloader | None,
        rank: int = 0,
    ) -> None:
        self.kv, self.offload = kv, offload
        self._anchor = anchor_group(kv.specs)
        self._anchor_index = kv.specs.index(self._anchor)
        self.publisher: KVEventPublisher | None = None
        if endpoint is not None:
            # unique per engine instance: a router tells a restarted engine by a new id
            engine_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
            self.publisher = KVEventPublisher(rank_endpoint(endpoint, rank), engine_id)
        self._pending: list[KVEvent] = []
        if offload is not None:
            offload.before_lookup = self.drain

    def drain(self, publish: bool = False) -> None:
        if self.offload is None and self.publisher is None:
            return  # nothing records events (most engines): one branch per step
        per_group = [pool.take_events() for pool in self.kv.pools]
        if self.offload is not None:
            self.offload.offload(per_group)
            if any(e.kind is BlockEventKind.CLEARED for e in per_group[self._anchor_index]):
                self.offload.clear()
        if self.publisher is None:
            return
        self._pending += device_events(per_group[self._anchor_index], self._anchor.block_tokens)
        if self.offload is not None:
            self._pending += self.offload.take_events()
        if publish and self._pending:
            self.publisher.publish(self._pending)
            self._pending = []

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
