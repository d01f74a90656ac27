"""Plain-torch reference of every model op: the specification, runs on any device.

Shape legend: T tokens in the flat batch, D hidden size, H attention heads, Dh head dim,
R rope dims (trailing slice of a head), N mHC streams, K keys visible to a query,
E routed experts, k experts per token, S queries, M rows gathered per query.

Numerics follow the DeepSeek-V4 reference: norms, softmaxes, mHC and router scores are
computed in float32 and cast back to the activation dtype once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., C]; weight: [C] (float32) or None for the unweighted norm."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] -> cos, sin: [T, R/2] (one angle per interleaved pair)."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2 * cos.shape[-1] channels of x.

    x: [T, ..., C]; cos, sin: [T, R/2]. Pairs are (2i, 2i+1) of the rope slice; the leading
    C - R "nope" channels pass through. Rotation in float32, like the reference.
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    extra = x.dim() - cos.dim()
    cos = cos.view(cos.shape[0], *([1] * extra), half)
    sin = sin.view(sin.shape[0], *([1] * extra), half)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat([nope, rotated.flatten(-2).to(x.dtype)], dim=-1)


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV multi-query attention of each query over its own gathered rows, with a
    per-head sink logit.

    q: [S, H, Dh]; kv: [S, M, Dh] (query s's window rows + selected compressed entries;
    keys == values); valid: [S, M] bool; sinks: [H] float32. The sink joins the softmax
    denominator only, so a query with no valid row returns zeros. Returns [S, H, Dh].
    """
    logits = torch.einsum("shd,smd->shm", q, kv) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1).expand(logits.shape[0], -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("shm,smd->shd", probs.to(kv.dtype), kv)


def compress_windows(
    kv_rows: torch.Tensor, gate_rows: torch.Tensor, position_bias: torch.Tensor, overlap: bool
) -> torch.Tensor:
    """Softmax-gated pooling of closed compressor windows (before the entry norm and RoPE).

    Non-overlapping (HCA): kv_rows, gate_rows: [W, r, C]; entry w pools window w.
    Overlapping (CSA): kv_rows, gate_rows: [W, 2r, 2C], the rows of window w-1 followed by
    window w (window -1 of entry 0 is given as gate -inf); entry w pools the first half
    ("Ca") of window w-1 with the second half ("Cb") of window w, per channel.
    position_bias: [r, C] or [r, 2C], added to the gates by slot within the window.
    Returns [W, C].
    """
    if not overlap:
        gates = gate_rows.float() + position_bias
        return (kv_rows * gates.softmax(dim=1).to(kv_rows.dtype)).sum(dim=1)
    r = position_bias.shape[0]
    c = kv_rows.shape[-1] // 2
    gates = gate_rows.float() + position_bias.repeat(2, 1)
    kv = torch.cat([kv_rows[:, :r, :c], kv_rows[:, r:, c:]], dim=1)  # [W, 2r, C]
    gate = torch.cat([gates[:, :r, :c], gates[:, r:, c:]], dim=1)
    return (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)


def topk_earliest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, best first; ties go to the earliest index.

    scores: [S, E] float32 -> [S, k] int64. ``torch.topk`` breaks ties in no fixed order
    (it differs between devices and tensor widths), so each score is packed with its index
    into one int64 key (``packed_earliest``): the keys are distinct and their top k is the
    stable-sort answer.
    """
    return packed_earliest(scores).topk(k, dim=-1).indices


def packed_earliest(scores: torch.Tensor) -> torch.Tensor:
    """[S, E] float scores -> [S, E] int64 keys, order-preserving float bits above,
    (2^31 - 1 - index) below (what the indexer kernels store and select from)."""
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)  # + 0.0: -0.0 -> 0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed-int order
    index = torch.arange(scores.shape[-1], device=scores.device)
    return (ordered.to(torch.int64) << 32) | (0x7FFFFFFF - index)


def indexer_topk(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    num_visible: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Lightning indexer: each query's top-k compressed entries by
    sum_h w[s,h] * relu(q[s,h] . key[s,e]) * scale.

    q: [S, Hi, Di]; keys: [S, E, Di] (the query's request's entries 0..E-1); weights:
    [S, Hi] float32; num_visible: [S] (entries >= it are not visible yet). Returns [S, k]
    int64 entry ids, best first, ties to the earliest; ids >= num_visible[s] (picked only
    when fewer than k are visible) are for the caller to mask.
    """
    scores = torch.einsum("shd,sed->she", q.float(), keys.float()).relu() * scale
    scores = (scores * weights.float().unsqueeze(-1)).sum(dim=1)  # [S, E]
    entry = torch.arange(keys.shape[1], device=keys.device)
    scores = scores.masked_fill(entry[None, :] >= num_visible[:, None], float("-inf"))
    return topk_earliest(scores, k)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project positive [.., N, N] matrices towards doubly stochastic (column first)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC mixing weights from the N residual streams.

    streams: [T, N, D]; fn: [(2+N)N, N*D]; base: [(2+N)N]; scale: [3].
    Returns pre [T, N], post [T, N], comb [T, N, N] (float32).
    """
    n = streams.shape[1]
    flat = rms_norm(streams.flatten(1).float(), None, norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, sinkhorn_iters, hc_eps)


def split_bf16x3(fn: torch.Tensor) -> torch.Tensor:
    """fn [M, K] fp32 -> [3, M, K] bf16 pieces (hi, mid, lo), each the nearest bf16 to what
    the ones before leave (the differences are exact in fp32): hi + mid + lo carries fn's 24
    significant bits, to within 2^-24 |fn|, so bf16 dots of bf16 rows against the pieces,
    summed in fp32, are as exact as the fp32 products (the mHC K1's "bf16x3")."""
    hi = fn.to(torch.bfloat16)
    rest = fn - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack((hi, mid, (rest - mid.float()).to(torch.bfloat16)))


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams: [T, N, D], pre: [T, N] -> [T, D] in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_expand(
    streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams = post * block_out + comb^T @ streams.

    streams: [T, N, D]; block_out: [T, D]; post: [T, N]; comb: [T, N, N] where comb[j, k]
    weighs input stream j into output stream k. Returns [T, N, D].
    """
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1) + mixed


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """logits: [T, E] -> per-expert scores [T, E] float32."""
    logits = logits.float()
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    h_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Routed experts, one loop iteration per expert that has tokens.

    x: [T, D]; topk_ids, topk_weights: [T, k]; w13: [E, 2I, D] (gate rows then up rows);
    w2: [E, D, I]. Returns [T, D]. ``h_dtype``: the precision of the fused and grouped
    MoE kernels for 16-bit weights: both GEMMs in fp32 with the SwiGLU output rounded once
    to ``h_dtype``, the output rounded once to x's dtype.
    """
    out, dtype = torch.zeros_like(x), x.dtype
    if h_dtype is not None:  # fp32 GEMMs and sum, h rounded once, the output once
        out, x, w13, w2 = out.float(), x.float(), w13.float(), w2.float()
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // topk_ids.shape[1]
    weights = topk_weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        h = swiglu(gate, up, limit)
        if h_dtype is not None:
            h = h.to(h_dtype).float()
        y = F.linear(h, w2[expert])
        out.index_add_(0, rows, (y * weights[start : start + count, None]).to(out.dtype))
        start += count
    return out.to(dtype)


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC before a block: mixing weights, collapse, then the block's RMSNorm.

    streams: [T, N, D]; fn: [(2+N)N, N*D]; base: [(2+N)N]; scale: [3]; norm_weight: [D].
    Returns x [T, D] in the streams' dtype (the block input), post [T, N], comb [T, N, N]
    (float32, for ``hc_post``).
    """
    pre, post, comb = hc_weights(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return rms_norm(hc_collapse(streams, pre), norm_weight, norm_eps), post, comb


@dataclass(frozen=True)
class ExpertSlots:
    """A fused MoE's output before its slot sum (``moe_routed(..., defer_sum=True)`` on the
    fast path): ``hc_post`` and ``hc_post_pre`` take it as their ``block_out`` and their
    first kernel sums it, one launch fewer per layer."""

    slots: torch.Tensor  # [T * k, D] fp32: each token's k weighted expert outputs, in order
    ids: torch.Tensor  # [T, k] expert ids; a slot whose id is outside [0, num_experts) adds 0
    num_experts: int
    dtype: torch.dtype  # the sum's (the activations'), rounded to nearest even

    def sum(self) -> torch.Tensor:
        """[T, D]: the routed slots of each token summed in slot order, in fp32."""
        t, k = self.ids.shape
        slots = self.slots.view(t, k, -1)
        routed = (self.ids >= 0) & (self.ids < self.num_experts)
        acc = torch.zeros_like(slots[:, 0])
        for j in range(k):
            acc = acc + torch.where(routed[:, j, None], slots[:, j], 0.0)
        return acc.to(self.dtype)


def hc_post(
    streams: torch.Tensor,
    block_out: torch.Tensor | ExpertSlots,
    post: torch.Tensor,
    comb: torch.Tensor,
) -> torch.Tensor:
    """mHC after a block (``hc_expand``): streams [T, N, D], block_out [T, D] -> [T, N, D]."""
    if isinstance(block_out, ExpertSlots):
        block_out = block_out.sum()
    return hc_expand(streams, block_out, post, comb)


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    norm_weight: torch.Tensor,
) -> torch.Tensor:
    """Final collapse (sigmoid weights, no Sinkhorn) then the final RMSNorm.

    streams: [T, N, D]; fn: [N, N*D]; base: [N]; scale: [1]; norm_weight: [D].
    Returns [T, D] in the streams' dtype (``HyperHead`` followed by the model's ``norm``).
    """
    flat = rms_norm(streams.flatten(1).float(), None, norm_eps)
    mixes = F.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return rms_norm(hc_collapse(streams, pre), norm_weight, norm_eps)


def compress_pool(
    state: torch.Tensor,
    src: torch.Tensor,
    missing: torch.Tensor | None,
    col: int,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
) -> torch.Tensor:
    """Compressed entries of closing windows, from the raw rows in the state cache.

    state: [Ns, Wst] (flat state cache); src: [n, span] slots of each window's rows (span
    r, or 2r with overlap: window w-1 then window w); missing: [n, span] bool rows that do
    not exist (window -1 of CSA entry 0), or None; col: the first state column of this
    compressor's [kv | gate] rows (each ``row`` = ape.shape[1] wide); ape: [r, row] float32
    position bias; norm_weight: [C]; positions: [n] entry positions (w * r) for the RoPE
    (``inv_freq`` [R/2], ``rope_scale``). Pool (``compress_windows``), RMSNorm, RoPE.
    Returns [n, C] in the state's dtype.
    """
    row = ape.shape[1]
    rows = state[src][..., col : col + 2 * row]  # [n, span, 2 * row]
    kv, gate = rows[..., :row], rows[..., row:]
    if missing is not None:
        gate = gate.masked_fill(missing[..., None], float("-inf"))
        kv = kv.masked_fill(missing[..., None], 0.0)
    pooled = compress_windows(kv, gate, ape, src.shape[1] > ape.shape[0])
    cos, sin = rope_cos_sin(positions, inv_freq, rope_scale, pooled.dtype)
    return apply_rope(rms_norm(pooled, norm_weight, eps), cos, sin)


def hc_post_pre(
    streams: torch.Tensor,
    block_out: torch.Tensor | ExpertSlots,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_post`` of one block, then ``hc_pre`` of the next on the new streams.

    Returns the new streams [T, N, D] and the next block's x [T, D], post [T, N], comb [T, N, N].
    """
    streams = hc_post(streams, block_out, post, comb)
    return (
        streams,
        *hc_pre(streams, fn, base, scale, norm_weight, sinkhorn_iters, hc_eps, norm_eps),
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
    linear: Callable = F.linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of one MoE layer: which k experts each token goes to, with what weight.

    x: [T, D]; weight: [E, D]; learned routing: bias [E] float32 (selection only: top-k
    of score + bias), table None; hash routing: table [V, k] (``tid2eid``), bias None;
    input_ids: [T]. Weights are the selected scores, normalised, times ``scaling``.
    ``linear``: the logits projection (the fast path's may be the GEMV).
    Returns ids [T, k] int64, weights [T, k] float32.
    """
    scores = router_scores(linear(x, weight), scoring_func)
    if table is not None:
        ids = table[input_ids].long()
    else:
        ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def paged_sparse_attention(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    slots_a: torch.Tensor,
    kv_b: torch.Tensor,
    slots_b: torch.Tensor,
    valid: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    *,
    q_norm_eps: float | None = None,
) -> torch.Tensor:
    """``sparse_attention`` over rows gathered from two paged caches by slot, optionally
    followed by the inverse RoPE of the output.

    q: [S, H, Dh]; kv_a: [Na, Dh] (window rows); kv_b: [Nb, Cb >= Dh] (compressed entries:
    only the first Dh columns are KV); slots_a: [S, Wa], slots_b: [S, Wb] (Wb may be 0) int;
    valid: [S, Wa + Wb] bool over the rows [window | compressed]; sinks: [H] float32.
    Invalid rows are zeroed before the attention (a masked logit is -inf, but 0 * NaN
    garbage would still leak into the output), so their slots may hold anything; slots of
    invalid rows must still index the caches here. cos, sin: [S, R/2] or None: when given,
    the output gets ``apply_rope(out, cos, -sin)`` (K = V carried the rows' RoPE into the
    output's rope slice). q_norm_eps: q arrives raw (the ``wq_b`` output) and gets the
    prologue's ``rms_norm_rope`` (unweighted, this eps; needs cos, sin) first, so a kernel
    can norm q as it loads it. Returns [S, H, Dh].
    """
    if q_norm_eps is not None:
        if cos is None or sin is None:
            raise ValueError("paged_sparse_attention: a raw q (q_norm_eps) needs cos and sin")
        q = rms_norm_rope(q, None, q_norm_eps, cos, sin)
    dh = q.shape[-1]
    # rows of a narrower cache (kv_cache_dtype fp8) are widened to q's dtype once gathered
    kv = torch.cat([kv_a[:, :dh][slots_a].to(q.dtype), kv_b[:, :dh][slots_b].to(q.dtype)], 1)
    kv = kv.masked_fill(~valid[..., None], 0.0)  # [S, Wa + Wb, Dh]
    out = sparse_attention(q, kv, valid, sinks, scale)
    if cos is None:
        return out
    return apply_rope(out, cos, -sin)


def paged_indexer_topk(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    num_visible: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """``indexer_topk`` reading each query's keys through its slot list.

    q: [S, Hi, Di]; key_cache: [N, C] rows whose first Di columns are the index keys (a
    column slice of the csa_kv cache: C may be the row stride of a wider cache); slots:
    [S, E] int64, entry e of query s's request lives at row slots[s, e]; weights [S, Hi]
    float32; num_visible: [S]. Returns [S, k] int64 entry ids (see ``indexer_topk``).
    """
    keys = key_cache[slots][..., : q.shape[-1]]  # [S, E, Di]
    return indexer_topk(q, keys, weights, scale, num_visible, k)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """RMSNorm over the last dim, then interleaved RoPE on its trailing 2 * R/2 channels.

    x: [T, ..., C]; weight: [C] float32 or None; cos, sin: [T, R/2]. Both steps round to
    x's dtype, as the unfused ops do (the q and kv paths of attention).
    """
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


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
    """``route``, then the MoE's bookkeeping, so that one kernel can do all of it.

    expert_counts: optional [E] int64 accumulator: += the routed picks of every token where
    ``token_mask`` [T] bool is True (None: every token). shared_expert: when given, the
    shared expert's id (E: its weights stacked after the routed ones) is appended to every
    token's picks with weight 1.0. Returns ids [T, k (+1)] int64, weights [T, k (+1)] f32.
    """
    ids, weights = route(x, weight, bias, table, input_ids, top_k, scoring_func, scaling, linear)
    if expert_counts is not None:
        ones = torch.ones_like(ids, dtype=expert_counts.dtype)
        if token_mask is not None:
            ones = ones * token_mask[:, None]
        expert_counts.index_add_(0, ids.flatten(), ones.flatten())
    if shared_expert is not None:
        shared = torch.full_like(ids[:, :1], shared_expert)
        ids = torch.cat([ids, shared], dim=1)
        weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
    return ids, weights


FP8_MAX = 448.0  # the largest e4m3 value


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: e4m3 (``--kv-cache-dtype fp8``) saturates at
    +-448 like the kernels' encoding, on every device (torch's cast saturates on the CPU
    but gives NaN on CUDA, 2026-12-01 on the H200); other dtypes are a plain cast."""
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def kv_insert(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    swa: torch.Tensor,
    swa_slots: torch.Tensor,
    rows: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    state_slots: torch.Tensor | None = None,
) -> None:
    """Write one step's rows into a layer's caches (in place; returns nothing).

    kv: [T, C] the raw kv projection: normed (``weight`` [C]) and roped (cos, sin [T, R/2])
    into ``swa`` [N, C] at ``swa_slots`` [T]; rows: [T, W] the compressor's raw rows, copied
    into ``state`` [Ns, W] at ``state_slots`` [T] (None on sliding layers). Padded tokens
    may share a (null-block) slot: which of them lands there is unspecified.
    """
    swa[swa_slots] = as_stored(rms_norm_rope(kv, weight, eps, cos, sin), swa.dtype)
    if rows is not None:
        assert state is not None and state_slots is not None
        state[state_slots] = as_stored(rows, state.dtype)


def compress_entries(
    state: torch.Tensor,
    src: torch.Tensor,
    missing: torch.Tensor | None,
    dst: torch.Tensor,
    entries: torch.Tensor,
    parts: Sequence[tuple[int, torch.Tensor, torch.Tensor, int]],
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
) -> None:
    """``compress_pool`` for each compressor of a layer, stored into the entry cache.

    dst: [n] entry slots; entries: [N, W] (flat entry cache); parts: (state column, ape,
    norm_weight, first entry column) per compressor (the CSA kv compressor and the
    indexer's). Other arguments as ``compress_pool``. Writes in place, returns nothing.
    """
    for col, ape, norm_weight, out_col in parts:
        new = compress_pool(
            state, src, missing, col, ape, norm_weight, eps, positions, inv_freq, rope_scale
        )
        entries[dst, out_col : out_col + norm_weight.shape[0]] = as_stored(new, entries.dtype)


def paged_indexer_select(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    num_visible: torch.Tensor,
    k: int,
    window_valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSA rows besides the window: ``select_entries`` of ``paged_indexer_topk``'s picks.
    Returns (slots [S, k], valid [S, W + k] bool)."""
    ids = paged_indexer_topk(q, key_cache, slots, weights, scale, num_visible, k)
    return select_entries(ids, slots, num_visible, window_valid)


def select_entries(
    ids: torch.Tensor,
    slots: torch.Tensor,
    num_visible: torch.Tensor,
    window_valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed rows CSA queries attend to: the slots of the indexer's picks and the
    validity over [window | picks].

    ids: [S, K] picked entry ids (< E); slots: [S, E] slots of each query's entries;
    num_visible: [S] entries each query may see; window_valid: [S, W] bool. Returns
    (slots [S, K], valid [S, W + K] bool: the window's, then pick < num_visible).
    """
    picked = ids < num_visible[:, None]
    return slots.gather(1, ids), torch.cat([window_valid, picked], dim=1)


def attention_prologue(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    swa: torch.Tensor,
    swa_slots: torch.Tensor,
    rows: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    state_slots: torch.Tensor | None = None,
    index_q: torch.Tensor | None = None,
    head_logits: torch.Tensor | None = None,
    head_scale: float = 1.0,
    *,
    norm_q: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Everything attention does to its projections before attending, as one op.

    q: [T, H, Dh] (``wq_b`` output): the unweighted per-head norm + RoPE (``norm_q``
    False: returned as it came, for an attention that norms it, ``q_norm_eps``); kv, rows,
    the caches and slots: ``kv_insert``; index_q: [T, Hi, Di] the indexer's q (RoPE only)
    and head_logits: [T, Hi] (``weights_proj`` output, scaled by ``head_scale`` in
    float32), CSA layers only. Returns (q [T, H, Dh], index q or None, index weights f32
    or None).
    """
    kv_insert(kv, kv_weight, eps, cos, sin, swa, swa_slots, rows, state, state_slots)
    if norm_q:
        q = rms_norm_rope(q, None, eps, cos, sin)
    if index_q is None:
        return q, None, None
    assert head_logits is not None
    return q, apply_rope(index_q, cos, sin), head_logits.float() * head_scale


def moe_sort_pairs(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped MoE's layout: the (token, slot) pairs sorted by expert, stably.

    topk_ids [T, k] in [0, E). Returns (the token of each sorted row [T*k] int32, the
    sorted row of each pair [T, k] int32, the end row of each expert's run [E] int32)."""
    t, k = topk_ids.shape
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=flat.device))
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0)
    return (order // k).to(torch.int32), inverse.to(torch.int32).view(t, k), ends.to(torch.int32)


def moe_permute(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """The grouped MoE's input rows: x [T, D], inverse [T, k] the sorted row of each (token,
    slot) (``moe_sort_pairs``). Returns rows [T*k, D] with rows[inverse[t, j]] = x[t]."""
    t, k = inverse.shape
    rows = x.new_empty(t * k, x.shape[1])
    rows[inverse.flatten().long()] = x.repeat_interleave(k, dim=0)
    return rows


def swiglu_rows(h: torch.Tensor, limit: float) -> torch.Tensor:
    """``swiglu`` of concatenated rows: h [N, 2I] = [gate | up] -> [N, I] in h's dtype,
    computed in float32 and rounded once (the grouped MoE's activation)."""
    gate, up = h.float().chunk(2, dim=-1)
    return swiglu(gate, up, limit).to(h.dtype)


def moe_unpermute(
    y: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """The grouped MoE's combine: y [N, D] expert outputs in expert order; inverse [T, k]
    the row of y of each (token, slot); weights [T, k]; extra: an optional [T, D] output of
    weight 1 taken as the last slot (the shared expert run apart). Returns [T, D] in y's
    dtype: sum_j weights[t, j] * y[inverse[t, j]] (+ extra[t]), summed in slot order in
    float32."""
    out = y[inverse].float() * weights.float().unsqueeze(-1)
    if extra is not None:
        out = torch.cat([out, extra.float().unsqueeze(1)], dim=1)
    return out.sum(dim=1).to(y.dtype)


def moe_routed(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    input_ids: torch.Tensor,
    top_k: int,
    scoring_func: str,
    scaling: float,
    shared_expert: int | None,
    expert_counts: torch.Tensor | None,
    token_mask: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    defer_sum: bool = False,
    linear: Callable = F.linear,
    shared_beside: bool = False,
) -> torch.Tensor:
    """The MoE of one layer, router included: ``route_fused`` (arguments up to
    token_mask), then ``moe_experts`` over w13 [E (+1), 2I, D], w2 [E (+1), D, I] (the
    shared expert stacked last when ``shared_expert`` is its id). Returns [T, D].
    ``defer_sum``: the fast path may return :class:`ExpertSlots` instead (the reference
    always sums); ``shared_beside``: where the fast path runs the shared expert (on a side
    stream), no value changes."""
    ids, weights = route_fused(
        x, gate_weight, bias, table, input_ids, top_k, scoring_func, scaling, shared_expert,
        expert_counts, token_mask, linear,
    )  # fmt: skip
    return moe_experts(x, ids, weights, w13, w2, limit)


def embed_streams(input_ids: torch.Tensor, weight: torch.Tensor, num_streams: int) -> torch.Tensor:
    """input_ids [T] -> [T, N, D]: each token's embedding row, copied into its N mHC streams
    (the model's input). ``torch.cat`` copies in wide vectors where a strided
    ``expand().contiguous()`` does not (8192 tokens: 191 against 310 us, H100, session 28)."""
    x = F.embedding(input_ids, weight)
    return torch.cat([x] * num_streams, dim=-1).view(*x.shape[:-1], num_streams, x.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A projection without bias: x [T, K], weight [N, K] -> [T, N] (``x @ weight.T``, fp32
    accumulation, one rounding to x's dtype). The spec of ``ops/triton/gemv.py``."""
    return F.linear(x, weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A block-diagonal projection (the attention's ``wo_a``): x [T, G, in], weight
    [G * out, in] -> [T, G * out], group g's outputs from its own inputs. One batched GEMM
    over the groups writing its [G, T, out] result straight into the [T, G, out] layout
    (strided rows: no copy). The spec of ``ops/triton/gemv.py`` with ``groups``."""
    groups = x.shape[1]
    w = weight.view(groups, -1, x.shape[-1])  # [G, out, in]
    out = x.new_empty(x.shape[0], groups, w.shape[1])
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out.flatten(1)


def logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The lm_head: x [S, D], weight [V, D] -> [S, V] float32, rounded to x's dtype first as
    transformers does (``linear`` then a cast), into ``out`` when given. The fast path's
    cuBLAS GEMM writes the fp32 accumulator instead (no rounding, no [S, V] cast kernel):
    within the bf16 tolerance."""
    y = F.linear(x, weight).float()
    return y if out is None else out.copy_(y)
