"""Data-parallel engine ranks: the per-step DP sync and the front end's request assignment.

Every DP rank runs its own engine core and scheduler. With expert parallelism the ranks'
forwards meet in the MoE all-to-alls, so they must step together: before each step every
rank all-reduces (max) two flags over a gloo group, "I have work" and "shut down"::

    rank 0:  has work -> sync(1) -> step (real batch)   -> sync ...
    rank 1:  idle     -> sync(0) -> step (dummy pass)    -> sync ...
    both idle: sync(0) on every rank -> nobody steps; each waits for input, then syncs again

The front end (``dp_client.py``) sends each new request to one rank, chosen by a pluggable
``AssignmentPolicy`` over what it knows of every rank's load; ``LeastLoad`` (the default)
counts running + waiting requests and their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from rackserve.engine.outputs import EngineCoreOutputs
from rackserve.parallel.groups import ParallelGroups


# ---- the per-step sync (engine side) ------------------------------------------------------
def dp_sync(groups: ParallelGroups, has_work: bool, shutdown: bool = False) -> tuple[bool, bool]:
    """All ranks agree: (does any rank have work, does any rank shut down). Collective over
    the DP group; free with one rank."""
    if groups.world_size == 1:
        return has_work, shutdown
    flags = torch.tensor([int(has_work), int(shutdown)], dtype=torch.int32)
    group = groups.dp_cpu_group or groups.dp_group
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return bool(flags[0]), bool(flags[1])


class SteppableCore(Protocol):
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> EngineCoreOutputs: ...


def dp_step(
    core: SteppableCore, groups: ParallelGroups, want_step: bool = False, shutdown: bool = False
) -> tuple[EngineCoreOutputs | None, bool, bool]:
    """One synchronised step of this rank: sync, then step when any rank has work (this
    rank's step is a dummy pass when it has none). ``want_step`` asks for a step without
    unfinished requests (an idle step that refreshes stats). Returns (outputs or None when
    nobody stepped, whether any rank had work, whether any rank asked to shut down)."""
    local = want_step or core.has_unfinished_requests()
    any_work, any_shutdown = dp_sync(groups, local, shutdown)
    if any_shutdown or not any_work:
        return None, any_work, any_shutdown
    return core.step(), True, False


def run_until_idle(
    core: SteppableCore, groups: ParallelGroups, max_steps: int = 100_000
) -> list[EngineCoreOutputs]:
    """Step every rank together until no rank has work (offline runs and tests)."""
    steps: list[EngineCoreOutputs] = []
    for _ in range(max_steps):
        outputs, any_work, _ = dp_step(core, groups)
        if not any_work:
            return steps
        assert outputs is not None
        steps.append(outputs)
    raise RuntimeError(f"ranks still had work after {max_steps} steps")


# ---- assignment (front-end side) ----------------------------------------------------------
@dataclass
class RankLoad:
    """What the front end counts for one rank: its unfinished (running + waiting) requests
    and their tokens (prompt + generated so far)."""

    num_requests: int = 0
    num_tokens: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # request id -> tokens


class AssignmentPolicy(Protocol):
    def choose(self, loads: list[RankLoad], num_prompt_tokens: int) -> int:
        """The rank for a new request of ``num_prompt_tokens`` tokens."""
        ...


class LeastLoad:
    """Fewest unfinished requests, then fewest tokens, then the lowest rank."""

    def choose(self, loads: list[RankLoad], num_prompt_tokens: int) -> int:
        return min(range(len(loads)), key=lambda r: (loads[r].num_requests, loads[r].num_tokens, r))


class RoundRobin:
    """Ranks in turn, whatever their load (a baseline for the imbalance benchmarks)."""

    def __init__(self) -> None:
        self.next = 0

    def choose(self, loads: list[RankLoad], num_prompt_tokens: int) -> int:
        rank = self.next % len(loads)
        self.next += 1
        return rank


ASSIGNMENT_POLICIES: dict[str, type] = {"least_load": LeastLoad, "round_robin": RoundRobin}


def make_policy(name: str) -> AssignmentPolicy:
    if name not in ASSIGNMENT_POLICIES:
        known = list(ASSIGNMENT_POLICIES)
        raise ValueError(f"unknown DP assignment policy {name!r}; one of {known}")
    return ASSIGNMENT_POLICIES[name]()


class DPLoadTracker:
    """The front end's view of every rank's load; assigns requests through a policy.

    ``assign`` when a request is sent, ``on_tokens`` as outputs arrive, ``finish`` when it
    ends (finished or aborted)."""

    def __init__(self, num_ranks: int, policy: AssignmentPolicy | None = None) -> None:
        if num_ranks < 1:
            raise ValueError("need at least one DP rank")
        self.loads = [RankLoad() for _ in range(num_ranks)]
        self.policy = policy or LeastLoad()
        self.rank_of: dict[str, int] = {}

    def assign(self, request_id: str, num_prompt_tokens: int, rank: int | None = None) -> int:
        """The rank for a new request: ``rank`` when the client pinned one (vLLM's
        ``X-data-parallel-rank``), else the policy's choice."""
        if request_id in self.rank_of:
            raise ValueError(f"request {request_id} is already assigned")
        if rank is None:
            rank = self.policy.choose(self.loads, num_prompt_tokens)
            if not 0 <= rank < len(self.loads):
                raise ValueError(f"the assignment policy chose rank {rank} of {len(self.loads)}")
        elif not 0 <= rank < len(self.loads):
            raise ValueError(f"data_parallel_rank {rank} is out of range [0, {len(self.loads)})")
        load = self.loads[rank]
        load.num_requests += 1
        load.num_tokens += num_prompt_tokens
        load.requests[request_id] = num_prompt_tokens
        self.rank_of[request_id] = rank
        return rank

    def on_tokens(self, request_id: str, num_new_tokens: int) -> None:
        rank = self.rank_of.get(request_id)
        if rank is None:
            return
        load = self.loads[rank]
        load.num_tokens += num_new_tokens
        load.requests[request_id] += num_new_tokens

    def finish(self, request_id: str) -> int | None:
        """Forget a request; returns the rank it ran on (None if unknown)."""
        rank = self.rank_of.pop(request_id, None)
        if rank is not None:
            load = self.loads[rank]
            load.num_requests -= 1
            load.num_tokens -= load.requests.pop(request_id)
        return rank
