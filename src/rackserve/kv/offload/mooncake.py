"""The host KV pool over Mooncake Store (``mooncake-transfer-engine``), where installed: the
same :class:`~rackserve.kv.offload.pool.KVPool` interface, so a cluster's Mooncake pool can
replace the ZMQ pool server. Optional (a guarded import, not a dependency); eviction and
capacity are Mooncake's (its master's), so ``put`` reports no evicted keys.

``--kv-offload-server 'mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata'``
(query keys: ``metadata`` (required), ``protocol`` (tcp), ``device``, ``segment`` (bytes
this engine contributes), ``buffer`` (local transfer buffer bytes), ``host`` (this host's
name as Mooncake peers reach it)).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from urllib.parse import parse_qs, urlparse

import torch

from rackserve.kv.offload.pool import PoolUsage

DEFAULT_SEGMENT_BYTES = 4 << 30
DEFAULT_BUFFER_BYTES = 1 << 30


def parse_mooncake_url(url: str) -> dict[str, str | int]:
    """``mooncake://master?metadata=...`` -> the arguments of ``MooncakeDistributedStore.setup``."""
    parsed = urlparse(url)
    if parsed.scheme != "mooncake" or not parsed.netloc:
        raise ValueError(f"expected mooncake://MASTER_HOST:PORT?metadata=URL, got {url!r}")
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    if "metadata" not in query:
        raise ValueError(f"{url}: give the metadata server as ?metadata=http://HOST:PORT/metadata")
    try:
        segment = int(query.get("segment", DEFAULT_SEGMENT_BYTES))
        buffer = int(query.get("buffer", DEFAULT_BUFFER_BYTES))
    except ValueError:
        raise ValueError(f"{url}: segment and buffer are byte counts") from None
    return {
        "local_hostname": query.get("host", socket.gethostname()),
        "metadata_server": query["metadata"],
        "global_segment_size": segment,
        "local_buffer_size": buffer,
        "protocol": query.get("protocol", "tcp"),
        "device_name": query.get("device", ""),
        "master_server_address": parsed.netloc,
    }


class MooncakeKVPool:
    """A Mooncake Store client as a KV pool (keys hex-encoded: Mooncake keys are strings)."""

    def __init__(self, url: str) -> None:
        setup = parse_mooncake_url(url)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:
            raise ValueError(
                "--kv-offload-server mooncake://... needs the mooncake-transfer-engine "
                "package (pip install mooncake-transfer-engine); or run `rackserve kv-pool` "
                "and give its tcp:// address"
            ) from None
        self._store = MooncakeDistributedStore()
        if self._store.setup(*setup.values()) != 0:
            raise ConnectionError(f"Mooncake Store setup failed for {url}")
        self.capacity_bytes = int(setup["global_segment_size"])
        self._lock = threading.Lock()
        self._used = 0

    def put(self, entries: Sequence[tuple[bytes, torch.Tensor]]) -> list[bytes]:
        with self._lock:
            for key, value in entries:
                data = value.numpy().tobytes()
                if self._store.put(key.hex(), data) == 0:
                    self._used += len(data)
        return []

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        values: list[torch.Tensor | None] = []
        with self._lock:
            for key in keys:
                data = self._store.get(key.hex())
                values.append(
                    torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
                )
        return values

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [self._store.is_exist(key.hex()) == 1 for key in keys]

    def usage(self) -> PoolUsage:
        """What this engine stored (Mooncake does not report its pool's fill per client)."""
        return PoolUsage(0, min(self._used, self.capacity_bytes), self.capacity_bytes)

    def clear(self, prefix: bytes = b"") -> None:
        """Not supported by key prefix: Mooncake entries age out by its own eviction."""

    def close(self) -> None:
        with self._lock:
            self._store.close()
