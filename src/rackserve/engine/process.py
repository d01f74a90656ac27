"""The engine-core process: an ``EngineCore`` behind two ZMQ sockets.

    API process                                 engine-core process
    PUSH (bind) --[type, msgpack]--> PULL --input thread--> input queue --+
                                                                          | busy loop:
    PULL (bind) <--[type, msgpack]-- PUSH <--output thread-- output queue <+ step()

The busy loop never touches a socket: IO threads decode and encode msgspec messages into
thread-safe queues, so a slow client or a large message never delays a step. The loop
blocks on the input queue only when the core has no work. Messages are two frames, a
one-byte ``MessageType`` and a msgpack payload, so the receiver decodes each payload into
its exact type. The API process binds ``ipc://`` sockets in a temporary directory and
passes their addresses here; a watcher thread exits this process when its parent dies.
"""

from __future__ import annotations

import enum
import faulthandler
import importlib
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import zmq

from rackserve.config import EngineConfig
from rackserve.engine.outputs import EngineCoreOutputs, EngineCoreRequest

DEFAULT_CORE_FACTORY = "rackserve.engine.core:EngineCore"
PARENT_POLL_S = 0.2
IO_POLL_MS = 100  # how often idle IO threads look at the stop flag
IPC_DIR_PREFIX = "rackserve-"  # the API process's temporary directory of ipc:// sockets


class MessageType(enum.IntEnum):
    # API -> engine
    ADD = 1  # EngineCoreRequest
    ABORT = 2  # list[str] of request ids
    PING = 3  # int: a token echoed by PONG
    SHUTDOWN = 4  # no payload
    # engine -> API
    READY = 10  # EngineReady
    OUTPUTS = 11  # EngineCoreOutputs
    PONG = 12  # int
    REQUEST_ERROR = 13  # RequestError: add_request refused a request
    DEAD = 14  # EngineDead: the loop failed; the process exits next


class EngineReady(msgspec.Struct, array_like=True):
    max_model_len: int
    eos_token_ids: list[int]
    pid: int


class RequestError(msgspec.Struct, array_like=True):
    request_id: str
    message: str
    # the engine's side failed, not the request (a KV transfer under policy "fail"): a 5xx
    server_side: bool = False


class EngineDead(msgspec.Struct, array_like=True):
    message: str


PAYLOAD_TYPES: dict[MessageType, Any] = {
    MessageType.ADD: EngineCoreRequest,
    MessageType.ABORT: list[str],
    MessageType.PING: int,
    MessageType.SHUTDOWN: None,
    MessageType.READY: EngineReady,
    MessageType.OUTPUTS: EngineCoreOutputs,
    MessageType.PONG: int,
    MessageType.REQUEST_ERROR: RequestError,
    MessageType.DEAD: EngineDead,
}

_encoder = msgspec.msgpack.Encoder()


def encode_message(kind: MessageType, payload: Any = None) -> list[bytes]:
    return [bytes([kind]), _encoder.encode(payload)]


def decode_message(frames: list[bytes]) -> tuple[MessageType, Any]:
    """Decode two frames; raises ValueError (or msgspec.DecodeError) on a malformed one."""
    if len(frames) != 2 or len(frames[0]) != 1:
        raise ValueError(f"expected 2 frames [type, payload], got {len(frames)}")
    kind = MessageType(frames[0][0])
    return kind, msgspec.msgpack.decode(frames[1], type=PAYLOAD_TYPES[kind])


