"""The API process's client of N data-parallel engine ranks (``--data-parallel-size N``).

The same interface as ``AsyncEngineClient`` (the API layer cannot tell them apart): one
output processor, one queue per request. Differences: each rank has its own socket pair
(``engine/dp_process.py``); a new request goes to the rank its ``X-data-parallel-rank``
header pins it to, else to the rank the assignment policy picks (``engine/dp.py``; least
load by default), aborts go to the request's rank, pings and
SHUTDOWN to every rank, and every rank's outputs are merged into the one processor. With
several hosts the head binds TCP sockets for every rank and spawns only its own ranks;
the others come from ``serve --headless`` on their hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections import OrderedDict
from typing import Any

import zmq
import zmq.asyncio

from rackserve.engine.dp import DPLoadTracker, make_policy
from rackserve.engine.dp_process import dist_port, dp_addresses, spawn_ranks
from rackserve.engine.outputs import SchedulerStats
from rackserve.engine.process import MessageType, decode_message, encode_message
from rackserve.parallel.groups import free_port
from rackserve.server.async_client import AsyncEngineClient, EngineDeadError
from rackserve.spec_decode.stats import SpecDecodingStats

MAX_FINISHED_RANKS = 4096  # enough for every response being built at once


class DPAsyncEngineClient(AsyncEngineClient):
    """Owns this host's DP ranks and talks to all of them."""

    def __init__(self, *args: Any, assignment_policy: str = "least_load", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parallel = self.engine_config.parallel
        self.num_ranks = self.parallel.data_parallel_size
        self.tracker = DPLoadTracker(self.num_ranks, make_policy(assignment_policy))
        self.processes: list[Any] = []
        self._inputs: list[Any] = []
        self._outputs: list[Any] = []
        self._rank_queue: asyncio.Queue[tuple[int, list[bytes]]] = asyncio.Queue()
        self._rank_stats: list[SchedulerStats | None] = [None] * self.num_ranks
        self._speaking_rank = 0  # the rank whose message is being handled
        # recently finished requests' ranks: a P/D prefill's KV is held by its rank
        self._finished_ranks: OrderedDict[str, int] = OrderedDict()

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        if self.parallel.data_parallel_rpc_port is None:  # one host: ipc + a free port
            self._tmpdir = tempfile.mkdtemp(prefix="rackserve-dp-")
            addresses = [
                (f"ipc://{self._tmpdir}/input{r}", f"ipc://{self._tmpdir}/output{r}")
                for r in range(self.num_ranks)
            ]
            master_addr, master_port = "127.0.0.1", free_port()
        else:
            addresses = [dp_addresses(self.parallel, r) for r in range(self.num_ranks)]
            master_addr, master_port = self.parallel.data_parallel_address, dist_port(self.parallel)
        for input_address, output_address in addresses:
            push, pull = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
            push.bind(input_address)
            pull.bind(output_address)
            self._inputs.append(push)
            self._outputs.append(pull)
        local = addresses[: self.parallel.num_local_ranks]
        self.processes = spawn_ranks(
            self.engine_config, local, master_addr, master_port, os.getpid()
        )
        self.process = self.processes[0]  # the base class's health checks look at rank 0
        try:
            await self._wait_all_ready()
        except BaseException:
            await self.shutdown()
            raise
        loop = asyncio.get_running_loop()
        for process in self.processes:
            loop.add_reader(process.sentinel, self._on_rank_exit, process)
        self._tasks = [
            asyncio.create_task(self._rank_output_loop(r), name=f"dp-outputs-{r}")
            for r in range(self.num_ranks)
        ]
        self._tasks.append(asyncio.create_task(self._rank_send_loop(), name="dp-inputs"))

    async def _wait_all_ready(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout_s
        pending = set(range(self.num_ranks))
        while pending and loop.time() < deadline:
            for rank in sorted(pending):
                socket = self._outputs[rank]
                if not await socket.poll(50, zmq.POLLIN):
                    continue
                kind, payload = decode_message(await socket.recv_multipart())
                if kind == MessageType.READY:
                    self.ready = payload
                    pending.discard(rank)
                elif kind == MessageType.DEAD:
                    raise EngineDeadError(f"DP rank {rank} failed to start:\n{payload.message}")
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                raise EngineDeadError(f"{dead[0].name} exited during start-up")
        if pending:
            raise EngineDeadError(
                f"DP ranks {sorted(pending)} not ready after {self.startup_timeout_s:.0f} s "
                "(headless hosts started with the same --data-parallel-* flags?)"
            )

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._shutting_down = True
        loop = asyncio.get_running_loop()
        for process in self.processes:
            with contextlib.suppress(Exception):
                loop.remove_reader(process.sentinel)
        for socket in self._inputs:  # every rank, headless hosts' too: they stop together
            with contextlib.suppress(zmq.ZMQError):
                await socket.send_multipart(encode_message(MessageType.SHUTDOWN), zmq.NOBLOCK)
        for process in self.processes:
            await asyncio.to_thread(process.join, timeout_s)
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5)
        await self._release()

    # ---- routing -------------------------------------------------------------------------
    def _send(self, kind: MessageType, payload: Any = None) -> None:
        if kind == MessageType.ADD:
            # X-data-parallel-rank pins a client request and its n > 1 children alike
            parent = self.processor.parent_id(payload.request_id)
            pinned = self._pinned_ranks.get(parent) if parent is not None else None
            rank = self.tracker.assign(
                payload.request_id, len(payload.prompt_token_ids), rank=pinned
            )
            self._rank_queue.put_nowait((rank, encode_message(kind, payload)))
        elif kind == MessageType.ABORT:
            by_rank: dict[int, list[str]] = {}
            for request_id in payload:
                rank = self.tracker.finish(request_id)
                if rank is not None:
                    by_rank.setdefault(rank, []).append(request_id)
            for rank, ids in by_rank.items():
                self._rank_queue.put_nowait((rank, encode_message(kind, ids)))
        elif kind == MessageType.PING:
            # Only rank 0 answers; a stuck rank stalls the DP sync, so rank 0 stalls too.
            self._rank_queue.put_nowait((0, encode_message(kind, payload)))
        else:
            for rank in range(self.num_ranks):
                self._rank_queue.put_nowait((rank, encode_message(kind, payload)))

    async def _rank_send_loop(self) -> None:
        while True:
            rank, frames = await self._rank_queue.get()
            await self._inputs[rank].send_multipart(frames, copy=False)

    async def _rank_output_loop(self, rank: int) -> None:
        socket = self._outputs[rank]
        while True:
            frames = await socket.recv_multipart()
            try:
                self._speaking_rank = rank
                self._on_message(*decode_message(frames))
            except Exception:
                import traceback

                traceback.print_exc()
                self._set_dead("the API process failed to handle an engine message")

    def _on_outputs(self, outputs: Any) -> None:
        for output in outputs.outputs:
            if output.finish_reason is not None:
                rank = self.tracker.finish(output.request_id)
                if rank is not None:
                    self._finished_ranks[output.request_id] = rank
                    if len(self._finished_ranks) > MAX_FINISHED_RANKS:
                        self._finished_ranks.popitem(last=False)
            else:
                self.tracker.on_tokens(output.request_id, len(output.new_token_ids))
        if outputs.scheduler_stats is not None:
            # The metrics see the instance: every rank's latest stats, summed.
            self._rank_stats[self._speaking_rank] = outputs.scheduler_stats
            outputs.scheduler_stats = merge_stats(self._rank_stats)
        super()._on_outputs(outputs)

    def kv_transfer_port(self, request_id: str, kv_port: int) -> int:
        """Where the rank that ran a finished P/D prefill request serves its KV: kv_port +
        its rank (engine/dp_process.py); asked once, when the response is built."""
        return kv_port + self._finished_ranks.pop(request_id, 0)

    def _on_rank_exit(self, process: Any) -> None:
        asyncio.get_running_loop().remove_reader(process.sentinel)
        if not self._shutting_down:
            self._set_dead(f"{process.name} exited unexpectedly (exit code {process.exitcode})")


def merge_stats(per_rank: list[SchedulerStats | None]) -> SchedulerStats:
    """One instance's stats from its ranks': counts and cumulative counters summed, KV usage
    the fullest rank's, expert balancedness as reported (all-reduced: the same everywhere)."""
    known = [s for s in per_rank if s is not None]
    balanced = next((s for s in known if s.expert_balancedness is not None), None)
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in known),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in known),
        kv_cache_usage=max((s.kv_cache_usage for s in known), default=0.0),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in known),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in known),
        num_preemptions=sum(s.num_preemptions for s in known),
        expert_balancedness=balanced.expert_balancedness if balanced else None,
        expert_balancedness_uniform=balanced.expert_balancedness_uniform if balanced else None,
        prefix_cache_pool_hits=sum(s.prefix_cache_pool_hits for s in known),
        kv_offload_bytes=sum(s.kv_offload_bytes for s in known),
        kv_load_bytes=sum(s.kv_load_bytes for s in known),
        kv_pool_usage=max((s.kv_pool_usage for s in known), default=0.0),
        spec_decoding=SpecDecodingStats.total([s.spec_decoding for s in known]),
    )
