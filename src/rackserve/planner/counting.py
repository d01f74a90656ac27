"""Bytes and FLOPs of one forward step, op by op: the one counting module of rackserve.

Public API (``bench forward`` imports it):

- ``step_ops(cfg, batch, formats, ep_size=1) -> list[OpCost]``: every op of one prefill or
  decode step on *one rank*, summed over layers. ``cfg`` is a V4 ``ModelConfig`` or a V3
  ``MlaConfig``; ``batch`` is that rank's ``BatchShape``.
- ``param_counts(cfg) -> dict[str, int]``: parameters by group, ``total`` matching
  transformers' ``DeepseekV4ForCausalLM`` (which builds no MTP layer; ``mtp`` is separate).
- ``expert_union``, ``kv_bytes_per_token``, ``weight_bytes_per_rank``.

Conventions. A rank runs attention data-parallel on its own batch and holds
``n_routed_experts / ep_size`` experts; every rank of the EP group has the same batch
shape, so a rank's experts see ``num_tokens * ep_size * top_k / E`` tokens each on
average. FLOPs count a multiply-add as 2. Bytes are HBM traffic assuming each weight,
each cached KV entry a request needs, and each activation is read once per step.

Shape legend: T tokens this step on the rank, R requests, n new tokens per request,
c cached tokens per request, D hidden, H heads, E experts, K top-k, F expert (FFN) width.
"""

from __future__ import annotations

from rackserve.config import CSA, HCA, ModelConfig
from rackserve.planner.counting_mla import _mla_ops, _mla_param_counts
from rackserve.planner.models import Formats, MlaConfig
from rackserve.planner.opcost import (  # noqa: F401 (re-exported: the public counting API)
    ATTENTION,
    GEMM,
    INDEXER,
    MEMORY,
    MOE,
    BatchShape,
    OpCost,
    _gemm,
    _mem,
    _moe_ops,
    _sum_by_name,
    expert_union,
)


def _v4_attention_ops(cfg: ModelConfig, layer: int, b: BatchShape, f: Formats) -> list[OpCost]:
    T, R, n, c = b.num_tokens, b.num_requests, b.new_tokens, b.context_len
    D, H, hd, a = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, f.act_bytes
    w, p, kvb = f.weight_bytes, f.gemm_precision, f.kv_bytes
    kind = cfg.layer_types[layer]
    ops = [
        _gemm("attn.q_a", T, D, cfg.q_lora_rank, w, a, p),
        _gemm("attn.q_b", T, cfg.q_lora_rank, H * hd, w, a, p),
        _gemm("attn.kv_proj", T, D, hd, w, a, p),
        # Grouped output projection: o_groups blocks of (H hd / g) -> o_lora, then mix.
        OpCost(
            "attn.o_a",
            GEMM,
            p,
            2.0 * T * H * hd * cfg.o_lora_rank,
            H * hd * cfg.o_lora_rank * w + T * H * hd * a,
            T * cfg.o_groups * cfg.o_lora_rank * a,
        ),
        _gemm("attn.o_b", T, cfg.o_groups * cfg.o_lora_rank, D, w, a, p),
        _mem("attn.kv_write", T * hd * a, T * hd * kvb),
    ]
    visible = b.mean_visible
    swa = min(cfg.sliding_window, visible)  # entries per query in the window
    # Window entries a request reads this step: the window before it plus its new tokens.
    swa_read = R * min(cfg.sliding_window + n, c + n) * hd * kvb
    comp_entries, comp_read = 0.0, 0.0
    if kind in (CSA, HCA):
        ratio = cfg.compress_ratio(layer)
        total = (c + n) / ratio  # compressed entries a request has after this step
        width = 2 * hd if kind == CSA else hd  # CSA keeps two overlapping series
        ops.append(_gemm("compressor.proj", T, D, 2 * width, w, a, p))
        ops.append(_mem("compressor.pool", T * 2 * width * a, T / ratio * hd * kvb))
        if kind == CSA:
            comp_entries = min(cfg.index_topk, visible / ratio)
            comp_read = R * min(total, n * cfg.index_topk) * hd * kvb
            ops += _indexer_ops(cfg, b, f, visible / ratio, total)
        else:
            comp_entries = visible / ratio
            comp_read = R * total * hd * kvb
    # K = V: QK^T and PV each cost 2 hd FLOPs per head and entry.
    ops.append(
        OpCost(
            "attn.core",
            ATTENTION,
            f.attention_precision,
            4.0 * T * H * hd * (swa + comp_entries),
            swa_read + comp_read + T * H * hd * a,
            T * H * hd * a,
        )
    )
    return ops


