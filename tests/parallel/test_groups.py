"""Parallel layout and groups: validation, EP group membership over real processes."""

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rackserve.parallel.groups import (
    ParallelGroups,
    ParallelLayout,
    _ephemeral_floor,
    default_backend,
    free_port,
    free_port_block,
)
from rackserve.parallel.launch import run_ranks


def test_layout():
    layout = ParallelLayout(world_size=8, expert_parallel_size=4)
    assert layout.num_ep_groups == 2
    assert layout.ep_ranks(5) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="must divide"):
        ParallelLayout(world_size=6, expert_parallel_size=4)
    with pytest.raises(ValueError, match=">= 1"):
        ParallelLayout(world_size=0, expert_parallel_size=1)


def test_single_and_backend():
    single = ParallelGroups.single()
    assert single.ep_group is None and single.ep_size == 1
    assert default_backend("cpu") == "gloo"
    assert default_backend("cuda") == "nccl"
    port = free_port()
    assert 1024 <= port < _ephemeral_floor()  # below the range bind(0) and clients draw from
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_block_is_bindable_and_skips_taken_ports(monkeypatch):
    base = free_port_block(6)
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert base >= 1024 and base + 6 <= floor  # below the ephemeral range
    held = []
    for port in range(base, base + 6):  # every port of the block binds
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        held.append(sock)
    # while the block is held, a draw that lands on it moves on to a free one
    draws = iter([base + 3, base + 3, base - 40, base + 1, base + 4])
    monkeypatch.setattr("rackserve.parallel.groups.random.randrange", lambda a, b: next(draws))
    try:
        assert free_port_block(6) == base - 40
        with pytest.raises(RuntimeError, match="no 2 consecutive free ports"):
            free_port_block(2, attempts=2)  # base + 1, base + 4: both held
    finally:
        for sock in held:
            sock.close()


def _sum_worker(groups) -> tuple[int, int, int]:
    value = torch.tensor([groups.rank + 1])
    dist.all_reduce(value, group=groups.ep_group)
    world = torch.tensor([groups.rank + 1])
    dist.all_reduce(world, group=groups.dp_group)
    return groups.ep_rank, int(value), int(world)


def test_two_ep_groups_of_one_rank():
    # World 2, EP size 1: each rank is its own EP group; the DP group spans both.
    assert run_ranks(_sum_worker, 2, expert_parallel_size=1) == [(0, 1, 3), (0, 2, 3)]


def test_failing_rank_reports_its_traceback():
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        run_ranks(_fail_worker, 2)


def _fail_worker(groups) -> None:
    if groups.rank == 1:
        raise ZeroDivisionError("rank 1 fails on purpose")
