"""Launch a function on N local ranks (processes) joined in torch.distributed groups.

Used by the multi-process tests and single-host benchmarks: ``run_ranks(fn, world_size,
*args)`` spawns the processes, each calls ``fn(groups, *args)`` with its
``ParallelGroups``, and the per-rank return values come back in rank order. The master
port is a free loopback port chosen at launch (never a fixed one).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from rackserve.parallel.groups import (
    ParallelGroups,
    ParallelLayout,
    destroy_distributed,
    free_port,
    init_distributed,
)


def _worker(
    rank: int,
    fn: Callable[..., Any],
    layout: ParallelLayout,
    port: int,
    backend: str,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    # Many ranks share few cores: intra-op threads would only fight each other.
    torch.set_num_threads(1)
    try:
        groups = init_distributed(rank, layout, "127.0.0.1", port, backend, timeout_s=120.0)
        result = fn(groups, *args)
        # no rank leaves while another still has a collective in flight: tearing gloo down
        # under a peer's pending work aborted a rank now and then (SIGABRT, "terminate called
        # without an active exception", 1 run in ~10 of tests/engine/test_dep.py)
        torch.distributed.barrier()
        results.put((rank, True, result))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        destroy_distributed()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    expert_parallel_size: int | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(groups: ParallelGroups, *args)`` on ``world_size`` spawned ranks; return
    the ranks' results in rank order. ``fn`` and ``args`` must be picklable (a module-level
    function). A failing rank raises RuntimeError with its traceback."""
    layout = ParallelLayout(world_size, expert_parallel_size or world_size)
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    processes = mp.start_processes(
        _worker,
        args=(fn, layout, port, backend, results, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    collected: dict[int, Any] = {}

    def drain() -> None:
        # Read while the ranks run: a large result would block its writer on a full pipe.
        while not results.empty():
            rank, ok, value = results.get()
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = value

    try:
        while not processes.join(timeout=0.05):
            drain()
    except mp.ProcessRaisedException as error:
        drain()
        raise RuntimeError(f"a rank failed:\n{error}") from None
    drain()
    return [collected[rank] for rank in range(world_size)]


__all__ = ["ParallelGroups", "run_ranks"]
