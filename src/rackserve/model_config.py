"""The model's configuration: ``ModelConfig`` read from a Hugging Face ``config.json``
(``model_type: deepseek_v4``), its RoPE and quantization parts.

It accepts the same spellings the reference accepts: nested ``rope_parameters`` (``main`` /
``compress``), a flat ``rope_parameters`` or legacy ``rope_scaling`` dict (YaRN for the
compressed layers), and the legacy keys ``compress_ratios``, ``compress_rate_csa``,
``compress_rate_hca``, ``num_hash_layers`` and ``qk_rope_head_dim``. ``rackserve.config``
re-exports every public name here.
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
            # V4's own config.json gives it at the top level (V4.1 in quantization_config):
            # transformers up to 5.17 reads it there only, later versions from either
            d["expert_dtype"] = self.quantization.expert_dtype
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