def _indexer_ops(
    cfg: ModelConfig, b: BatchShape, f: Formats, visible_entries: float, total_entries: float
) -> list[OpCost]:
    """Lightning indexer of a CSA layer: its own compressor, queries, scores and top-k."""
    T, R, a = b.num_tokens, b.num_requests, f.act_bytes
    ih, ihd, w, p = cfg.index_n_heads, cfg.index_head_dim, f.weight_bytes, f.gemm_precision
    return [
        _gemm("indexer.proj", T, cfg.hidden_size, 4 * ihd, w, a, p),
        _gemm("indexer.q_b", T, cfg.q_lora_rank, ih * ihd, w, a, p),
        _gemm("indexer.weights", T, cfg.hidden_size, ih, w, a, p),
        # Every query scores every visible compressed key; keys are read once per request.
        OpCost(
            "indexer.score",
            INDEXER,
            f.indexer_precision,
            2.0 * T * ih * ihd * visible_entries,
            R * total_entries * ihd * f.kv_bytes + T * ih * ihd * a,
            T * visible_entries * 4,
        ),
        _mem("indexer.topk", T * visible_entries * 4, T * cfg.index_topk * 4),
    ]


def _mhc_ops(T: int, D: int, hc: int) -> list[OpCost]:
    """Two hyper-connections per layer, fused: one pass reads the streams for norm,
    projection and collapse; the expand + mix pass reads them again and writes them."""
    streams = T * hc * D * 2.0  # BF16 residual streams
    one = _mem(
        "mhc", 2 * streams + T * D * 2.0, streams + T * D * 2.0, 2.0 * T * hc * D * (2 + hc) * hc
    )
    return [one, one]


def _v4_ops(
    cfg: ModelConfig, b: BatchShape, f: Formats, ep_size: int, logits_tokens: int
) -> list[OpCost]:
    T, D = b.num_tokens, cfg.hidden_size
    ops = [_mem("embed", T * D * 2.0, T * cfg.hc_mult * D * 2.0)]
    for layer in range(cfg.num_hidden_layers):
        ops += _mhc_ops(T, D, cfg.hc_mult)
        ops += _v4_attention_ops(cfg, layer, b, f)
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
    ops.append(_mem("head.hc_norm", T * cfg.hc_mult * D * 2.0, T * D * 2.0))
    ops.append(_gemm("lm_head", logits_tokens, D, cfg.vocab_size, 2.0, f.act_bytes, "bf16"))
    return ops


def step_ops(
    cfg: ModelConfig | MlaConfig,
    batch: BatchShape,
    formats: Formats | None = None,
    ep_size: int = 1,
    logits_tokens: int | None = None,
) -> list[OpCost]:
    """Per-op FLOPs and bytes of one forward step of ``batch`` on one rank.

    ``logits_tokens`` defaults to one per request for a prefill chunk (only the last
    position is sampled) and every token for decode (n <= 16, speculative verify).
    Ops are summed over layers and returned in first-seen order.
    """
    f = formats or Formats()
    if ep_size < 1:
        raise ValueError("ep_size must be >= 1")
    if logits_tokens is None:
        logits_tokens = batch.num_tokens if batch.new_tokens <= 16 else batch.num_requests
    if batch.num_tokens == 0:
        return []
    if isinstance(cfg, MlaConfig):
        return _sum_by_name(_mla_ops(cfg, batch, f, ep_size, logits_tokens))
    return _sum_by_name(_v4_ops(cfg, batch, f, ep_size, logits_tokens))


