"""Two-rank process groups for the ``nccl`` transport: one per (producer, consumer) pair,
built on first use through a TCPStore the consumer hosts (gloo on CPU: the tests)."""

from __future__ import annotations

import datetime
import threading


class PairGroups:
    """Two-rank process groups, one per peer (rank 0: producer, rank 1: consumer)."""

    def __init__(self, backend: str, timeout_s: float) -> None:
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._groups: dict[str, object] = {}
        self._stores: dict[str, object] = {}
        self.locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def lock(self, peer: str) -> threading.Lock:
        with self._lock:
            return self.locks.setdefault(peer, threading.Lock())

    def host_store(self, peer: str, host: str) -> str:
        """Consumer: a store for the pair with ``peer``; returns its "host:port"."""
        import torch.distributed as dist

        store = dist.TCPStore(host, 0, 2, True, timeout=self.timeout, wait_for_workers=False)
        self._stores[peer] = store
        return f"{host}:{store.port}"

    def group(self, peer: str, rank: int, rendezvous: str = "") -> object:
        import torch.distributed as dist

        if peer in self._groups:
            return self._groups[peer]
        if rank == 0:
            host, port = rendezvous.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), 2, False, timeout=self.timeout)
            self._stores[peer] = store
        store = dist.PrefixStore("kv", self._stores[peer])
        if self.backend == "nccl":
            # as torch.distributed builds one (two ranks on one GPU is refused by NCCL:
            # benchmarks/gpu_pd.sh uses tcp when only one GPU is lent)
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = self.timeout
            group = dist.ProcessGroupNCCL(store, rank, 2, options)
        else:
            group = dist.ProcessGroupGloo(store, rank, 2, self.timeout)
        self._groups[peer] = group
        return group

    def drop(self, peer: str) -> None:
        self._groups.pop(peer, None)
        self._stores.pop(peer, None)