class EngineCoreLike(Protocol):
    """What the loop needs from an engine core (``rackserve.engine.core.EngineCore``)."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int

    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: Any) -> None: ...
    def step(self) -> EngineCoreOutputs: ...
    def has_unfinished_requests(self) -> bool: ...
    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class EngineProcessConfig:
    """Everything the child process needs; picklable (the process is spawned)."""

    engine_config: EngineConfig
    input_address: str
    output_address: str
    parent_pid: int
    core_factory: str = DEFAULT_CORE_FACTORY  # "module:callable" taking an EngineConfig


def load_core_factory(path: str) -> Callable[[EngineConfig], EngineCoreLike]:
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"core factory {path!r} must look like 'package.module:callable'")
    return getattr(importlib.import_module(module_name), attr)


class EngineCoreProc:
    """The loop and its IO threads; ``run`` returns the process exit code."""

    def __init__(self, core: EngineCoreLike, context: zmq.Context, config: EngineProcessConfig):
        self.core = core
        self.input_queue: queue.Queue[tuple[MessageType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[list[bytes] | None] = queue.Queue()
        self.stop_event = threading.Event()
        self.shutdown_requested = False
        self.last_stats: Any = None
        input_socket = context.socket(zmq.PULL)
        input_socket.connect(config.input_address)
        output_socket = context.socket(zmq.PUSH)
        output_socket.connect(config.output_address)
        self.input_thread = threading.Thread(
            target=self._input_loop, args=(input_socket,), name="engine-input", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self._output_loop, args=(output_socket,), name="engine-output", daemon=True
        )

    # ---- IO threads (the only users of their sockets) ------------------------------------
    def _input_loop(self, socket: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        while not self.stop_event.is_set():
            if not poller.poll(IO_POLL_MS):
                continue
            frames = socket.recv_multipart()
            try:
                self.input_queue.put(decode_message(frames))
            except (ValueError, msgspec.DecodeError) as e:
                # A malformed message is the sender's bug; it must not stop the engine.
                print(f"engine core: dropped a malformed input message: {e}", flush=True)
                self._reject_undecodable(frames, str(e))
        socket.close(linger=0)

    def _reject_undecodable(self, frames: list[bytes], message: str) -> None:
        """An ADD whose payload fails validation (a value out of range) still names its
        request: answer REQUEST_ERROR so that request fails at once instead of hanging."""
        if len(frames) != 2 or frames[0] != bytes([MessageType.ADD]):
            return
        try:
            request_id = msgspec.msgpack.decode(frames[1])[0]
        except Exception:
            return
        if isinstance(request_id, str):
            self.send(MessageType.REQUEST_ERROR, RequestError(request_id, message))

    def _output_loop(self, socket: zmq.Socket) -> None:
        while (frames := self.output_queue.get()) is not None:
            socket.send_multipart(frames, copy=False)
        socket.close(linger=2000)  # flush the last messages (DEAD, final outputs)

    def send(self, kind: MessageType, payload: Any = None) -> None:
        self.output_queue.put(encode_message(kind, payload))

    # ---- the loop ------------------------------------------------------------------------
    def _handle(self, kind: MessageType, payload: Any) -> bool:
        """Apply one input message; returns True if it may have changed the stats."""
        if kind == MessageType.ADD:
            try:
                self.core.add_request(payload)
            except Exception as e:  # bad input must never take the engine down
                self.send(MessageType.REQUEST_ERROR, RequestError(payload.request_id, str(e)))
                return False
            return True
        if kind == MessageType.ABORT:
            self.core.abort_requests(payload)
            return True
        if kind == MessageType.PING:
            self.send(MessageType.PONG, payload)
        elif kind == MessageType.SHUTDOWN:
            self.shutdown_requested = True
        return False

    def _step(self) -> None:
        step_start = time.monotonic()
        self._send_outputs(self.core.step(), step_start)
        self._after_send()
        take_errors = getattr(self.core, "take_request_errors", None)  # P/D: failed loads
        for request_id, message in take_errors() if take_errors is not None else ():
            self.send(MessageType.REQUEST_ERROR, RequestError(request_id, message, True))

    def _send_outputs(self, outputs, step_start: float | None = None) -> None:
        """Send a step's outputs when there are any or the stats changed."""
        stats = outputs.scheduler_stats
        if outputs.outputs or stats != self.last_stats:
            if step_start is not None:
                # The step's monotonic start replaces the core's wall-clock stamp: the
                # frontend derives queue times from it (CLOCK_MONOTONIC is host-wide).
                outputs.timestamp = step_start
            self.send(MessageType.OUTPUTS, outputs)
            self.last_stats = stats

    def _after_send(self) -> None:
        """The work a step leaves for after its outputs are queued: a P/D prefill's KV
        export (``EngineCore.flush_kv_exports``), so its answer does not wait on it."""
        flush = getattr(self.core, "flush_kv_exports", None)  # (test cores may lack it)
        if flush is not None:
            flush()

    @property
    def name(self) -> str:
        return "engine core"

    def _iterate(self) -> bool:
        """One turn of the loop: take the input, step when there is work; False stops."""
        core = self.core
        stats_dirty = False
        if not core.has_unfinished_requests():
            stats_dirty |= self._handle(*self.input_queue.get())  # idle: block
        while True:
            try:
                stats_dirty |= self._handle(*self.input_queue.get_nowait())
            except queue.Empty:
                break
        if self.shutdown_requested:
            return False
        take_outputs = getattr(core, "take_outputs", None)  # (test cores may lack it)
        early = take_outputs() if take_outputs is not None else None
        if early is not None:  # a P/D request's first token: out before the step's work
            self._send_outputs(early, time.monotonic())
        # An idle step after an abort refreshes the stats (KV usage drops at once).
        if core.has_unfinished_requests() or stats_dirty:
            self._step()
        return not self.shutdown_requested

    def run(self) -> int:
        """The process's loop around :meth:`_iterate`; a crash is reported as DEAD."""
        self.input_thread.start()
        self.output_thread.start()
        core = self.core
        self.send(
            MessageType.READY,
            EngineReady(core.max_model_len, list(core.eos_token_ids), os.getpid()),
        )
        exit_code = 0
        try:
            while self._iterate():
                pass
        except Exception:
            exit_code = 1
            message = traceback.format_exc()
            print(f"{self.name} died:\n{message}", flush=True)
            self.send(MessageType.DEAD, EngineDead(message[-4000:]))
        finally:
            try:
                core.shutdown()
            finally:
                self.stop_event.set()
                self.output_queue.put(None)
                self.output_thread.join(timeout=5)
                self.input_thread.join(timeout=1)
        return exit_code


