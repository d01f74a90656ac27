"""Frozen configuration dataclasses of the engine, one per concern, validated in
``__post_init__``: cache, scheduler, parallelism and EPLB, P/D disaggregation, speculative
decoding, and ``EngineConfig`` holding them all. The model's own configuration lives in
``rackserve.model_config`` and is re-exported here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from rackserve.model_config import (  # noqa: F401 (re-exported)
    CSA,
    EXPERT_DTYPES,
    FP8_BLOCK,
    HCA,
    LAYER_TYPES,
    MLP_LAYER_TYPES,
    SCALE_FORMATS,
    SCORING_FUNCS,
    SLIDING,
    ConfigError,
    ModelConfig,
    QuantConfig,
    RopeConfig,
)

SPEC_METHODS = ("mtp", "draft_model")
MAX_SPEC_TOKENS = 8  # drafts per step; the published decode runs 3-5


KV_CACHE_DTYPES = ("auto", "fp8")
# The KV cache budget on a CPU when none is given (docs/serving.md states it; a test checks).
CPU_KV_CACHE_MEMORY = 512 << 20


@dataclass(frozen=True)
class CacheConfig:
    """KV cache budget and prefix caching. Give ``kv_cache_memory`` in bytes, or leave it
    None to use ``gpu_memory_utilization`` of the free accelerator memory (on a CPU:
    ``CPU_KV_CACHE_MEMORY``, 512 MiB). Prefix keys are sha256 by default; "xxhash" is faster
    but not collision-resistant, for trusted workloads (kv/hashing.py)."""

    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # or "xxhash" (faster; trusted tenants only)
    checkpoint_interval: int | None = 8192  # state checkpoints every N tokens of a long prefill
    # "fp8": the KV caches (window rows, compressed entries, indexer keys) in float8 e4m3,
    # unscaled as vLLM's default; compressor state rows stay in the model dtype
    kv_cache_dtype: str = "auto"

    # Host KV pool (kv/offload): bytes of host memory for blocks the device cache evicts
    # (None: no pool), or the address of a pool server shared by the engines of a host.
    kv_offload_memory: int | None = None
    kv_offload_server: str | None = None
    kv_events_endpoint: str | None = None  # ZMQ PUB address of this engine's KV events

    def __post_init__(self) -> None:
        if self.kv_offload_memory is not None and self.kv_offload_memory <= 0:
            raise ConfigError("--kv-offload-memory must be a positive number of bytes")
        for flag, url, schemes in (
            ("--kv-offload-server", self.kv_offload_server, ("mooncake://",)),
            ("--kv-events-endpoint", self.kv_events_endpoint, ()),
        ):
            if url is not None and not url.startswith(("tcp://", "ipc://", "inproc://", *schemes)):
                raise ConfigError(f"{flag} must be a ZMQ address like tcp://127.0.0.1:5600")
        if self.kv_offload_memory is not None and self.kv_offload_server is not None:
            raise ConfigError(
                "give --kv-offload-memory (a pool in this process) or --kv-offload-server (a "
                "shared pool server, sized by its own --memory), not both"
            )
        if self.uses_kv_pool and not self.enable_prefix_caching:
            raise ConfigError("the host KV pool keeps prefix-cache blocks: enable prefix caching")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("--kv-cache-memory must be a positive number of bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if self.prefix_caching_hash_algo not in ("xxhash", "sha256"):
            raise ConfigError("--prefix-caching-hash-algo must be 'xxhash' or 'sha256'")

    @property
    def uses_kv_pool(self) -> bool:
        return self.kv_offload_memory is not None or self.kv_offload_server is not None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    policy: str = "fcfs"  # or "priority"
    enable_chunked_prefill: bool = True
    # schedule step N+1 while step N runs (engine/async_scheduling.py), as vLLM names it
    async_scheduling: bool = False
    # at most this many of a request's tokens a step (0: no cap), as vLLM's
    # --long-prefill-token-threshold: long prompts prefill in chunks beside the decodes, and
    # on a P/D prefill engine a prompt's first chunks' KV streams out while later ones compute
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ConfigError(
                "--max-num-seqs and --max-num-batched-tokens must be >= 1, --max-model-len >= 2"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError("--scheduling-policy must be 'fcfs' or 'priority'")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "without chunked prefill --max-num-batched-tokens must be >= --max-model-len"
            )
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold must be >= 0 (0: no cap)")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ConfigError("--long-prefill-token-threshold chunks prompts: it needs chunking on")


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


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (``--speculative-config`` JSON, keys as vLLM names them).

    ``method``: "mtp" drafts with the checkpoint's own MTP layer, chained
    ``num_speculative_tokens`` (K) times; "draft_model" runs a second DeepSeek-V4-architecture
    checkpoint (``model``) K steps per engine step. Drafts are verified exactly
    (``rackserve/spec_decode``): the output is the target's, token for token."""

    method: str
    num_speculative_tokens: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"--speculative-config: method {self.method!r} is not supported; use one of "
                f"{list(SPEC_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ConfigError(
                f"--speculative-config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPEC_TOKENS}], got {k!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise ConfigError(
                '--speculative-config: method "draft_model" needs "model": the draft '
                "checkpoint directory"
            )
        if self.method == "mtp" and self.model is not None:
            raise ConfigError(
                '--speculative-config: method "mtp" drafts with the target\'s own MTP layer; '
                'drop "model" (or use method "draft_model")'
            )

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> SpecConfig | None:
        """``'{"method": "mtp", "num_speculative_tokens": 3}'`` (or a dict) -> SpecConfig;
        None (or an empty value) -> None (no speculation)."""
        if text is None or text == "" or text == {}:
            return None
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        known = {"method", "num_speculative_tokens", "model"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}"
            )
        if "method" not in raw:
            raise ConfigError('--speculative-config needs "method": "mtp" or "draft_model"')
        return cls(**raw)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine core needs. ``model`` is a checkpoint directory."""

    model: str
    model_config: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on accelerators
    device: str = "auto"  # auto: cuda when available
    seed: int = 0
    served_model_name: str | None = None
    cpu_threads: int = 1  # intra-op threads when running on the CPU (tiny models: 1 is best)
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly (as vLLM names it)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tokenizer: str | None = None  # tokenizer directory (None: the model's); structured output
    # a structured-output grammar still compiling after this fails its request alone
    structured_output_timeout_s: float = 30.0
    kv_transfer: DisaggConfig | None = None  # P/D disaggregation (--kv-transfer-config)
    speculative: SpecConfig | None = None  # --speculative-config (None: no speculation)

    def __post_init__(self) -> None:
        self.parallel.num_physical_experts(self.model_config.n_routed_experts)  # validates
        if not self.structured_output_timeout_s > 0:
            timeout = self.structured_output_timeout_s
            raise ConfigError(f"--structured-output-timeout-s must be > 0, got {timeout}")
        limit = self.model_config.max_position_embeddings
        if self.scheduler.max_model_len > limit:
            raise ConfigError(
                f"--max-model-len {self.scheduler.max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