# ---- parameters, memory footprint ---------------------------------------------------------
def _v4_layer_params(cfg: ModelConfig, layer: int) -> dict[str, int]:
    D, H, hd, hc = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    E, F, ih, ihd = (
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
        cfg.index_n_heads,
        cfg.index_head_dim,
    )
    attention = (
        D * cfg.q_lora_rank
        + cfg.q_lora_rank
        + cfg.q_lora_rank * H * hd
        + D * hd
        + hd
        + H * hd * cfg.o_lora_rank
        + cfg.o_groups * cfg.o_lora_rank * D
        + H
    )
    compressor = indexer = 0
    kind = cfg.layer_types[layer]
    if kind == CSA:
        compressor = 2 * D * 2 * hd + cfg.csa_ratio * 2 * hd + hd
        indexer = (
            2 * D * 2 * ihd + cfg.csa_ratio * 2 * ihd + ihd + cfg.q_lora_rank * ih * ihd + D * ih
        )
    elif kind == HCA:
        compressor = 2 * D * hd + cfg.hca_ratio * hd + hd
    mix = (2 + hc) * hc
    return {
        "attention": attention,
        "compressor": compressor,
        "indexer": indexer,
        "router": E * D,
        "experts": E * 3 * D * F,
        "shared_experts": cfg.n_shared_experts * 3 * D * F,
        "mhc": 2 * (mix * hc * D + mix + 3),
        "norms": 2 * D,
    }


def param_counts(cfg: ModelConfig | MlaConfig) -> dict[str, int]:
    """Parameters by group. For V4, ``total`` equals transformers' ``DeepseekV4ForCausalLM``
    parameter count (no MTP); ``mtp`` estimates one MTP block (a decoder layer plus its
    2D -> D input projection and two norms); ``active`` counts what one token touches
    (top-k routed experts, no embedding)."""
    if isinstance(cfg, MlaConfig):
        return _mla_param_counts(cfg)
    D, V, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    counts = {"embed": V * D, "lm_head": 0 if cfg.tie_word_embeddings else V * D}
    for layer in range(cfg.num_hidden_layers):
        for key, value in _v4_layer_params(cfg, layer).items():
            counts[key] = counts.get(key, 0) + value
    counts["norms"] += D  # final norm
    counts["mhc"] += hc * hc * D + hc + 1  # hc_head
    counts["total"] = sum(counts.values())
    last = _v4_layer_params(cfg, cfg.num_hidden_layers - 1)
    counts["mtp"] = cfg.num_nextn_predict_layers * (sum(last.values()) + 2 * D * D + 2 * D)
    per_expert = 3 * D * cfg.moe_intermediate_size
    counts["active"] = (
        counts["total"]
        - counts["embed"]
        - counts["experts"]
        + cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert
    )
    return counts


def kv_bytes_per_token(cfg: ModelConfig | MlaConfig, formats: Formats) -> float:
    """Bytes of KV cache one more token of context adds, over all layers (the sliding
    window is a fixed per-request cost and is excluded)."""
    if isinstance(cfg, MlaConfig):
        return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * formats.kv_bytes
    values = 0.0
    for layer, kind in enumerate(cfg.layer_types):
        if kind == CSA:
            values += (cfg.head_dim + cfg.index_head_dim) / cfg.compress_ratio(layer)
        elif kind == HCA:
            values += cfg.head_dim / cfg.compress_ratio(layer)
    return values * formats.kv_bytes / formats.kv_sharing


def kv_bytes_per_request_fixed(cfg: ModelConfig | MlaConfig, formats: Formats) -> float:
    """Per-request KV bytes that do not grow with context (V4 sliding windows)."""
    if isinstance(cfg, MlaConfig):
        return 0.0
    return cfg.num_hidden_layers * cfg.sliding_window * cfg.head_dim * formats.kv_bytes


def weight_bytes_per_rank(cfg: ModelConfig | MlaConfig, formats: Formats, ep_size: int) -> float:
    """HBM bytes of weights on one rank of a DEP group: experts split, the rest replicated."""
    counts = param_counts(cfg)
    experts = counts["experts"] * formats.expert_bytes / ep_size
    embed = (counts["embed"] + counts["lm_head"]) * 2.0  # BF16 embedding and head
    rest = counts["total"] - counts["experts"] - counts["embed"] - counts["lm_head"]
    return experts + embed + rest * formats.weight_bytes
