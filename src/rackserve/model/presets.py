"""Named model shapes for `rackserve model create` and the planner.

``tiny`` is the embedded default: every attention type, hash and routed MoE, and windows
small enough that a 200-token prompt crosses the sliding window and many compressor
windows. ``v4-flash`` has DeepSeek-V4-Flash's real layer dimensions (../shared/MISSION.md)
with a configurable number of layers and experts.
"""

from __future__ import annotations

from rackserve.config import CSA, HCA, SLIDING, ConfigError, ModelConfig, RopeConfig

PRESETS = ("tiny", "v4-flash")


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """The reference's default schedule: two HCA layers, then HCA/CSA interleaved."""
    interleave = [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    return tuple([HCA] * min(num_layers, 2) + interleave)


def tiny_config(num_layers: int = 6, num_experts: int = 8, vocab_size: int = 4096) -> ModelConfig:
    """Every layer kind in a few layers; fast on one CPU core."""
    cycle = (SLIDING, CSA, HCA)
    layer_types = tuple(cycle[i % 3] for i in range(num_layers))
    num_hash = min(2, num_layers - 1) if num_layers > 1 else 1
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=64,
        qk_rope_head_dim=16,
        num_experts_per_tok=min(2, num_experts),
        n_routed_experts=num_experts,
        max_position_embeddings=4096,
        layer_types=layer_types,
        mlp_layer_types=tuple("hash_moe" if i < num_hash else "moe" for i in range(num_layers)),
        csa_ratio=4,
        hca_ratio=16,
        sliding_window=16,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=16,  # enough heads that exact-zero index scores (ties) are rare
        index_head_dim=32,
        index_topk=8,
        bos_token_id=0,
        eos_token_id=(1,),
        rope_main=RopeConfig(theta=10000.0),
        rope_compress=RopeConfig(
            theta=160000.0,
            rope_type="yarn",
            factor=16.0,
            original_max_position_embeddings=256,
            attention_factor=1.0,
        ),
    )


def v4_flash_config(
    num_layers: int = 43, num_experts: int = 256, vocab_size: int = 129280
) -> ModelConfig:
    """DeepSeek-V4-Flash dimensions. The layer schedule is the reference's default
    (2 HCA, then HCA/CSA interleaved) with the first 3 MoE layers hash-routed."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=4096,
        moe_intermediate_size=2048,
        num_hidden_layers=num_layers,
        num_attention_heads=64,
        head_dim=512,
        q_lora_rank=1024,
        qk_rope_head_dim=64,
        num_experts_per_tok=min(6, num_experts),
        n_routed_experts=num_experts,
        max_position_embeddings=1048576,
        layer_types=default_layer_types(num_layers),
        mlp_layer_types=tuple("hash_moe" if i < 3 else "moe" for i in range(num_layers)),
        csa_ratio=4,
        hca_ratio=128,
        sliding_window=128,
        o_groups=8,
        o_lora_rank=1024,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        rope_main=RopeConfig(theta=10000.0),
        rope_compress=RopeConfig(
            theta=160000.0,
            rope_type="yarn",
            factor=16.0,
            original_max_position_embeddings=65536,
            attention_factor=1.0,
        ),
    )


def preset_config(
    name: str,
    num_layers: int | None = None,
    num_experts: int | None = None,
    vocab_size: int | None = None,
) -> ModelConfig:
    kwargs = {
        k: v
        for k, v in (
            ("num_layers", num_layers),
            ("num_experts", num_experts),
            ("vocab_size", vocab_size),
        )
        if v is not None
    }
    if name == "tiny":
        return tiny_config(**kwargs)
    if name == "v4-flash":
        return v4_flash_config(**kwargs)
    raise ConfigError(f"unknown preset {name!r}; choose one of {PRESETS}")
