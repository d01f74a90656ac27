"""Data-parallel and expert-parallel configuration: ``ParallelConfig`` (DP ranks over one or
several hosts, expert parallelism, redundant experts) and ``EPLBConfig`` (the expert-parallel
load balancer's ``--eplb-config``). Re-exported by ``rackserve.config``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rackserve.model_config import ConfigError


@dataclass(frozen=True)
class EPLBConfig:
    """The expert-parallel load balancer (``--eplb-config`` JSON, keys as vLLM names them).

    Loads are recorded per step over a sliding window of ``window_size`` steps; every
    ``step_interval`` steps a new placement is computed and moved in layer by layer.
    ``max_moves_per_layer`` None: the full target (DeepSeek's policy); else the
    placement-aware variant moves at most that many slots per layer per rebalance."""

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int | None = None  # None: ParallelConfig's value
    max_moves_per_layer: int | None = None
    uniform_reference: bool = True  # also route each batch uniformly (the metric's ceiling)

    def __post_init__(self) -> None:
        if self.window_size < 1 or self.step_interval < 1:
            raise ConfigError("--eplb-config: window_size and step_interval must be >= 1")
        if self.num_redundant_experts is not None and self.num_redundant_experts < 0:
            raise ConfigError("--eplb-config: num_redundant_experts must be >= 0")
        if self.max_moves_per_layer is not None and self.max_moves_per_layer < 1:
            raise ConfigError("--eplb-config: max_moves_per_layer must be >= 1 (or absent)")

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> EPLBConfig:
        """``'{"window_size": 1000, "step_interval": 3000}'`` (or a dict) -> EPLBConfig."""
        if text is None:
            return cls()
        raw = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(raw, dict):
            raise ConfigError("--eplb-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"--eplb-config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**raw)


@dataclass(frozen=True)
class ParallelConfig:
    """Data-parallel attention + expert parallelism (DEP), flags as ``vllm serve`` names them.

    ``data_parallel_size`` engine-core ranks (processes, one per GPU); with
    ``enable_expert_parallel`` the routed experts are spread over all of them (physical
    slots = E + ``num_redundant_experts``, split evenly). Several hosts: each runs
    ``data_parallel_size_local`` ranks starting at ``data_parallel_start_rank``; the head
    (rank 0, the API server) listens on ``data_parallel_address``:``data_parallel_rpc_port``
    and the next ports (see docs/expert_parallel.md); the others run ``headless``."""

    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None  # None: every rank on this host
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int | None = None  # None: one host, ipc sockets and a free port
    headless: bool = False
    enable_expert_parallel: bool = False
    num_redundant_experts: int = 0
    enable_eplb: bool = False
    eplb: EPLBConfig = field(default_factory=EPLBConfig)
    skewed_routing: float = 0.0  # test models: Zipf exponent applied to the routers at load

    def __post_init__(self) -> None:
        n = self.data_parallel_size
        if n < 1:
            raise ConfigError("--data-parallel-size must be >= 1")
        local = self.num_local_ranks
        if local < 1 or not 0 <= self.data_parallel_start_rank <= n - local:
            raise ConfigError(
                f"--data-parallel-start-rank {self.data_parallel_start_rank} and "
                f"--data-parallel-size-local {local} must fit in --data-parallel-size {n}"
            )
        if local < n and self.data_parallel_rpc_port is None:
            raise ConfigError(
                "ranks on several hosts need --data-parallel-address and "
                "--data-parallel-rpc-port (the head's)"
            )
        if self.headless and self.data_parallel_start_rank == 0:
            raise ConfigError("--headless hosts run ranks >= 1: set --data-parallel-start-rank")
        if not self.headless and self.data_parallel_start_rank != 0:
            raise ConfigError("only --headless hosts take --data-parallel-start-rank > 0")
        if self.num_redundant_experts < 0:
            raise ConfigError("--num-redundant-experts must be >= 0")
        eplb_redundant = self.eplb.num_redundant_experts
        if eplb_redundant is not None and self.num_redundant_experts not in (0, eplb_redundant):
            raise ConfigError(
                "--num-redundant-experts and --eplb-config num_redundant_experts differ"
            )
        if (self.num_redundant or self.enable_eplb) and not self.expert_parallel:
            raise ConfigError(
                "--enable-eplb and --num-redundant-experts need --enable-expert-parallel with "
                "--data-parallel-size > 1"
            )
        if self.skewed_routing < 0:
            raise ConfigError("--skewed-routing (a Zipf exponent) must be >= 0")

    @property
    def num_local_ranks(self) -> int:
        if self.data_parallel_size_local is None:
            return self.data_parallel_size
        return self.data_parallel_size_local

    @property
    def num_redundant(self) -> int:
        """Redundant expert slots per layer (the flag, or ``--eplb-config``'s key)."""
        return self.num_redundant_experts or (self.eplb.num_redundant_experts or 0)

    @property
    def expert_parallel(self) -> bool:
        """Experts spread over the ranks (EP size = DP size > 1)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def expert_parallel_size(self) -> int:
        return self.data_parallel_size if self.expert_parallel else 1

    def num_physical_experts(self, num_experts: int) -> int:
        """Slots per MoE layer; ConfigError naming the fix when they do not split evenly."""
        slots = num_experts + self.num_redundant
        if slots % self.expert_parallel_size:
            raise ConfigError(
                f"{num_experts} experts + {self.num_redundant} redundant do not split "
                f"over {self.expert_parallel_size} EP ranks; choose --num-redundant-experts so "
                "the sum is a multiple of --data-parallel-size"
            )
        return slots
