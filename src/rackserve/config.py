"""Frozen configuration dataclasses, one per concern, validated in ``__post_init__``.

``ModelConfig`` is read from a Hugging Face ``config.json`` (``model_type: deepseek_v4``). It
accepts the same spellings the reference accepts: nested ``rope_parameters`` (``main`` /
``compress``), a flat ``rope_parameters`` or legacy ``rope_scaling`` dict (YaRN for the
compressed layers), and the legacy keys ``compress_ratios``, ``compress_rate_csa``,
``compress_rate_hca``, ``num_hash_layers`` and ``qk_rope_head_dim``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
SPEC_METHODS = ("mtp", "draft_model")
MAX_SPEC_TOKENS = 8  # drafts per step; the published decode runs 3-5


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the fix."""


_REQUIRED_HF_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class RopeConfig:
    """One rotary setting (``main`` for sliding layers, ``compress`` for CSA/HCA layers)."""

    theta: float
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError(
                f"rope_type {self.rope_type!r} is not supported; use 'default' or 'yarn'"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any], default_theta: float) -> RopeConfig:
        rope_type = d.get("rope_type", d.get("type", "default"))
        factor = float(d.get("factor", 1.0) or 1.0)
        attention_factor = d.get("attention_factor")
        if attention_factor is None:
            attention_factor = _yarn_mscale(factor, d.get("mscale"), d.get("mscale_all_dim"))
            if rope_type != "yarn":
                attention_factor = 1.0
        return cls(
            theta=float(d.get("rope_theta", default_theta)),
            rope_type=rope_type,
            factor=factor,
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 4096)),
            beta_fast=float(d.get("beta_fast") or 32.0),
            beta_slow=float(d.get("beta_slow") or 1.0),
            attention_factor=float(attention_factor),
            truncate=bool(d.get("truncate", True)),
        )


def _yarn_mscale(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)


# The block scaling DeepSeek-V4 checkpoints use, and the only one our kernels tile for.
FP8_BLOCK = (128, 128)
EXPERT_DTYPES = ("fp8", "fp4")
SCALE_FORMATS = ("float", "ue8m0")


