"""The MoE router in one launch (equals ``reference.route``).

A program takes BLOCK_T tokens: their logits against every expert (a [BLOCK_T, D] x [D, E]
fp32 dot over D chunks, rounded to the activation dtype as ``F.linear``
rounds), the scores (sqrt-softplus, sigmoid or softmax), the k experts (hash layers: the
token's row of the table; learned: k rounds of argmax over score + bias), and the
normalised, scaled weights of the chosen experts; optionally (``route_fused``) the shared
expert as one more pick with weight 1 and the per-expert counts of the picks (EPLB) by
integer atomics. The grid is ceil(T / BLOCK_T): fixed for a
batch, so the op can be captured in a CUDA graph.

Shape legend: T tokens, D hidden, E experts, k experts per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl, pdl_wait

_SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def route_tokens(
    block,  # tokens block * BLOCK_T ..
    logits_ptr,
    bias_ptr,
    table_ptr,
    ids_ptr,
    out_ids_ptr,
    out_w_ptr,
    counts_ptr,
    mask_ptr,
    num_tokens,
    scaling,
    shared_id,
    E: tl.constexpr,
    K: tl.constexpr,
    SCORING: tl.constexpr,
    HASHED: tl.constexpr,
    SHARED: tl.constexpr,  # 1: column K is the shared expert (id shared_id, weight 1)
    COUNT: tl.constexpr,  # 0: no counts; 1: count every token; 2: tokens where mask
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    ok = t_ok[:, None] & e_ok[None, :]
    logits = tl.load(logits_ptr + t[:, None] * E + e[None, :], ok, other=0.0).to(tl.float32)
    neg_inf = float("-inf")
    if SCORING == 0:  # sqrt(softplus), softplus as torch: linear above 20, log1p below
        z = tl.exp(tl.minimum(logits, 20.0))
        log1p = tl.where(z < 1e-4, z * (1.0 - 0.5 * z), tl.log(1.0 + z))
        scores = tl.sqrt(tl.where(logits > 20.0, logits, log1p))
    elif SCORING == 1:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        masked = tl.where(e_ok[None, :], logits, neg_inf)
        z = tl.exp(masked - tl.max(masked, 1)[:, None])
        scores = z / tl.sum(z, 1)[:, None]
    scores = tl.where(e_ok[None, :], scores, 0.0)
    if not HASHED:
        bias = tl.load(bias_ptr + e, e_ok, other=0.0)
        pick = tl.where(e_ok[None, :], scores + bias[None, :], neg_inf)
    total = tl.zeros([BLOCK_T], tl.float32)
    KO: tl.constexpr = K + SHARED  # columns of the outputs
    KP: tl.constexpr = triton.next_power_of_2(KO)
    col = tl.arange(0, KP)[None, :]  # the picks stay in registers, [BT, KP], stored once
    picked = tl.zeros([BLOCK_T, KP], tl.int64)
    weights = tl.zeros([BLOCK_T, KP], tl.float32)
    counted = t_ok
    if COUNT == 2:
        counted = t_ok & (tl.load(mask_ptr + t, t_ok, other=0) != 0)
    for k in tl.static_range(K):
        if HASHED:
            token = tl.load(ids_ptr + t, t_ok, other=0)
            chosen = tl.load(table_ptr + token * K + k, t_ok, other=0).to(tl.int32)
        else:
            chosen = tl.argmax(pick, 1)
            pick = tl.where(e[None, :] == chosen[:, None], neg_inf, pick)
        weight = tl.sum(tl.where(e[None, :] == chosen[:, None], scores, 0.0), 1)
        total += weight
        picked = tl.where(col == k, chosen.to(tl.int64)[:, None], picked)
        weights = tl.where(col == k, weight[:, None], weights)
        if COUNT:  # integer atomics: the counts are exact whatever the order, so relaxed
            # (the default, acq_rel, ordered each after every earlier store; with the picks
            # stored once: route + align 42.3 -> 25.7 us for decode:1's 4 layers in graph
            # replay, H100, results/2026-12-06-s30.md)
            tl.atomic_add(
                counts_ptr + chosen, tl.full([BLOCK_T], 1, tl.int64), counted, sem="relaxed"
            )
    weights = weights * (scaling / (total + 1e-20))[:, None]
    if SHARED:
        picked = tl.where(col == K, shared_id, picked)
        weights = tl.where(col == K, 1.0, weights)
    out = t[:, None] * KO + col
    out_ok = t_ok[:, None] & (col < KO)
    tl.store(out_ids_ptr + out, picked, out_ok)
    tl.store(out_w_ptr + out, weights, out_ok)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    table_ptr,
    ids_ptr,
    out_ids_ptr,
    out_w_ptr,
    counts_ptr,
    mask_ptr,
    num_tokens,
    scaling,
    shared_id,
    E: tl.constexpr,
    K: tl.constexpr,
    SCORING: tl.constexpr,
    HASHED: tl.constexpr,
    SHARED: tl.constexpr,  # 1: column K is the shared expert (id shared_id, weight 1)
    COUNT: tl.constexpr,  # 0: no counts; 1: count every token; 2: tokens where mask
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    route_tokens(
        tl.program_id(0),
        logits_ptr,
        bias_ptr,
        table_ptr,
        ids_ptr,
        out_ids_ptr,
        out_w_ptr,
        counts_ptr,
        mask_ptr,
        num_tokens,
        scaling,
        shared_id,
        E,
        K,
        SCORING,
        HASHED,
        SHARED,
        COUNT,
        BLOCK_T,
        BLOCK_E,
    )


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    input_ids: torch.Tensor,
    top_k: int,
    scoring_func: str,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference.route``."""
    return route_fused(x, weight, bias, table, input_ids, top_k, scoring_func, scaling)


