"""KV transports, chosen by name (``kv_connector``): where a pulled region's bytes travel.

All share the control path of wire.py over TCP (a producer's ``KVServer`` on kv_ip:kv_port):

- ``tcp``: the bytes follow on the same stream in checksummed pieces, block by block while
  the prefill still runs (streaming.py; two hosts; loopback).
- ``shm``: the producer writes the region into a shared-memory segment, the consumer copies
  it out (one host, no socket copy of the data); the producer unlinks it after the ack.
- ``nccl``: ``send``/``recv`` on a two-rank process group per (producer, consumer) pair,
  built on first use through a TCPStore the consumer hosts (gloo on CPU: the tests); the
  pieces stream as on ``tcp``, their data on the pair (streaming.py).
- ``nixl``: a NIXL READ of the producer's registered region (disagg/nixl.py) when
  ``import nixl`` works; otherwise a clear error at start-up.

Worker side only: every call here runs on a transfer thread, never on the engine loop.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from rackserve.disagg.pairs import PairGroups
from rackserve.disagg.store import KVStore
from rackserve.disagg.streaming import (
    UNKNOWN_KEY_WAIT_S,
    PieceLog,
    StreamStats,
    recv_streamed,
    send_streamed,
)
from rackserve.disagg.wire import (
    CHUNK_BYTES,
    Ack,
    Chunk,
    End,
    Heartbeat,
    HeartbeatReply,
    Pull,
    PullReply,
    TransferError,
    as_bytes,
    crc32,
    host_empty,
    recv_into_exact,
    recv_message,
    send_message,
    to_host,
)

logger = logging.getLogger(__name__)
TRANSPORTS = ("tcp", "shm", "nccl", "nixl")


@dataclass(frozen=True)
class Fault:
    """Test-only faults of a producer (``kv_connector_extra_config.inject_fault``):
    ``corrupt_chunk``, ``drop_connection`` or ``delay:SECONDS`` (before sending)."""

    kind: str = ""
    delay_s: float = 0.0

    @classmethod
    def parse(cls, text: str | None) -> Fault:
        if not text:
            return cls()
        if text in ("corrupt_chunk", "drop_connection"):
            return cls(text)
        if text.startswith("delay:"):
            return cls("delay", float(text.removeprefix("delay:")))
        raise ValueError(
            f"inject_fault must be corrupt_chunk, drop_connection or delay:SECONDS, got {text!r}"
        )


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown dtype {name!r}")
    return dtype


# ---- producer ---------------------------------------------------------------------------


class KVServer:
    """The producer's control server: one thread per connection, reading from the store."""

    def __init__(
        self, store: KVStore, host: str, port: int, fault: Fault, backend: str = "gloo"
    ) -> None:
        self.store = store
        self.fault = fault
        self.pairs = PairGroups(backend, timeout_s=store.lease_s)
        self.stream_stats = StreamStats()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-server", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        self._sock.settimeout(0.2)
        while not self._stop.is_set():
            self.store.expire()  # leases end even when nobody pulls
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.closing(conn):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small control frames
            conn.settimeout(self.store.lease_s)
            try:
                message = recv_message(conn)
                if isinstance(message, Heartbeat):
                    send_message(conn, HeartbeatReply(self.store.heartbeat(message.keys)))
                elif isinstance(message, Pull):
                    self._pull(conn, message)
            except (TransferError, OSError) as e:
                logger.info("KV transfer connection ended: %s", e)

    def _pull(self, conn: socket.socket, pull: Pull) -> None:
        if pull.stream:
            delay = self.fault.delay_s if self.fault.kind == "delay" else 0.0
            stats, peer = self.stream_stats, pull.rendezvous
            on_pair = pull.transport == "nccl"
            pair_lock = self.pairs.lock(peer) if on_pair else contextlib.nullcontext()
            with pair_lock:  # the pair's sends in this pull's order
                try:
                    nbytes = send_streamed(
                        conn, self.store, pull, self.fault.kind, delay, stats,
                        (lambda: self.pairs.group(peer, 0, peer)) if on_pair else None,
                    )  # fmt: skip
                except TransferError:
                    if on_pair:
                        self.pairs.drop(peer)
                    raise
            ack = recv_message(conn) if nbytes >= 0 else None
            if isinstance(ack, Ack) and ack.ok:
                self.store.done(pull.key, nbytes)
            return
        # the pull may come before the prefill engine has the request, or while it runs
        self.store.wait_for(pull.key, min(self.store.lease_s, UNKNOWN_KEY_WAIT_S))
        rows = self.store.get(pull.key, wait_s=self.store.lease_s)
        if rows is None:
            send_message(conn, PullReply(False, f"no KV held for {pull.key} (lease over?)"))
            return
        try:
            region = rows.pack(pull.group_slots)
        except KeyError as e:
            send_message(conn, PullReply(False, f"the producer lacks blocks: {e}"))
            return
        if region.numel() != pull.numel or str(region.dtype) != pull.dtype:
            send_message(
                conn,
                PullReply(
                    False,
                    f"layout mismatch: {region.numel()} {region.dtype} held, "
                    f"{pull.numel} {pull.dtype} asked (different models or dtypes?)",
                ),
            )
            return
        if self.fault.kind == "delay":
            time.sleep(self.fault.delay_s)
        if pull.transport == "nccl":
            self._send_pair(conn, pull, region)
        elif pull.transport == "nixl":
            self._send_nixl(conn, region)
        elif pull.transport == "shm":
            self._send_shm(conn, pull, region)
        else:
            self._send_stream(conn, region)
        ack = recv_message(conn)
        if isinstance(ack, Ack) and ack.ok:
            self.store.done(pull.key, region.numel() * region.element_size())

    def _send_stream(self, conn: socket.socket, region: torch.Tensor) -> None:
        data = as_bytes(to_host(region))
        num_chunks = max(1, -(-len(data) // CHUNK_BYTES))
        send_message(conn, PullReply(True, num_chunks=num_chunks))
        for i in range(num_chunks):
            chunk = data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]
            checksum = crc32(chunk)
            if self.fault.kind == "drop_connection" and i == num_chunks // 2:
                conn.shutdown(socket.SHUT_RDWR)
                raise TransferError("fault injected: connection dropped")
            if self.fault.kind == "corrupt_chunk" and i == num_chunks - 1:
                checksum ^= 1
            send_message(conn, Chunk(i, len(chunk), checksum))
            conn.sendall(chunk)

    def _send_shm(self, conn: socket.socket, pull: Pull, region: torch.Tensor) -> None:
        data = as_bytes(to_host(region))
        segment = shared_memory.SharedMemory(create=True, size=max(1, len(data)))
        try:
            segment.buf[: len(data)] = data
            checksum = crc32(data) ^ (1 if self.fault.kind == "corrupt_chunk" else 0)
            send_message(conn, PullReply(True, num_chunks=1, shm_name=segment.name, crc32=checksum))
            if self.fault.kind == "drop_connection":
                conn.shutdown(socket.SHUT_RDWR)
                raise TransferError("fault injected: connection dropped")
            conn.settimeout(self.store.lease_s)
            peek = conn.recv(1, socket.MSG_PEEK)  # wait for the ack before unlinking
            if not peek:
                raise TransferError("the consumer closed before acknowledging")
        finally:
            segment.close()
            segment.unlink()

    def _send_nixl(self, conn: socket.socket, region: torch.Tensor) -> None:
        from rackserve.disagg.nixl import agent

        region = region.contiguous()
        checksum = crc32(as_bytes(region)) if region.device.type == "cpu" else 0
        checksum ^= 1 if self.fault.kind == "corrupt_chunk" else 0
        nixl = agent("producer")
        metadata, descs, registration = nixl.expose(region)
        try:
            send_message(
                conn, PullReply(True, crc32=checksum, nixl_agent=metadata, nixl_descs=descs)
            )
            if self.fault.kind == "drop_connection":
                conn.shutdown(socket.SHUT_RDWR)
                raise TransferError("fault injected: connection dropped")
            if not conn.recv(1, socket.MSG_PEEK):  # registered until the consumer has read
                raise TransferError("the consumer closed before acknowledging")
        finally:
            nixl.release(registration)

    def _send_pair(self, conn: socket.socket, pull: Pull, region: torch.Tensor) -> None:
        peer = pull.rendezvous
        with self.pairs.lock(peer):
            checksum = crc32(as_bytes(region)) if region.device.type == "cpu" else 0
            if self.fault.kind == "corrupt_chunk":
                checksum ^= 1
            send_message(conn, PullReply(True, num_chunks=1, crc32=checksum))
            if self.fault.kind == "drop_connection":
                conn.shutdown(socket.SHUT_RDWR)
                raise TransferError("fault injected: connection dropped")
            try:
                group = self.pairs.group(peer, 0, pull.rendezvous)
                group.send([region.contiguous()], 1, 0).wait()
            except Exception as e:  # a broken pair is rebuilt on the next pull
                self.pairs.drop(peer)
                raise TransferError(f"pair send failed: {e}") from None

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=2)


