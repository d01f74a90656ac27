"""Prefill/decode disaggregation configuration: ``DisaggConfig`` (``--kv-transfer-config``)
and the KV roles, connectors and load-failure policies it accepts. Re-exported by
``rackserve.config``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from rackserve.model_config import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("tcp", "shm", "nccl", "nixl")  # disagg/transports.py builds them by name
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_MAX_KV_LOADS_PER_STEP = 4  # what the published deployment used


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (``--kv-transfer-config``, shaped like vLLM's).

    A producer (prefill engine) runs a request's prompt, keeps its KV for ``lease_s`` seconds
    (extended by the consumer's heartbeats) and serves it on ``kv_ip:kv_port``; a consumer
    (decode engine) pulls the blocks it lacks into blocks it allocated, at most
    ``max_kv_loads_per_step`` requests admitted per step. ``kv_connector_extra_config`` holds
    transport options and, for tests, ``inject_fault`` (disagg/faults.py).
    """

    kv_role: str
    kv_connector: str = "tcp"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0  # where a producer serves its KV (required for producers)
    engine_id: str = ""  # empty: "ip:port" once bound
    kv_load_failure_policy: str = "recompute"
    lease_s: float = 30.0
    max_kv_loads_per_step: int = DEFAULT_MAX_KV_LOADS_PER_STEP  # 0: no cap
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ConfigError(
                f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}, "
                f"got {self.kv_role!r}"
            )
        if self.kv_connector not in KV_CONNECTORS:
            raise ConfigError(
                f"--kv-transfer-config: kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                f"got {self.kv_connector!r}"
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ConfigError(
                "--kv-transfer-config: kv_load_failure_policy must be 'recompute' or 'fail', "
                f"got {self.kv_load_failure_policy!r}"
            )
        if not 0 <= self.kv_port <= 65535:
            raise ConfigError("--kv-transfer-config: kv_port must be in [0, 65535]")
        if self.is_producer and self.kv_port == 0:
            raise ConfigError(
                "--kv-transfer-config: a kv_producer needs kv_port (the decode side pulls there)"
            )
        if not (math.isfinite(self.lease_s) and self.lease_s > 0):
            raise ConfigError("--kv-transfer-config: lease_s must be a positive number of seconds")
        if self.max_kv_loads_per_step < 0:
            raise ConfigError("--max-kv-loads-per-step must be >= 0 (0: no cap)")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(
        cls, text: str | dict[str, Any] | None, max_kv_loads_per_step: int | None = None
    ) -> DisaggConfig | None:
        """``--kv-transfer-config`` JSON (or a dict) -> DisaggConfig; None when not given.
        vLLM's keys ``kv_rank``, ``kv_parallel_size`` and ``kv_buffer_size`` are accepted
        and unused (the handshake names peers per request)."""
        if text is None:
            if max_kv_loads_per_step is not None:
                raise ConfigError("--max-kv-loads-per-step needs --kv-transfer-config (a consumer)")
            return None
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-transfer-config must be a JSON object")
        for unused in ("kv_rank", "kv_parallel_size", "kv_buffer_size", "kv_buffer_device"):
            raw.pop(unused, None)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"--kv-transfer-config: unknown keys {unknown}; known: {sorted(known)}"
            )
        if "kv_role" not in raw:
            raise ConfigError(
                "--kv-transfer-config needs kv_role (kv_producer|kv_consumer|kv_both)"
            )
        if max_kv_loads_per_step is not None:
            raw["max_kv_loads_per_step"] = max_kv_loads_per_step
        try:
            return cls(**raw)
        except TypeError as e:
            raise ConfigError(f"--kv-transfer-config: {e}") from None
