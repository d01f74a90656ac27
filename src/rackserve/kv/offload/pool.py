"""The host KV pool: block bytes by key, LRU within a byte budget.

A key names one block of one cache group: ``namespace + group + b"/" + prefix hash`` (see
:func:`pool_key`); the namespace keeps engines of different models (or dtypes) sharing one
pool server apart. A value is the block's rows over all layers of its group, as a flat
``uint8`` tensor (kv/offload/blocks.py packs and unpacks them).

:class:`LocalKVPool` lives in the engine process; :class:`rackserve.kv.offload.server.
RemoteKVPool` talks to a pool server shared by the engines of a host, behind the same
interface (:class:`KVPool`). Both are thread-safe: the offloader's worker thread stores and
fetches while the engine thread looks keys up.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rackserve.kv.hashing import BlockKey


def pool_key(namespace: bytes, key: BlockKey) -> bytes:
    """The pool's key of a device cache key ``(group, prefix hash)``."""
    group, block_hash = key
    return namespace + group.encode() + b"/" + block_hash


@dataclass(frozen=True)
class PoolUsage:
    num_entries: int
    used_bytes: int
    capacity_bytes: int

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


class KVPool(Protocol):
    """What the offloader needs from a pool (in-process or a server)."""

    def put(self, entries: Sequence[tuple[bytes, torch.Tensor]]) -> list[bytes]:
        """Store ``(key, uint8 tensor)`` pairs (most recently used); returns the keys evicted
        to make room. A key already present is only refreshed; an entry larger than the
        whole pool is dropped."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """The values (refreshed as recently used); None for a key not held."""
        ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def usage(self) -> PoolUsage: ...

    def clear(self, prefix: bytes = b"") -> None:
        """Drop every key starting with ``prefix`` (all of them for b"")."""
        ...

    def close(self) -> None: ...


class LocalKVPool:
    """An in-process LRU pool of ``capacity_bytes``; values are kept as given (the offloader
    hands over tensors it no longer uses: pinned host memory when the cache is on a GPU)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the KV pool needs a positive size in bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # LRU first
        self._used = 0
        self._lock = threading.Lock()

    def put(self, entries: Sequence[tuple[bytes, torch.Tensor]]) -> list[bytes]:
        evicted: list[bytes] = []
        with self._lock:
            for key, value in entries:
                if value.dtype != torch.uint8 or value.dim() != 1:
                    raise ValueError("KV pool values are flat uint8 tensors")
                if key in self._entries:
                    self._entries.move_to_end(key)
                    continue
                size = value.numel()
                if size > self.capacity_bytes:
                    continue
                while self._used + size > self.capacity_bytes:
                    old_key, old = self._entries.popitem(last=False)
                    self._used -= old.numel()
                    evicted.append(old_key)
                self._entries[key] = value
                self._used += size
        return evicted

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        values: list[torch.Tensor | None] = []
        with self._lock:
            for key in keys:
                value = self._entries.get(key)
                if value is not None:
                    self._entries.move_to_end(key)
                values.append(value)
        return values

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def usage(self) -> PoolUsage:
        with self._lock:
            return PoolUsage(len(self._entries), self._used, self.capacity_bytes)

    def clear(self, prefix: bytes = b"") -> None:
        with self._lock:
            for key in [k for k in self._entries if k.startswith(prefix)]:
                self._used -= self._entries.pop(key).numel()

    def keys(self) -> list[bytes]:
        """LRU order, least recently used first (tests, debugging)."""
        with self._lock:
            return list(self._entries)

    def close(self) -> None:
        self.clear()
