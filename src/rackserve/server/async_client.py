"""The API process's client of the engine-core process.

``start`` binds two ``ipc://`` sockets in a fresh temporary directory, spawns the engine
process (``rackserve.engine.process``) and waits for its READY message. One asyncio task
receives engine messages and runs the ``OutputProcessor`` (detokenization, stop strings,
n > 1 fan-out), routing each ``RequestOutput`` to its request's asyncio queue; another
task sends queued messages, so callers (even ``finally`` blocks) enqueue synchronously and
messages keep their order. Engine death is noticed at once through the process sentinel
(an fd that becomes readable when the process exits) or the engine's DEAD message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import shutil
import tempfile
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from rackserve.config import EngineConfig
from rackserve.engine.output_processor import OutputProcessor
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.engine.process import (
    DEFAULT_CORE_FACTORY,
    IPC_DIR_PREFIX,
    EngineDead,
    EngineProcessConfig,
    EngineReady,
    MessageType,
    RequestError,
    decode_message,
    encode_message,
    run_engine_core,
)
from rackserve.engine.request_output import RequestOutput, RequestOutputKind
from rackserve.request import SamplingParams
from rackserve.server.metrics import ServerMetrics


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


class RequestRejectedError(ValueError):
    """The engine core refused a request (bad input the API layer did not catch)."""


class RequestFailedError(RuntimeError):
    """This request's outputs could not be processed (a bug, not bad input); the others go on."""


class KVLoadFailedError(RuntimeError):
    """The request's KV could not be loaded from its prefill engine (P/D, policy "fail")."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (client disconnect) while a consumer waited for it."""


class ServerShutdownError(RuntimeError):
    """The request was still running when the shutdown drain timed out."""