def ipc_directory(address: str) -> Path | None:
    """The directory of an ``ipc://`` socket address (None for other transports)."""
    if not address.startswith("ipc://"):
        return None
    return Path(address.removeprefix("ipc://")).parent


def _watch_parent(parent_pid: int, ipc_dir: Path | None) -> None:
    """Exit at once when the API process is gone, so no engine outlives its server. A
    killed API process cannot remove its IPC directory: the engine does it on its way out
    (only a directory named as the client creates it, so a bad address removes nothing)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            if ipc_dir is not None and ipc_dir.name.startswith(IPC_DIR_PREFIX):
                shutil.rmtree(ipc_dir, ignore_errors=True)
            os._exit(1)


def run_engine_core(config: EngineProcessConfig) -> None:
    """Entry point of the spawned process."""
    # Ctrl-C reaches the whole process group and SIGTERM may too (systemd): the API process
    # owns shutdown (it drains first, then sends SHUTDOWN), so the engine ignores both.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: dump stacks
    ipc_dir = ipc_directory(config.input_address)
    threading.Thread(
        target=_watch_parent, args=(config.parent_pid, ipc_dir), name="parent-watch", daemon=True
    ).start()
    context = zmq.Context()
    try:
        core = load_core_factory(config.core_factory)(config.engine_config)
    except Exception as exc:
        # Bad configuration (ValueError names the fix) reads best as one line.
        message = str(exc) if isinstance(exc, ValueError) else traceback.format_exc()
        print(f"engine core failed to start:\n{message}", flush=True)
        socket = context.socket(zmq.PUSH)
        socket.connect(config.output_address)
        socket.send_multipart(encode_message(MessageType.DEAD, EngineDead(message[-4000:])))
        socket.close(linger=2000)
        context.term()
        raise SystemExit(1) from None
    exit_code = EngineCoreProc(core, context, config).run()
    context.destroy(linger=0)
    raise SystemExit(exit_code)
