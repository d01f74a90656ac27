"""Models the planner knows: DeepSeek-V4-Flash, V4.1-Flash (derived) and V3/R1 (MLA).

A ``PlannerModel`` bundles an architecture (``ModelConfig`` for V4, ``MlaConfig`` for V3),
the storage formats it is served with, and its draft model for speculative decoding.

DeepSeek-V4.1-Flash is built from the facts in ../shared/MISSION.md. Assumptions:
- Same layer dimensions and schedule as V4-Flash (hidden 4096, 43 layers, 64 x 512 heads);
  only the routed expert count changes, 256 -> 384 (top-6, one shared expert).
- KV cache: FP4 entries (0.5 byte + one FP8 scale per 32 values) and cross-layer sharing
  of compressed entries between layer pairs. With the V4 layer schedule this gives
  ~870 bytes per token over all layers, close to the ~890 published.
- Draft ("DSpark"): one V4 layer of the same width with a 128-expert, top-3 MoE.
- Routed experts stored in FP4 (V4 checkpoints ship FP4 experts), the rest in FP8.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from rackserve.config import ModelConfig
from rackserve.model.presets import v4_flash_config


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek-V3/R1 (multi-head latent attention + DeepSeekMoE) dimensions."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 3  # leading layers with a dense MLP instead of MoE
    intermediate_size: int = 18432  # dense MLP width
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    num_nextn_predict_layers: int = 1

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace


@dataclass(frozen=True)
class Formats:
    """Bytes per stored value and the precision each matmul runs in.

    ``kv_bytes`` is per cached value including scales; ``kv_sharing`` is how many layers
    share one compressed cache (1 = no sharing).
    """

    weight_bytes: float = 1.0  # FP8 attention / shared / dense weights
    expert_bytes: float = 1.0  # routed expert weights
    kv_bytes: float = 1.0
    act_bytes: float = 2.0  # BF16 activations
    dispatch_bytes: float = 1.0  # FP8 tokens on the wire for dispatch (combine is BF16)
    gemm_precision: str = "fp8"
    expert_precision: str = "fp8"
    attention_precision: str = "bf16"
    indexer_precision: str = "fp8"
    kv_sharing: int = 1


FP4_BYTES = 0.5 + 1 / 32  # e2m1 value + one FP8 (e8m0/e4m3) scale per 32 values


@dataclass(frozen=True)
class DraftSpec:
    """A draft model for speculative decoding, costed like ``num_layers`` target layers.

    ``acceptance`` is the probability that draft token i is accepted given tokens < i were
    (a geometric model, as MTP papers report it).
    """

    cfg: ModelConfig | MlaConfig
    num_layers: int = 1
    acceptance: float = 0.8


@dataclass(frozen=True)
class PlannerModel:
    name: str
    cfg: ModelConfig | MlaConfig
    formats: Formats
    draft: DraftSpec | None = None


def _v4_draft_cfg(num_experts: int, top_k: int, base: ModelConfig) -> ModelConfig:
    # One layer of the target's width; a CSA layer, the more expensive attention kind.
    return replace(
        base,
        num_hidden_layers=1,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        layer_types=("compressed_sparse_attention",),
        mlp_layer_types=("moe",),
    )


def deepseek_v4_flash() -> PlannerModel:
    cfg = v4_flash_config()
    formats = Formats(expert_bytes=FP4_BYTES, expert_precision="fp4", kv_bytes=1.0)
    # V4-Flash ships one MTP layer (num_nextn_predict_layers=1) with the target's MoE.
    draft = DraftSpec(_v4_draft_cfg(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg))
    return PlannerModel("deepseek-v4-flash", cfg, formats, draft)


def deepseek_v41_flash() -> PlannerModel:
    cfg = v4_flash_config(num_experts=384)
    formats = Formats(
        expert_bytes=FP4_BYTES, expert_precision="fp4", kv_bytes=FP4_BYTES, kv_sharing=2
    )
    return PlannerModel("deepseek-v4.1-flash", cfg, formats, DraftSpec(_v4_draft_cfg(128, 3, cfg)))


def deepseek_v3() -> PlannerModel:
    """V3/R1 as served in DeepSeek's production: FP8 GEMMs and MoE, BF16 latent KV cache."""
    cfg = MlaConfig()
    formats = Formats(kv_bytes=2.0)
    return PlannerModel(
        "deepseek-v3",
        cfg,
        formats,
        DraftSpec(replace(cfg, num_hidden_layers=1, first_k_dense_replace=0)),
    )


def model_presets() -> dict[str, PlannerModel]:
    return {
        "deepseek-v4-flash": deepseek_v4_flash(),
        "deepseek-v4.1-flash": deepseek_v41_flash(),
        "deepseek-v3": deepseek_v3(),
    }


def load_model(name_or_path: str) -> PlannerModel:
    """A preset name, or a HF checkpoint directory / ``config.json`` of a V4 model."""
    presets = model_presets()
    if name_or_path in presets:
        return presets[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(
            f"model {name_or_path!r} is neither a preset ({sorted(presets)}) nor a config.json"
        )
    cfg = ModelConfig.from_hf_dict(json.loads(path.read_text()))
    formats = Formats(expert_bytes=FP4_BYTES, expert_precision="fp4")
    draft = DraftSpec(_v4_draft_cfg(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg))
    return PlannerModel(path.parent.name or "model", cfg, formats, draft)