# ---- consumer ---------------------------------------------------------------------------


# transports whose pulls stream block by block while the prefill runs (streaming.py)
STREAMING_TRANSPORTS = ("tcp", "nccl")


@dataclass(frozen=True)
class FetchJob:
    host: str
    port: int
    key: str
    group_slots: list[list[int]]
    numel: int
    dtype: torch.dtype
    device: torch.device
    layout: tuple[tuple[int, int], ...] = ()  # per group (layers, elements per slot per layer)


class KVClient:
    """The consumer's side: pull a region (blocking; run on a transfer thread)."""

    def __init__(self, transport: str, lease_s: float, local_ip: str, backend: str) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown KV transport {transport!r}; one of {TRANSPORTS}")
        self.transport = transport
        self.lease_s = lease_s
        self.local_ip = local_ip
        self.pairs = PairGroups(backend, timeout_s=lease_s)
        self._rendezvous: dict[str, str] = {}
        self.pieces = PieceLog()  # streamed pieces' arrivals (tcp, nccl)
        # key -> a streamed pull's End: the prefill side's prefix hit
        self.remote_ends: dict[str, End] = {}

    def _connect(self, host: str, port: int) -> socket.socket:
        try:
            conn = socket.create_connection((host, port), timeout=self.lease_s)
        except OSError as e:
            raise TransferError(f"cannot reach the prefill engine at {host}:{port}: {e}") from None
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small control frames
        conn.settimeout(self.lease_s)  # no progress for a lease: the producer is gone
        return conn

    def fetch(self, job: FetchJob) -> torch.Tensor:
        """The region (on ``job.device``); TransferError on any failure."""
        peer = f"{job.host}:{job.port}"
        pair_lock = self.pairs.lock(peer) if self.transport == "nccl" else contextlib.nullcontext()
        try:
            with pair_lock, self._connect(job.host, job.port) as conn:
                rendezvous = ""
                if self.transport == "nccl":
                    if peer not in self._rendezvous:
                        self._rendezvous[peer] = self.pairs.host_store(peer, self.local_ip)
                    rendezvous = self._rendezvous[peer]
                stream = self.transport in STREAMING_TRANSPORTS and bool(job.layout)
                pull = Pull(
                    job.key, job.group_slots, job.numel, str(job.dtype), self.transport,
                    rendezvous, stream,
                )  # fmt: skip
                send_message(conn, pull)
                reply = recv_message(conn)
                if not isinstance(reply, PullReply) or not reply.ok:
                    raise TransferError(getattr(reply, "message", "unexpected reply"))
                if stream:
                    region, end = self._recv_streamed(conn, peer, job)
                    self.remote_ends[job.key] = end
                    if region.numel() != job.numel:
                        raise TransferError(f"received {region.numel()} of {job.numel} elements")
                elif self.transport == "nccl":
                    region = self._recv_pair(peer, job, reply)
                elif self.transport == "shm":
                    region = self._recv_shm(job, reply)
                elif self.transport == "nixl":
                    region = self._recv_nixl(job, reply)
                else:
                    region = self._recv_stream(conn, job, reply)
                send_message(conn, Ack(True))
                return region
        except TimeoutError:
            raise TransferError(f"no progress from {peer} for {self.lease_s:g} s") from None
        except OSError as e:
            raise TransferError(f"connection to {peer} failed: {e}") from None

    def _recv_streamed(
        self, conn: socket.socket, peer: str, job: FetchJob
    ) -> tuple[torch.Tensor, End]:
        group = None
        try:
            if self.transport == "nccl":
                group = self.pairs.group(peer, 1)
            region, end = recv_streamed(
                conn, job.key, job.group_slots, list(job.layout), job.dtype, self.pieces,
                group, job.device,
            )  # fmt: skip
        except TransferError:
            if self.transport == "nccl":
                self.pairs.drop(peer)
                self._rendezvous.pop(peer, None)
            raise
        except Exception as e:  # building the pair failed
            self.pairs.drop(peer)
            self._rendezvous.pop(peer, None)
            raise TransferError(f"pair with {peer} failed: {e}") from None
        return region.to(job.device), end

    def _recv_stream(self, conn: socket.socket, job: FetchJob, reply: PullReply) -> torch.Tensor:
        region = host_empty(job.numel, job.dtype)
        buffer = as_bytes(region)  # the chunks land in the region itself
        nbytes, offset = len(buffer), 0
        for i in range(reply.num_chunks):
            chunk = recv_message(conn)
            if not isinstance(chunk, Chunk) or chunk.index != i:
                raise TransferError("chunks out of order")
            if offset + chunk.nbytes > nbytes:
                raise TransferError("the producer sent more bytes than asked")
            data = buffer[offset : offset + chunk.nbytes]
            recv_into_exact(conn, data)
            if crc32(data) != chunk.crc32:
                raise TransferError(f"chunk {i} failed its checksum")
            offset += chunk.nbytes
        if offset != nbytes:
            raise TransferError(f"received {offset} of {nbytes} bytes")
        return region.to(job.device)

    def _recv_shm(self, job: FetchJob, reply: PullReply) -> torch.Tensor:
        nbytes = job.numel * torch.empty(0, dtype=job.dtype).element_size()
        try:
            segment = shared_memory.SharedMemory(name=reply.shm_name)
        except OSError as e:
            raise TransferError(f"shared-memory segment {reply.shm_name}: {e}") from None
        # The producer owns (and unlinks) it: keep this process's tracker out of it.
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
        try:
            data = bytes(segment.buf[:nbytes])
        finally:
            segment.close()
        if crc32(data) != reply.crc32:
            raise TransferError("the shared-memory region failed its checksum")
        region = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(job.dtype)
        return region.to(job.device)

    def _recv_nixl(self, job: FetchJob, reply: PullReply) -> torch.Tensor:
        from rackserve.disagg.nixl import agent

        region = torch.empty(job.numel, dtype=job.dtype, device=job.device)
        try:
            agent("consumer").read(reply.nixl_agent, reply.nixl_descs, region, self.lease_s)
        except Exception as e:  # NIXL raises its own types: any failure fails the pull
            raise TransferError(f"NIXL read failed: {e}") from None
        if reply.crc32 and region.device.type == "cpu" and crc32(as_bytes(region)) != reply.crc32:
            raise TransferError("the region failed its checksum")
        return region

    def _recv_pair(self, peer: str, job: FetchJob, reply: PullReply) -> torch.Tensor:
        region = torch.empty(job.numel, dtype=job.dtype, device=job.device)
        try:
            group = self.pairs.group(peer, 1)
            group.recv([region], 0, 0).wait()
        except Exception as e:
            self.pairs.drop(peer)
            self._rendezvous.pop(peer, None)
            raise TransferError(f"pair receive from {peer} failed: {e}") from None
        if reply.crc32 and region.device.type == "cpu" and crc32(as_bytes(region)) != reply.crc32:
            raise TransferError("the region failed its checksum")
        return region

    def heartbeat(self, host: str, port: int, keys: list[str]) -> list[str]:
        """Extend the producer's leases of ``keys``; returns the ones it no longer holds."""
        with self._connect(host, port) as conn:
            send_message(conn, Heartbeat(keys))
            reply = recv_message(conn)
        if not isinstance(reply, HeartbeatReply):
            raise TransferError("unexpected heartbeat reply")
        return reply.missing
