"""The prefill side's finished requests' KV, kept until pulled or until the lease ends.

The engine loop copies a finished request's rows out (``ExportedRows``) and frees its blocks
at once: the cache never waits on a slow or dead decode peer. The copies live here under
their transfer key until ``num_consumers`` pulls succeeded or ``lease_s`` passed without a
pull or heartbeat (a decode side that died, or a router that never came back). Thread-safe:
the transport's server threads read, the engine loop adds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from rackserve.runner.kv_transfer import ExportedRows


@dataclass
class StoredKV:
    rows: ExportedRows
    consumers_left: int
    expires_at: float  # time.monotonic()


class KVStore:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._entries: dict[str, StoredKV] = {}
        self._lock = threading.Lock()
        self.num_expired = 0
        self.bytes_sent = 0

    def put(self, key: str, rows: ExportedRows, num_consumers: int) -> None:
        with self._lock:
            self._expire_locked()
            self._entries[key] = StoredKV(rows, num_consumers, time.monotonic() + self.lease_s)

    def get(self, key: str) -> ExportedRows | None:
        """The copy, its lease renewed (a pull is starting); None if unknown or expired."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(key)
            if entry is None:
                return None
            entry.expires_at = time.monotonic() + self.lease_s
            return entry.rows

    def done(self, key: str, nbytes: int) -> None:
        """A pull completed (acknowledged): the last consumer drops the copy."""
        with self._lock:
            self.bytes_sent += nbytes
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.consumers_left -= 1
            if entry.consumers_left <= 0:
                del self._entries[key]

    def heartbeat(self, keys: list[str]) -> list[str]:
        """Extend these leases; returns the keys no longer held."""
        now = time.monotonic()
        with self._lock:
            self._expire_locked()
            missing = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    missing.append(key)
                else:
                    entry.expires_at = now + self.lease_s
            return missing

    def expire(self) -> None:
        with self._lock:
            self._expire_locked()

    def _expire_locked(self) -> None:
        now = time.monotonic()
        expired = [k for k, e in self._entries.items() if e.expires_at <= now]
        for key in expired:
            del self._entries[key]
        self.num_expired += len(expired)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.rows.nbytes for e in self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
