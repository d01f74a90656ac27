"""A DP rank's engine-core process: ``process.py``'s loop with the per-step DP sync.

    front end (API process, head host)          rank r (this process, any host)
    PUSH input[r]  (bind) --ADD/ABORT/...-->   PULL  -> input queue --+
    PULL output[r] (bind) <--OUTPUTS/READY---   PUSH <- output queue <-+ loop: dp_step()

Each rank has its own pair of sockets, so the front end knows which rank spoke and sends a
request to exactly one. Addresses: one host, ``ipc://`` in a temporary directory; several
hosts, TCP on the head (``dp_addresses``). torch.distributed (gloo or NCCL) joins the ranks
for the MoE all-to-alls and the DP sync; rank 0's host is its rendezvous.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from dataclasses import dataclass

import zmq

from rackserve.config import ConfigError, EngineConfig, ParallelConfig
from rackserve.engine.dp import dp_step
from rackserve.engine.process import (
    EngineCoreProc,
    EngineDead,
    EngineProcessConfig,
    MessageType,
    _watch_parent,
    encode_message,
    ipc_directory,
)
from rackserve.parallel.groups import (
    ParallelGroups,
    ParallelLayout,
    default_backend,
    destroy_distributed,
    init_distributed,
)

IDLE_POLL_S = 0.005  # an idle rank waits this long for input between DP syncs


def dp_addresses(parallel: ParallelConfig, rank: int) -> tuple[str, str]:
    """(input, output) TCP addresses of ``rank``'s sockets on the head host: the two ports
    after ``data_parallel_rpc_port`` + 1 (which is torch.distributed's rendezvous)."""
    assert parallel.data_parallel_rpc_port is not None
    base = parallel.data_parallel_rpc_port + 2 + 2 * rank
    host = parallel.data_parallel_address
    return f"tcp://{host}:{base}", f"tcp://{host}:{base + 1}"


def num_dp_ports(data_parallel_size: int) -> int:
    """Ports from ``data_parallel_rpc_port`` on that a launch of this DP size uses: the
    rpc port, the rendezvous (``dist_port``) and each rank's two (``dp_addresses``)."""
    return 2 + 2 * data_parallel_size


def dist_port(parallel: ParallelConfig) -> int:
    assert parallel.data_parallel_rpc_port is not None
    return parallel.data_parallel_rpc_port + 1


@dataclass(frozen=True)
class DPRankConfig:
    """What one rank's process needs (picklable: the process is spawned)."""

    process: EngineProcessConfig
    rank: int
    master_addr: str
    master_port: int
    watch_parent: bool = True


class DPEngineCoreProc(EngineCoreProc):
    """The engine loop of one DP rank: every iteration all ranks sync, then all step (idle
    ranks run the dummy pass) or none does; SHUTDOWN on any rank stops them all."""

    def __init__(
        self, core, context: zmq.Context, config: EngineProcessConfig, groups: ParallelGroups
    ) -> None:
        super().__init__(core, context, config)
        self.groups = groups

    @property
    def name(self) -> str:
        return f"engine core (DP rank {self.groups.rank})"

    def _iterate(self) -> bool:
        core = self.core
        stats_dirty = False
        try:
            if not core.has_unfinished_requests():
                # Idle: wait briefly for input, then sync again (the other ranks may have
                # work, and they cannot step without us).
                stats_dirty |= self._handle(*self.input_queue.get(timeout=IDLE_POLL_S))
            while True:
                stats_dirty |= self._handle(*self.input_queue.get_nowait())
        except queue.Empty:
            pass
        outputs, _, shutdown = dp_step(
            core, self.groups, want_step=stats_dirty, shutdown=self.shutdown_requested
        )
        if outputs is not None and not shutdown:
            self._send_outputs(outputs)
            self._after_send()
        return not shutdown


def run_dp_engine_core(config: DPRankConfig) -> None:
    """Entry point of one spawned rank."""
    from rackserve.engine.core import EngineCore

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: dump stacks
    if config.watch_parent:
        # a killed API process leaves its ipc:// directory: the ranks remove it
        ipc_dir = ipc_directory(config.process.input_address)
        threading.Thread(
            target=_watch_parent, args=(config.process.parent_pid, ipc_dir), daemon=True
        ).start()
    engine_config = config.process.engine_config
    parallel = engine_config.parallel
    context = zmq.Context()
    try:
        layout = ParallelLayout(parallel.data_parallel_size, parallel.expert_parallel_size)
        backend = default_backend("cuda" if engine_config.device == "cuda" else "cpu")
        groups = init_distributed(
            config.rank, layout, config.master_addr, config.master_port, backend
        )
        core = EngineCore(_for_rank(engine_config, config.rank), groups=groups)
    except Exception as exc:
        message = str(exc) if isinstance(exc, ValueError) else traceback.format_exc()
        print(f"engine core (DP rank {config.rank}) failed to start:\n{message}", flush=True)
        socket = context.socket(zmq.PUSH)
        socket.connect(config.process.output_address)
        socket.send_multipart(encode_message(MessageType.DEAD, EngineDead(message[-4000:])))
        socket.close(linger=2000)
        context.term()
        raise SystemExit(1) from None
    exit_code = DPEngineCoreProc(core, context, config.process, groups).run()
    destroy_distributed()
    context.destroy(linger=0)
    raise SystemExit(exit_code)


def _for_rank(config: EngineConfig, rank: int) -> EngineConfig:
    """One GPU per rank: rank r of a host uses that host's GPU r - start rank. A P/D prefill
    engine's rank r serves its KV on kv_port + r (the serving layer tells the router which:
    ``kv_transfer_port``)."""
    if config.device.startswith("cuda") and ":" not in config.device:
        import torch

        if torch.cuda.is_available():
            local = rank - config.parallel.data_parallel_start_rank
            torch.cuda.set_device(local % torch.cuda.device_count())
    return kv_transfer_for_rank(config, rank)


def kv_transfer_for_rank(config: EngineConfig, rank: int) -> EngineConfig:
    """``config`` with rank ``rank``'s KV port (producers: kv_port + rank; others as is)."""
    kv = config.kv_transfer
    if kv is None or not kv.is_producer or rank == 0:
        return config
    if kv.kv_port + rank > 65535:
        raise ConfigError(f"kv_port {kv.kv_port} + DP rank {rank} is not a valid port")
    engine_id = f"{kv.engine_id}/dp{rank}" if kv.engine_id else ""
    return dataclasses.replace(
        config, kv_transfer=dataclasses.replace(kv, kv_port=kv.kv_port + rank, engine_id=engine_id)
    )


def spawn_ranks(
    engine_config: EngineConfig,
    addresses: list[tuple[str, str]],
    master_addr: str,
    master_port: int,
    parent_pid: int,
) -> list[multiprocessing.process.BaseProcess]:
    """Start this host's ranks (``data_parallel_start_rank`` onwards); addresses[i] are the
    (input, output) sockets of the i-th of them."""
    context = multiprocessing.get_context("spawn")
    start = engine_config.parallel.data_parallel_start_rank
    processes = []
    for i, (input_address, output_address) in enumerate(addresses):
        process_config = EngineProcessConfig(
            engine_config, input_address, output_address, parent_pid
        )
        rank_config = DPRankConfig(process_config, start + i, master_addr, master_port)
        process = context.Process(
            target=run_dp_engine_core, args=(rank_config,), name=f"rackserve-dp-{start + i}"
        )
        process.start()
        processes.append(process)
    return processes


def run_headless(engine_config: EngineConfig) -> int:
    """``serve --headless``: run this host's ranks against the head's sockets until they
    exit (the head's SHUTDOWN, or a failure). Returns the worst exit code."""
    parallel = engine_config.parallel
    start, num_local = parallel.data_parallel_start_rank, parallel.num_local_ranks
    addresses = [dp_addresses(parallel, rank) for rank in range(start, start + num_local)]
    processes = spawn_ranks(
        engine_config,
        addresses,
        parallel.data_parallel_address,
        dist_port(parallel),
        os.getpid(),
    )
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for process in processes:
            process.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    return max((p.exitcode or 0) for p in processes)
