"""Frozen configuration dataclasses of the engine, one per concern, validated in
``__post_init__``: cache, scheduler, speculative decoding, and ``EngineConfig`` holding them
all. Parallelism and EPLB live in ``rackserve.parallel_config``, P/D disaggregation in
``rackserve.disagg_config`` and the model's own configuration in ``rackserve.model_config``;
all are re-exported here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rackserve.disagg_config import (  # noqa: F401 (re-exported)
    DEFAULT_MAX_KV_LOADS_PER_STEP,
    KV_CONNECTORS,
    KV_LOAD_FAILURE_POLICIES,
    KV_ROLES,
    DisaggConfig,
)
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
from rackserve.parallel_config import EPLBConfig, ParallelConfig  # noqa: F401 (re-exported)

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
    # schedule step N+1 while step N runs (engine/async_scheduling.py), as vLLM names it;
    # None: on a GPU wherever it is supported (no speculative decoding, no DP/EP), vLLM's
    # default
    async_scheduling: bool | None = None
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
