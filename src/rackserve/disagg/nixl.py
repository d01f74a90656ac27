"""NIXL, behind the same interface, used when ``import nixl`` works.

``kv_connector: nixl`` keeps the control path of wire.py; the bytes move by a NIXL READ: the
producer registers the packed region with its agent and answers the pull with the agent's
metadata and the region's descriptors; the consumer's agent reads them into a registered
buffer, then acknowledges, and only then the producer deregisters the region::

    consumer                                  producer
    Pull(transport nixl) -->                  register(region)
                          <-- PullReply(agent metadata, descriptors, crc32)
    READ (UCX) <========== region bytes
    Ack -->                                   deregister(region)

Checked 2026-12-01: the ``nixl`` (12 KB) + ``nixl-cu13`` (59 MB) wheels install and import on
the CPU-only machine too, and UCX moves DRAM bytes between two agents (tests/disagg/
test_nixl.py, skipped where nixl is not installed; it is not a dependency). The engine refuses
the setting at start-up when the package is missing, naming the install.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import threading
import time
from typing import Any

import torch

from rackserve.config import ConfigError

_counter = itertools.count()
_lock = threading.Lock()


def nixl_available() -> bool:
    return importlib.util.find_spec("nixl") is not None


def check_nixl() -> None:
    """ConfigError naming the fix unless the ``nixl`` package can be imported."""
    if not nixl_available():
        raise ConfigError(
            "kv_connector 'nixl' needs the nixl package (pip install nixl nixl-cu13); "
            "use kv_connector 'nccl' (GPUs) or 'tcp' / 'shm' (CPU) without it"
        )
    try:
        import nixl  # noqa: F401  (a broken install fails here, at start-up)
    except ImportError as e:
        raise ConfigError(f"kv_connector 'nixl': the nixl package does not import: {e}") from e


class NixlAgent:
    """One NIXL agent (UCX backend) of this process; thread-safe (one lock per agent)."""

    def __init__(self, role: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"rackserve-{role}-{os.getpid()}-{next(_counter)}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self._lock = threading.Lock()
        self._peers: dict[bytes, str] = {}

    # ---- producer --------------------------------------------------------------------------
    def expose(self, region: torch.Tensor) -> tuple[bytes, bytes, Any]:
        """(agent metadata, the region's serialized descriptors, the registration)."""
        with self._lock:
            registration = self.agent.register_memory(region)
            descs = self.agent.get_xfer_descs(region)
            return (
                self.agent.get_agent_metadata(),
                self.agent.get_serialized_descs(descs),
                registration,
            )

    def release(self, registration: Any) -> None:
        with self._lock:
            self.agent.deregister_memory(registration)

    # ---- consumer --------------------------------------------------------------------------
    def read(self, metadata: bytes, descs: bytes, out: torch.Tensor, timeout_s: float) -> None:
        """READ the remote region into ``out`` (same byte size); RuntimeError on failure."""
        with self._lock:
            peer = self._peers.get(metadata)
            if peer is None:
                peer = self._peers[metadata] = self.agent.add_remote_agent(metadata)
            remote = self.agent.deserialize_descs(descs)
            registration = self.agent.register_memory(out)
            local = self.agent.get_xfer_descs(out)
            handle = self.agent.initialize_xfer("READ", local, remote, peer)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL read from {peer} took over {timeout_s:g} s")
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"NIXL read from {peer} failed")
        finally:
            with self._lock:
                self.agent.release_xfer_handle(handle)
                self.agent.deregister_memory(registration)


_agents: dict[str, NixlAgent] = {}


def agent(role: str) -> NixlAgent:
    """This process's agent for ``role`` ("producer" / "consumer"), made on first use."""
    with _lock:
        if role not in _agents:
            _agents[role] = NixlAgent(role)
        return _agents[role]