def route_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    input_ids: torch.Tensor,
    top_k: int,
    scoring_func: str,
    scaling: float,
    shared_expert: int | None = None,
    expert_counts: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
    linear: Callable = F.linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference.route_fused``: the router, the shared expert as pick k and the
    expert counts (integer atomics) in one kernel after the logits GEMM."""
    num_tokens = x.shape[0]
    num_experts = weight.shape[0]
    if (table is None) == (bias is None):
        raise ValueError("route: give the bias (learned routing) or the table (hash routing)")
    if expert_counts is not None and (
        expert_counts.dtype != torch.int64 or expert_counts.shape != (num_experts,)
    ):
        raise ValueError(
            f"expert_counts must be [{num_experts}] int64, got "
            f"{expert_counts.dtype} {tuple(expert_counts.shape)}"
        )
    if token_mask is not None and token_mask.shape != (num_tokens,):
        raise ValueError(f"token_mask must be [{num_tokens}], got {tuple(token_mask.shape)}")
    shared = shared_expert is not None
    cols = top_k + int(shared)
    ids = torch.empty(num_tokens, cols, dtype=torch.int64, device=x.device)
    weights = torch.empty(num_tokens, cols, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return ids, weights
    logits = linear(x, weight).contiguous()  # [T, E] in the activation dtype
    block_t = 16
    hashed = table is not None
    count = 0 if expert_counts is None else (1 if token_mask is None else 2)
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        bias if bias is not None else weights,
        table.contiguous() if hashed else ids,
        input_ids.contiguous(),
        ids,
        weights,
        expert_counts if expert_counts is not None else ids,
        token_mask.contiguous() if token_mask is not None else ids,
        num_tokens,
        scaling,
        shared_expert if shared else 0,
        E=num_experts,
        K=top_k,
        SCORING=_SCORING[scoring_func],
        HASHED=hashed,
        SHARED=int(shared),
        COUNT=count,
        BLOCK_T=block_t,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        num_warps=4,
        **pdl(logits.device),
    )
    return ids, weights
