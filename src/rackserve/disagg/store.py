"""The prefill side's requests' KV, kept until pulled or until the lease ends.

While a request's prompt is still being prefilled (chunked), the engine loop adds the rows of
each block whose positions are all computed (``Piece``): a streaming pull sends them while
later chunks compute. When the request finishes, the loop copies the rest out
(``ExportedRows``, the tail) and frees its blocks at once: the cache never waits on a slow or
dead decode peer. An entry lives under its transfer key until ``num_consumers`` pulls
succeeded or ``lease_s`` passed without progress, a pull or a heartbeat (a decode side that
died, or a router that never came back). Thread-safe: the transport's server threads read and
wait here, the engine loop adds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from rackserve.disagg.wire import End
from rackserve.runner.kv_transfer import ExportedRows


@dataclass(frozen=True)
class Piece:
    """Rows of some table slots of one cache group, copied while the prefill ran:
    ``rows[k]`` is layer k of the group as [len(slots), entries_per_block, entry_width]."""

    group: int
    slots: list[int]
    rows: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows)


@dataclass
class StoredKV:
    rows: ExportedRows | None  # None while the prefill still runs (``pieces`` so far)
    consumers_left: int
    expires_at: float  # time.monotonic()
    pieces: list[Piece] = field(default_factory=list)
    num_cached_tokens: int = 0  # the prefill side's prefix hit (the decode side reports it)


class KVStore:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._entries: dict[str, StoredKV] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a piece, the tail, or a removal
        self.num_expired = 0
        self.bytes_sent = 0
        self._watchers: dict[str, int] = {}  # key -> streaming pulls waiting on it

    # ---- the engine loop -------------------------------------------------------------------
    def open(self, key: str, num_consumers: int) -> None:
        """A prefill started: streaming pulls of ``key`` wait here for its pieces."""
        with self._lock:
            self._expire_locked()
            self._entries[key] = StoredKV(None, num_consumers, time.monotonic() + self.lease_s)
            self._changed.notify_all()

    def add_piece(self, key: str, piece: Piece) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.rows is not None:
                return
            entry.pieces.append(piece)
            entry.expires_at = time.monotonic() + self.lease_s
            self._changed.notify_all()

    def put(
        self,
        key: str,
        rows: ExportedRows,
        num_consumers: int,
        num_cached_tokens: int = 0,
    ) -> None:
        """The finished request's rows (an open entry keeps its pieces) and its prefix hit
        (a streamed pull's ``End`` carries it)."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(key)
            expires_at = time.monotonic() + self.lease_s
            if entry is None:
                entry = self._entries[key] = StoredKV(rows, num_consumers, expires_at)
            else:
                entry.rows, entry.consumers_left, entry.expires_at = rows, num_consumers, expires_at
            entry.num_cached_tokens = num_cached_tokens
            self._changed.notify_all()

    def end(self, key: str) -> End:
        """A streamed pull's last message, with the prefill side's prefix hit."""
        with self._lock:
            entry = self._entries.get(key)
            return End(True, num_cached_tokens=0 if entry is None else entry.num_cached_tokens)

    def discard(self, key: str) -> None:
        """The prefill ended without KV (aborted, refused): waiting pulls fail now."""
        with self._lock:
            self._entries.pop(key, None)
            self._changed.notify_all()

    # ---- transfer threads ------------------------------------------------------------------
    def get(self, key: str, wait_s: float = 0.0) -> ExportedRows | None:
        """The whole copy, its lease renewed (a pull is starting); an entry whose prefill
        still runs is waited for up to ``wait_s``. None if unknown, expired or not done."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                self._expire_locked()
                entry = self._entries.get(key)
                if entry is None:
                    return None
                if entry.rows is not None:
                    entry.expires_at = time.monotonic() + self.lease_s
                    return entry.rows
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(min(left, 0.2))

    def watching(self, key: str, delta: int) -> None:
        """A streaming pull starts (+1) or ends (-1) waiting on ``key``."""
        with self._lock:
            n = self._watchers.get(key, 0) + delta
            if n > 0:
                self._watchers[key] = n
            else:
                self._watchers.pop(key, None)

    def is_watched(self, key: str) -> bool:
        """Whether a streaming pull waits on ``key`` (the loop copies pieces only then)."""
        with self._lock:
            return key in self._watchers

    def wait_for(self, key: str, timeout_s: float) -> bool:
        """Whether ``key`` is held, waiting up to ``timeout_s`` for it to open (a pull may
        arrive before the prefill engine has its request)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._expire_locked()
                if key in self._entries:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.2))

    def watch(
        self, key: str, num_seen: int, timeout_s: float
    ) -> tuple[bool, list[Piece], ExportedRows | None]:
        """(held, pieces after the first ``num_seen``, the tail once finished): waits up to
        ``timeout_s`` for something new. ``held`` False: unknown, expired or discarded."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._expire_locked()
                entry = self._entries.get(key)
                if entry is None:
                    return False, [], None
                if len(entry.pieces) > num_seen or entry.rows is not None:
                    entry.expires_at = time.monotonic() + self.lease_s
                    return True, entry.pieces[num_seen:], entry.rows
                left = deadline - time.monotonic()
                if left <= 0:
                    return True, [], None
                self._changed.wait(min(left, 0.2))

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
        # a streaming pull's live connection holds its entry (it dies with either side)
        expired = [
            k for k, e in self._entries.items() if e.expires_at <= now and k not in self._watchers
        ]
        for key in expired:
            del self._entries[key]
        self.num_expired += len(expired)
        if expired:
            self._changed.notify_all()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(
                (e.rows.nbytes if e.rows is not None else 0) + sum(p.nbytes for p in e.pieces)
                for e in self._entries.values()
            )

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._changed.notify_all()