class AsyncEngineClient:
    """Owns the engine process and routes its outputs to per-request queues."""

    def __init__(
        self,
        engine_config: EngineConfig,
        tokenizer: Any,
        *,
        core_factory: str = DEFAULT_CORE_FACTORY,
        metrics: ServerMetrics | None = None,
        on_engine_dead: Callable[[], None] | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.engine_config = engine_config
        self.processor = OutputProcessor(tokenizer)
        self.core_factory = core_factory
        self.metrics = metrics
        self.on_engine_dead = on_engine_dead
        self.startup_timeout_s = startup_timeout_s
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.process: Any = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._send_queue: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._ping_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._shutting_down = False
        self._tmpdir: str | None = None
        self._context: zmq.asyncio.Context | None = None
        # request id -> the DP rank its X-data-parallel-rank header pins it to
        self._pinned_ranks: dict[str, int] = {}
        self._input_socket: Any = None
        self._output_socket: Any = None

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        """Engine ranks behind this client (``X-data-parallel-rank`` takes 0 .. size - 1)."""
        return self.engine_config.parallel.data_parallel_size

    @property
    def max_model_len(self) -> int:
        assert self.ready is not None, "start() first"
        return self.ready.max_model_len

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def start(self) -> None:
        """Spawn the engine process and wait until its core is built (weights, KV cache)."""
        self._tmpdir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        self._context = zmq.asyncio.Context()
        self._input_socket = self._context.socket(zmq.PUSH)
        self._output_socket = self._context.socket(zmq.PULL)
        input_address = f"ipc://{self._tmpdir}/input"
        output_address = f"ipc://{self._tmpdir}/output"
        self._input_socket.bind(input_address)
        self._output_socket.bind(output_address)
        config = EngineProcessConfig(
            self.engine_config, input_address, output_address, os.getpid(), self.core_factory
        )
        # spawn, not fork: the API process has threads and an event loop a fork would copy.
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_engine_core, args=(config,), name="rackserve-engine-core"
        )
        self.process.start()
        try:
            await self._wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        loop = asyncio.get_running_loop()
        loop.add_reader(self.process.sentinel, self._on_process_exit)
        self._tasks = [
            asyncio.create_task(self._output_loop(), name="engine-outputs"),
            asyncio.create_task(self._send_loop(), name="engine-inputs"),
        ]

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout_s
        while loop.time() < deadline:
            if await self._output_socket.poll(200, zmq.POLLIN):
                kind, payload = decode_message(await self._output_socket.recv_multipart())
                if kind == MessageType.READY:
                    self.ready = payload
                    return
                if kind == MessageType.DEAD:
                    raise EngineDeadError(f"engine core failed to start:\n{payload.message}")
            elif not self.process.is_alive():
                raise EngineDeadError(
                    f"engine core process exited during start-up (code {self.process.exitcode})"
                )
        raise EngineDeadError(f"engine core not ready after {self.startup_timeout_s:.0f} s")

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine (SHUTDOWN, then SIGKILL after ``timeout_s``) and free everything."""
        self._shutting_down = True
        process = self.process
        if process is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(process.sentinel)
            if process.is_alive() and self._input_socket is not None:
                with contextlib.suppress(zmq.ZMQError):
                    await self._input_socket.send_multipart(
                        encode_message(MessageType.SHUTDOWN), flags=zmq.NOBLOCK
                    )
            await asyncio.to_thread(process.join, timeout_s)
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5)
        await self._release()

    async def _release(self) -> None:
        """The end of a shutdown, once the engine processes are gone: stop the IO tasks,
        fail what is still waiting, drop the sockets and the IPC directory."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(EngineDeadError("server is shutting down"))
        if self._context is not None:
            self._context.destroy(linger=0)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ---- requests ------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        kind: RequestOutputKind = RequestOutputKind.DELTA,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Closing the iterator early (client
        disconnect, cancellation) aborts the request in the engine. ``data_parallel_rank``
        pins the request (and its ``n > 1`` children) to one DP rank, as vLLM's header does."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} is out of range "
                f"[0, {self.data_parallel_size})"
            )
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        requests = self.processor.add_request(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            kind=kind,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
        )
        finished = False
        try:
            # Inside the try: whatever fails from here on (even encoding the message) frees
            # the request's frontend state and engine state alike.
            self._queues[request_id] = queue
            if data_parallel_rank is not None:
                self._pinned_ranks[request_id] = data_parallel_rank
            for request in requests:
                self._send(MessageType.ADD, request)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            self._pinned_ranks.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a client request: frees its KV blocks in the engine, wakes its consumer."""
        engine_ids = self.processor.abort_request(request_id)
        if engine_ids and not self.is_dead:
            self._send(MessageType.ABORT, engine_ids)
            if self.metrics is not None:
                # The engine sends nothing for an aborted request: count it here, once per
                # unfinished engine request, as vLLM's request_success{finished_reason="abort"}.
                self.metrics.record_abort(len(engine_ids))
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(RequestAbortedError(f"request {request_id} was aborted"))

    async def check_health(self, timeout_s: float = 10.0) -> None:
        """Raise EngineDeadError unless the engine loop answers a ping within ``timeout_s``."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        ping_id = next(self._ping_ids)
        future = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = future
        self._send(MessageType.PING, ping_id)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise EngineDeadError(f"engine core did not answer within {timeout_s} s") from None
        finally:
            self._pings.pop(ping_id, None)

    # ---- IO tasks ------------------------------------------------------------------------
    def _send(self, kind: MessageType, payload: Any = None) -> None:
        self._send_queue.put_nowait(encode_message(kind, payload))

    async def _send_loop(self) -> None:
        while True:
            frames = await self._send_queue.get()
            await self._input_socket.send_multipart(frames, copy=False)

    async def _output_loop(self) -> None:
        while True:
            frames = await self._output_socket.recv_multipart()
            try:
                self._on_message(*decode_message(frames))
            except Exception:
                # A bug here leaves request state unknown: fail every request loudly (and let
                # the server exit) rather than leave clients waiting forever.
                traceback.print_exc()
                self._set_dead("the API process failed to handle an engine message")

    def _on_message(self, kind: MessageType, payload: Any) -> None:
        if kind == MessageType.OUTPUTS:
            self._on_outputs(payload)
        elif kind == MessageType.PONG:
            future = self._pings.get(payload)
            if future is not None and not future.done():
                future.set_result(None)
        elif kind == MessageType.REQUEST_ERROR:
            self._on_request_error(payload)
        elif kind == MessageType.DEAD:
            self._set_dead(f"engine core died: {_last_line(payload)}")

    def _on_outputs(self, outputs: Any) -> None:
        for output in outputs.outputs:
            if output.error is not None:  # failed alone in the engine (freed there): a 400
                self._on_request_error(RequestError(output.request_id, output.error))
        # The engine process stamps each batch with its step's monotonic start time.
        processed = self.processor.process_outputs(outputs, step_start=outputs.timestamp or None)
        for request_id, message in processed.failed:  # forgotten by the processor: a 500
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(RequestFailedError(message))
        for output in processed.request_outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        if processed.abort_ids:
            self._send(MessageType.ABORT, processed.abort_ids)
        for request in processed.to_send:
            self._send_request(request)
        if self.metrics is not None:
            self.metrics.record_iteration(processed.stats)
            if outputs.scheduler_stats is not None:
                self.metrics.record_scheduler_stats(outputs.scheduler_stats)

    def _send_request(self, request: EngineCoreRequest) -> None:
        """Send a released child; one that cannot be encoded fails its own request only."""
        try:
            self._send(MessageType.ADD, request)
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as e:
            self._on_request_error(RequestError(request.request_id, f"invalid request: {e}"))

    def fail_all_requests(self, error: Exception) -> None:
        """Wake every waiting request with ``error`` (the shutdown drain has timed out); their
        generators then abort them in the engine."""
        self._fail_all(error)

    def _on_request_error(self, error: RequestError) -> None:
        parent_id = self.processor.parent_id(error.request_id)
        if parent_id is None:
            return
        engine_ids = self.processor.abort_request(parent_id)
        if engine_ids:
            self._send(MessageType.ABORT, engine_ids)
        queue = self._queues.get(parent_id)
        if queue is not None:
            kind = KVLoadFailedError if error.server_side else RequestRejectedError
            queue.put_nowait(kind(error.message))

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        if not self._shutting_down:
            code = self.process.exitcode
            self._set_dead(f"engine core process exited unexpectedly (exit code {code})")

    def _set_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self._fail_all(EngineDeadError(reason))
        if self.on_engine_dead is not None and not self._shutting_down:
            self.on_engine_dead()

    def _fail_all(self, error: Exception) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
        for future in self._pings.values():
            if not future.done():
                future.set_exception(error)


def _last_line(dead: EngineDead) -> str:
    lines = [line for line in dead.message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"