@dataclass(frozen=True)
class QuantConfig:
    """Weights stored quantized (``quantization_config`` of ``config.json``, as transformers'
    finegrained FP8 integration reads it): linear weights in float8 e4m3 with one scale per
    ``weight_block_size`` block, routed experts in ``expert_dtype`` (``fp4``: e2m1, two per
    byte, one scale per 32 inputs of a row). ``scale_fmt`` is how new checkpoints store their
    scales (``ue8m0``: powers of two in one byte); either kind loads."""

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = FP8_BLOCK
    expert_dtype: str = "fp4"
    scale_fmt: str = "ue8m0"
    activation_scheme: str = "dynamic"

    def __post_init__(self) -> None:
        if self.quant_method != "fp8":
            raise ConfigError(
                f"unsupported quant_method {self.quant_method!r}: rackserve loads 'fp8' "
                "(block-scaled e4m3 linears, DeepSeek-V4's own format); dequantize others first"
            )
        if tuple(self.weight_block_size) != FP8_BLOCK:
            raise ConfigError(
                f"weight_block_size {list(self.weight_block_size)} is not supported: "
                f"FP8 checkpoints must use {list(FP8_BLOCK)} blocks"
            )
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ConfigError(
                f"expert_dtype must be one of {EXPERT_DTYPES}, got {self.expert_dtype!r}"
            )
        if self.scale_fmt not in SCALE_FORMATS:
            raise ConfigError(f"scale_fmt must be one of {SCALE_FORMATS}, got {self.scale_fmt!r}")
        if self.activation_scheme != "dynamic":
            raise ConfigError(
                f"activation_scheme {self.activation_scheme!r} is not supported: use 'dynamic'"
            )

    @classmethod
    def from_hf(cls, raw: Any, expert_dtype: Any = None) -> QuantConfig | None:
        """From ``quantization_config`` (None: unquantized); V4 configs may give
        ``expert_dtype`` at the top level instead."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ConfigError(f"quantization_config must be a JSON object, got {raw!r}")
        block = raw.get("weight_block_size")
        if block is None or not isinstance(block, (list, tuple)) or len(block) != 2:
            raise ConfigError(
                f"quantization_config.weight_block_size must be [128, 128], got {block!r}"
            )
        return cls(
            quant_method=str(raw.get("quant_method")),
            weight_block_size=(int(block[0]), int(block[1])),
            expert_dtype=str(raw.get("expert_dtype") or expert_dtype or "fp8"),
            scale_fmt=str(raw.get("scale_fmt") or "float"),
            activation_scheme=str(raw.get("activation_scheme") or "dynamic"),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "quant_method": self.quant_method,
            "fmt": "e4m3",
            "weight_block_size": list(self.weight_block_size),
            "expert_dtype": self.expert_dtype,
            "scale_fmt": self.scale_fmt,
            "activation_scheme": self.activation_scheme,
        }


@dataclass(frozen=True)
class ModelConfig:
    """The DeepSeek-V4 architecture hyper-parameters (names as in the HF ``config.json``)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    csa_ratio: int = 4
    hca_ratio: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = False
    rope_main: RopeConfig = field(default_factory=lambda: RopeConfig(theta=10000.0))
    rope_compress: RopeConfig = field(default_factory=lambda: RopeConfig(theta=160000.0))
    quantization: QuantConfig | None = None  # None: weights in the model dtype

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ConfigError(
                f"layer_types ({len(self.layer_types)}) and mlp_layer_types "
                f"({len(self.mlp_layer_types)}) must both have num_hidden_layers={n} entries"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        bad += [t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES]
        if bad:
            raise ConfigError(
                f"unknown layer types {bad}; allowed: {LAYER_TYPES + MLP_LAYER_TYPES}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(
                f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; use 'silu'")
        if self.num_key_value_heads != 1:
            raise ConfigError("DeepSeek-V4 attention has one shared KV head: num_key_value_heads=1")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError("num_attention_heads * head_dim must be divisible by o_groups")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            raise ConfigError("qk_rope_head_dim must be even and in (0, head_dim]")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError("qk_rope_head_dim must not exceed index_head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("num_experts_per_tok must not exceed n_routed_experts")
        if self.n_shared_experts not in (0, 1):
            raise ConfigError("n_shared_experts must be 0 or 1 for DeepSeek-V4")
        if self.csa_ratio < 1 or self.hca_ratio < 1 or self.sliding_window < 1:
            raise ConfigError("compress rates and sliding_window must be positive")

    # ---- derived values -------------------------------------------------------------------
    def compress_ratio(self, layer_idx: int) -> int:
        """Tokens per compressed entry for a layer; 0 for sliding-only layers."""
        kind = self.layer_types[layer_idx]
        return {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[kind]

    @property
    def num_hash_layers(self) -> int:
        return sum(t == "hash_moe" for t in self.mlp_layer_types)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` content, in the spelling transformers writes."""

        def rope_dict(r: RopeConfig) -> dict[str, Any]:
            d: dict[str, Any] = {
                "rope_type": r.rope_type,
                "rope_theta": r.theta,
                "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            }
            if r.rope_type == "yarn":
                d.update(
                    factor=r.factor,
                    original_max_position_embeddings=r.original_max_position_embeddings,
                    beta_fast=r.beta_fast,
                    beta_slow=r.beta_slow,
                    attention_factor=r.attention_factor,
                )
            return d

        d = asdict(self)
        for k in ("rope_main", "rope_compress", "csa_ratio", "hca_ratio", "quantization"):
            d.pop(k)
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_hf()
        d.update(
            architectures=["DeepseekV4ForCausalLM"],
            model_type="deepseek_v4",
            layer_types=list(self.layer_types),
            mlp_layer_types=list(self.mlp_layer_types),
            compress_rates={CSA: self.csa_ratio, HCA: self.hca_ratio},
            eos_token_id=self.eos_token_id[0]
            if len(self.eos_token_id) == 1
            else list(self.eos_token_id),
            partial_rotary_factor=self.qk_rope_head_dim / self.head_dim,
            rope_theta=self.rope_main.theta,
            compress_rope_theta=self.rope_compress.theta,
            rope_parameters={
                "main": rope_dict(self.rope_main),
                "compress": rope_dict(self.rope_compress),
            },
        )
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a ``config.json`` dict, folding legacy keys as the reference does."""
        model_type = raw.get("model_type")
        if model_type != "deepseek_v4":
            raise ConfigError(
                f"unsupported model_type {model_type!r}: rackserve serves 'deepseek_v4' checkpoints"
            )
        # The shape-defining keys: defaulting one silently would build a different model.
        missing = [k for k in _REQUIRED_HF_KEYS if raw.get(k) is None]
        if missing:
            raise ConfigError(
                f"config.json lacks {', '.join(missing)}: use the config.json saved with the "
                "weights (every DeepSeek-V4 config.json has them)"
            )
        d = dict(raw)
        n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
        head_dim = int(d.get("head_dim", cls.head_dim))

        rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = d["compress_rate_csa"]
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = d["compress_rate_hca"]

        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_LAYER_TYPE[int(r)] for r in d["compress_ratios"]]
            except KeyError as e:
                raise ConfigError(f"compress_ratios entries must be 0, 4 or 128, got {e}") from None
        if layer_types is None:
            interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            layer_types = [HCA] * min(n, 2) + interleave
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            num_hash = d.get("num_hash_layers")
            num_hash = 3 if num_hash is None else int(num_hash)
            mlp_types = ["hash_moe"] * min(n, num_hash) + ["moe"] * max(0, n - num_hash)

        partial = d.get("partial_rotary_factor")
        if partial is None:
            legacy = d.get("qk_rope_head_dim")
            partial = legacy / head_dim if legacy is not None else 64 / 512
        rope_dim = int(head_dim * partial)

        rope_theta = float(d.get("rope_theta", 10000.0))
        compress_theta = float(d.get("compress_rope_theta", 160000.0))
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main = RopeConfig.from_dict(rp["main"], rope_theta)
            compress = RopeConfig.from_dict(rp["compress"], compress_theta)
        else:
            # A flat dict describes the compressed layers' YaRN; sliding layers use plain RoPE.
            flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            flat["rope_theta"] = compress_theta
            flat.setdefault("rope_type", flat.get("type", "default"))
            if flat["rope_type"] == "yarn":
                flat.setdefault("attention_factor", 1.0)
            main = RopeConfig(theta=rope_theta)
            compress = RopeConfig.from_dict(flat, compress_theta)

        eos = d.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs.update(
            num_hidden_layers=n,
            head_dim=head_dim,
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            csa_ratio=int(rates[CSA]),
            hca_ratio=int(rates[HCA]),
            qk_rope_head_dim=rope_dim,
            eos_token_id=eos_ids,
            rope_main=main,
            rope_compress=compress,
            quantization=QuantConfig.from_hf(d.get("quantization_config"), d.get("expert_dtype")),
        )
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"{path} not found: pass a Hugging Face checkpoint directory, or create one with "
                "`rackserve model create --preset tiny --out DIR`"
            ) from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{path} must hold a JSON object of model settings, not a {type(raw).__name__}"
            )
        return cls.from_hf_dict(raw)


# ---- engine ------------------------------------------------------------------------------


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
