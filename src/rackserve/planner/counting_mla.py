"""Byte/FLOP and parameter counting for MLA models (DeepSeek-V3/R1): the planner's
validation against published V3 serving results needs them."""

from __future__ import annotations

from rackserve.planner.models import Formats, MlaConfig
from rackserve.planner.opcost import (
    ATTENTION,
    GEMM,
    BatchShape,
    OpCost,
    _gemm,
    _mem,
    _moe_ops,
)


def _mla_layer_ops(cfg: MlaConfig, b: BatchShape, f: Formats) -> list[OpCost]:
    """MLA: naive (per-head K/V up-projection) for prefill chunks, absorbed for decode."""
    T, R, n, c = b.num_tokens, b.num_requests, b.new_tokens, b.context_len
    D, H, a, w, p = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        f.act_bytes,
        f.weight_bytes,
        f.gemm_precision,
    )
    nope, rope, v, kvl = (
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    visible = b.mean_visible
    ops = [
        _gemm("attn.q_a", T, D, cfg.q_lora_rank, w, a, p),
        _gemm("attn.q_b", T, cfg.q_lora_rank, H * (nope + rope), w, a, p),
        _gemm("attn.kv_a", T, D, kvl + rope, w, a, p),
        _gemm("attn.o_proj", T, H * v, D, w, a, p),
        _mem("attn.kv_write", T * (kvl + rope) * a, T * (kvl + rope) * f.kv_bytes),
    ]
    if n > 16:  # prefill: up-project every cached and new latent, then plain MHA
        ops.append(_gemm("attn.kv_b", R * (c + n), kvl, H * (nope + v), w, a, p))
        ops.append(
            OpCost(
                "attn.core",
                ATTENTION,
                f.attention_precision,
                2.0 * T * H * (nope + rope + v) * visible,
                R * (c + n) * H * (nope + rope + v) * a,
                T * H * v * a,
            )
        )
    else:  # decode: absorb W_UK into q and W_UV after attention; attend in latent space
        ops.append(
            OpCost(
                "attn.absorb",
                GEMM,
                "bf16",
                2.0 * T * H * (nope + v) * kvl,
                H * (nope + v) * kvl * 2.0 + T * H * (nope + kvl) * a,
                T * H * (kvl + v) * a,
            )
        )
        ops.append(
            OpCost(
                "attn.core",
                ATTENTION,
                f.attention_precision,
                2.0 * T * H * (2 * kvl + rope) * visible,
                R * (c + n) * (kvl + rope) * f.kv_bytes,
                T * H * kvl * a,
            )
        )
    return ops


def _mla_ops(
    cfg: MlaConfig, b: BatchShape, f: Formats, ep_size: int, logits_tokens: int
) -> list[OpCost]:
    T, D, a = b.num_tokens, cfg.hidden_size, f.act_bytes
    ops = [_mem("embed", T * D * 2.0, T * D * a)]
    for layer in range(cfg.num_hidden_layers):
        ops += _mla_layer_ops(cfg, b, f)
        ops.append(_mem("norms", 4 * T * D * a, 2 * T * D * a))
        if layer < cfg.first_k_dense_replace:
            ops += [
                _gemm(
                    "dense_mlp.up",
                    T,
                    D,
                    2 * cfg.intermediate_size,
                    f.weight_bytes,
                    a,
                    f.gemm_precision,
                ),
                _gemm(
                    "dense_mlp.down",
                    T,
                    cfg.intermediate_size,
                    D,
                    f.weight_bytes,
                    a,
                    f.gemm_precision,
                ),
            ]
        else:
            ops += _moe_ops(
                T,
                D,
                cfg.moe_intermediate_size,
                cfg.n_routed_experts,
                cfg.num_experts_per_tok,
                cfg.n_shared_experts,
                f,
                ep_size,
            )
    ops.append(_gemm("lm_head", logits_tokens, D, cfg.vocab_size, 2.0, a, "bf16"))
    return ops


def _mla_param_counts(cfg: MlaConfig) -> dict[str, int]:
    D, H = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attention = (
        D * cfg.q_lora_rank
        + cfg.q_lora_rank
        + cfg.q_lora_rank * H * qk
        + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        + cfg.kv_lora_rank
        + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        + H * cfg.v_head_dim * D
    )
    L, moe = cfg.num_hidden_layers, cfg.num_moe_layers
    per_expert = 3 * D * cfg.moe_intermediate_size
    counts = {
        "embed": cfg.vocab_size * D,
        "lm_head": cfg.vocab_size * D,
        "attention": L * attention,
        "dense_mlp": cfg.first_k_dense_replace * 3 * D * cfg.intermediate_size,
        "router": moe * cfg.n_routed_experts * D,
        "experts": moe * cfg.n_routed_experts * per_expert,
        "shared_experts": moe * cfg.n_shared_experts * per_expert,
        "norms": 2 * L * D + D,
    }
    counts["total"] = sum(counts.values())
    counts["mtp"] = cfg.num_nextn_predict_layers * (
        attention + cfg.n_routed_experts * (per_expert + D) + per_expert + 2 * D * D + 4 * D
    )
    counts["active"] = (
        counts["total"]
        - counts["embed"]
        - counts["experts"]
        + moe * cfg.num_experts_per_tok * per_expert
    )
    return counts
