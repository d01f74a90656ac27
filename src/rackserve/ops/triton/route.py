"""The MoE router in one launch (equals ``reference.route``).

A program takes BLOCK_T tokens: their logits against every expert (a [BLOCK_T, D] x [D, E]
fp32 dot over D chunks, rounded to the activation dtype as ``F.linear``
rounds), the scores (sqrt-softplus, sigmoid or softmax), the k experts (hash layers: the
token's row of the table; learned: k rounds of argmax over score + bias), and the
normalised, scaled weights of the chosen experts. The grid is ceil(T / BLOCK_T): fixed for a
batch, so the op can be captured in a CUDA graph.

Shape legend: T tokens, D hidden, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    table_ptr,
    ids_ptr,
    out_ids_ptr,
    out_w_ptr,
    num_tokens,
    scaling,
    E: tl.constexpr,
    K: tl.constexpr,
    SCORING: tl.constexpr,
    HASHED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
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
    for k in tl.static_range(K):
        if HASHED:
            token = tl.load(ids_ptr + t, t_ok, other=0)
            chosen = tl.load(table_ptr + token * K + k, t_ok, other=0).to(tl.int32)
        else:
            chosen = tl.argmax(pick, 1)
            pick = tl.where(e[None, :] == chosen[:, None], neg_inf, pick)
        weight = tl.sum(tl.where(e[None, :] == chosen[:, None], scores, 0.0), 1)
        total += weight
        tl.store(out_ids_ptr + t * K + k, chosen.to(tl.int64), t_ok)
        tl.store(out_w_ptr + t * K + k, weight, t_ok)
    # normalise in a second pass over the k just written (same program, same addresses)
    norm = scaling / (total + 1e-20)
    for k in tl.static_range(K):
        weight = tl.load(out_w_ptr + t * K + k, t_ok, other=0.0)
        tl.store(out_w_ptr + t * K + k, weight * norm, t_ok)


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
    num_tokens = x.shape[0]
    num_experts = weight.shape[0]
    if (table is None) == (bias is None):
        raise ValueError("route: give the bias (learned routing) or the table (hash routing)")
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return ids, weights
    logits = F.linear(x, weight).contiguous()  # [T, E] in the activation dtype
    block_t = 16
    hashed = table is not None
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        bias if bias is not None else weights,
        table.contiguous() if hashed else ids,
        input_ids.contiguous(),
        ids,
        weights,
        num_tokens,
        scaling,
        E=num_experts,
        K=top_k,
        SCORING=_SCORING[scoring_func],
        HASHED=hashed,
        BLOCK_T=block_t,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        num_warps=4,
    )
    return ids, weights
