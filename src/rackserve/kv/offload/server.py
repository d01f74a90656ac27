"""A host KV pool shared by the engines of one host: a pool server process speaking ZMQ,
and :class:`RemoteKVPool`, its client behind the :class:`~rackserve.kv.offload.pool.KVPool`
interface (so a turn routed to another engine still finds its prefix).

``rackserve kv-pool --memory 8G --endpoint tcp://127.0.0.1:5600`` runs the server; engines
join with ``--kv-offload-server tcp://127.0.0.1:5600``. Keys carry each engine's namespace
(model and cache layout), so engines of different models can share one server safely.

Protocol: REQ/ROUTER, one msgpack ``[op, arg]`` per request, one msgpack reply::

    put       [[key, bytes], ...]  -> [[evicted key, ...], used bytes]
    get       [key, ...]           -> [bytes | None, ...]
    contains  [key, ...]           -> [bool, ...]
    usage     None                 -> [num entries, used bytes, capacity bytes]
    clear     prefix               -> None
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
import zmq

from rackserve.kv.offload.pool import LocalKVPool, PoolUsage

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 10_000


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class KVPoolServer:
    """Serves one :class:`LocalKVPool` on ``endpoint`` until :meth:`stop`."""

    def __init__(self, capacity_bytes: int, endpoint: str) -> None:
        self.pool = LocalKVPool(capacity_bytes)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(0)
            self._context.term()
            raise ValueError(f"KV pool server: cannot bind {endpoint} ({e})") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()

    def handle(self, op: str, arg: Any) -> Any:
        pool = self.pool
        if op == "put":
            evicted = pool.put([(bytes(k), _tensor(v)) for k, v in arg])
            return [evicted, pool.usage().used_bytes]
        if op == "get":
            return [None if v is None else v.numpy().tobytes() for v in pool.get(arg)]
        if op == "contains":
            return pool.contains(arg)
        if op == "usage":
            u = pool.usage()
            return [u.num_entries, u.used_bytes, u.capacity_bytes]
        if op == "clear":
            pool.clear(bytes(arg or b""))
            return None
        raise ValueError(f"unknown KV pool op {op!r}")

    def serve_forever(self, poll_ms: int = 100) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(poll_ms):
                continue
            ident, empty, payload = self._socket.recv_multipart()
            try:
                op, arg = msgspec.msgpack.decode(payload)
                reply = {"ok": self.handle(op, arg)}
            except Exception as e:  # a bad request fails alone, the server goes on
                reply = {"error": f"{type(e).__name__}: {e}"}
            self._socket.send_multipart([ident, empty, msgspec.msgpack.encode(reply)])
        self._socket.close(0)
        self._context.term()

    def start(self) -> threading.Thread:
        """Serve in a daemon thread (tests, in-process use)."""
        thread = threading.Thread(target=self.serve_forever, name="kv-pool-server", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()


class RemoteKVPool:
    """The client of a :class:`KVPoolServer`; thread-safe. A REQ socket per kind of call,
    each under its own lock (stores, loads, lookups), so neither an engine-thread lookup nor
    a load that a request waits for queues behind a store in flight.
    A server that does not answer within ``timeout_ms`` raises ``ConnectionError`` (the
    offloader then treats the blocks as missing: recompute, never a wrong result)."""

    def __init__(self, endpoint: str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self._context = zmq.Context()
        self._channels = {name: [threading.Lock(), self._connect()] for name in _CHANNELS}
        self.capacity_bytes = self.usage().capacity_bytes

    def _connect(self) -> zmq.Socket:
        socket = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        socket.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        socket.connect(self.endpoint)
        return socket

    def _call(self, op: str, arg: Any = None) -> Any:
        channel = self._channels[_CHANNEL_OF[op]]
        with channel[0]:
            socket = channel[1]
            try:
                socket.send(msgspec.msgpack.encode([op, arg]))
                reply = msgspec.msgpack.decode(socket.recv())
            except zmq.Again:
                socket.close(0)  # a REQ socket that missed its reply is stuck
                channel[1] = self._connect()
                raise ConnectionError(
                    f"KV pool server {self.endpoint} did not answer within {self.timeout_ms} ms"
                ) from None
        if "error" in reply:
            raise RuntimeError(f"KV pool server: {reply['error']}")
        return reply["ok"]

    def put(self, entries: Sequence[tuple[bytes, torch.Tensor]]) -> list[bytes]:
        payload = [[k, v.numpy().tobytes()] for k, v in entries]
        evicted, _ = self._call("put", payload)
        return [bytes(k) for k in evicted]

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        return [None if v is None else _tensor(v) for v in self._call("get", list(keys))]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return list(self._call("contains", list(keys)))

    def usage(self) -> PoolUsage:
        return PoolUsage(*self._call("usage"))

    def clear(self, prefix: bytes = b"") -> None:
        self._call("clear", prefix)

    def close(self) -> None:
        for lock, socket in self._channels.values():
            with lock:
                socket.close(0)
        self._context.term()


_CHANNELS = ("store", "load", "lookup")
_CHANNEL_OF = {
    "put": "store",
    "clear": "store",
    "get": "load",
    "contains": "lookup",
    "usage": "lookup",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    from rackserve.server.options import parse_bytes

    p = subparsers.add_parser(
        "kv-pool", help="host KV pool server shared by the engines of this host"
    )
    p.add_argument("--memory", type=parse_bytes, required=True, help="pool bytes, e.g. 8G")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5600", help="ZMQ address to bind")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    server = KVPoolServer(args.memory, args.endpoint)
    print(f"KV pool: {args.memory} bytes on {server.endpoint}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.stop()
    return 0
