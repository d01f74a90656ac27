"""Process groups for data-parallel attention + expert parallelism (DEP) over torch.distributed.

Every rank runs one engine core. Attention is data-parallel (each rank its own batch);
routed experts are spread over the expert-parallel (EP) group. With one DEP instance both
groups span all ranks; ``expert_parallel_size`` smaller than the world gives several EP
groups of consecutive ranks. Nothing here is module-level state: the caller holds the
returned ``ParallelGroups`` and passes it on. Backend: gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """How ``world_size`` ranks split into EP groups (DP attention spans the world)."""

    world_size: int
    expert_parallel_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.expert_parallel_size < 1:
            raise ValueError("world_size and expert_parallel_size must be >= 1")
        if self.world_size % self.expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size {self.expert_parallel_size} must divide the world size "
                f"{self.world_size}"
            )

    @property
    def num_ep_groups(self) -> int:
        return self.world_size // self.expert_parallel_size

    def ep_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s EP group (consecutive ranks)."""
        first = rank // self.expert_parallel_size * self.expert_parallel_size
        return list(range(first, first + self.expert_parallel_size))


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's view of the groups. ``ep_group`` None means one rank (no collectives)."""

    rank: int
    world_size: int
    dp_group: dist.ProcessGroup | None
    ep_group: dist.ProcessGroup | None
    ep_rank: int
    ep_size: int
    ep_move_group: dist.ProcessGroup | None = None  # EP ranks again: background weight moves
    dp_cpu_group: dist.ProcessGroup | None = None  # gloo over the world: the per-step DP sync

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process, no torch.distributed: local dispatch."""
        return cls(rank=0, world_size=1, dp_group=None, ep_group=None, ep_rank=0, ep_size=1)


def default_backend(device: torch.device | str) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (for tests and single-host launches), drawn
    below the ephemeral range as ``free_port_block``'s: a ``bind(0)`` port, released for a
    server to bind, could be taken in between by any outgoing connection (a router test saw
    "address already in use", session 31)."""
    return free_port_block(1, host)


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections and ``bind(0)``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """The first of ``count`` consecutive TCP ports free right now on ``host``, for launches
    that derive ports from one base (``--data-parallel-rpc-port`` and the ports after it).

    ``free_port() + 1`` may be taken: ``bind(0)`` and outgoing connections draw from the
    kernel's ephemeral range, so a port beside a fresh one is often another socket's. The
    block is drawn below that range instead, where only explicit binds go, and each port
    is checked by binding it.
    """
    floor = _ephemeral_floor()
    low = max(1024, min(20000, floor - 10000))
    for _ in range(attempts):
        base = random.randrange(low, floor - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host} in {attempts} attempts")


def init_distributed(
    rank: int,
    layout: ParallelLayout,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> ParallelGroups:
    """Join the default process group and build this rank's DP and EP groups.

    Collective: every rank of the world calls it with the same layout. ``new_group`` is
    called for every EP group in the same order on every rank, as torch.distributed needs.
    """
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside the world of {layout.world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=layout.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return build_groups(rank, layout)


def build_groups(rank: int, layout: ParallelLayout) -> ParallelGroups:
    """The groups over an initialised default process group (collective)."""
    ep_group = ep_move_group = None
    for index in range(layout.num_ep_groups):
        ranks = list(
            range(index * layout.expert_parallel_size, (index + 1) * layout.expert_parallel_size)
        )
        # A second group over the same ranks: EPLB's weight moves run asynchronously on it,
        # so they never queue behind (or block) the dispatch all-to-all.
        group, move_group = dist.new_group(ranks), dist.new_group(ranks)
        if rank in ranks:
            ep_group, ep_move_group = group, move_group
    # The per-step DP sync is a few host ints: a gloo group keeps it off the GPU stream.
    dp_cpu_group = dist.new_group(list(range(layout.world_size)), backend="gloo")
    return ParallelGroups(
        rank=rank,
        world_size=layout.world_size,
        dp_group=dist.group.WORLD,
        ep_group=ep_group,
        ep_rank=rank % layout.expert_parallel_size,
        ep_size=layout.expert_parallel_size,
        ep_move_group=ep_move_group,
        dp_cpu_group=dp_cpu_group,
    )


def destroy_distributed() -> None:
    """Leave torch.distributed (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
