"""Fused window compression: ``compress_pool`` in one launch (equals its ``ops.reference``
namesake), and ``compress_entries``: every compressor of a layer (CSA: the kv and the
indexer's) in one launch (grid axis 1), written straight into the entry cache.

One program per closing window: it walks the window's raw rows straight out of the paged
state cache (through ``src`` slots), keeps an online softmax per channel over
(gate + position bias), pools the kv rows, applies the RMSNorm and the RoPE at the entry
position in registers and writes the entry. Channels are handled as (even, odd) pairs, so
the interleaved RoPE needs no shuffle. The grid is the number of candidate windows: fixed
for a given batch, so the op can be captured in a CUDA graph.

Shape legend: n windows, span rows per window (r, or 2r with CSA's overlap), C entry width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl, pdl_wait, round_as
from rackserve.ops.triton.fp8 import as_codes, is_fp8, to_cache

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# the parts' scalars stay runtime ints (no ==1 specialisation), so both branches that pick
# a part yield the same types
@triton.jit(do_not_specialize=["col0", "width0", "out_col0", "col1", "width1", "out_col1"])
def _compress_kernel(
    state_ptr,
    state_stride,
    src_ptr,
    missing_ptr,
    pos_ptr,
    inv_freq_ptr,
    out_ptr,  # DST: the entry cache [N, >= entry columns] (e4m3: uint8 codes); else [n, C]
    out_stride,
    dst_ptr,  # DST only: [n] entry slots
    eps,
    rope_scale,
    # part 0 / part 1 (grid axis 1): the compressors of one layer (CSA: kv and indexer)
    ape0_ptr,
    norm0_ptr,
    col0,  # first state column of the part's [kv | gate] rows
    width0,  # C: entry width (even)
    out_col0,  # first entry column written
    ape1_ptr,
    norm1_ptr,
    col1,
    width1,
    out_col1,
    SPAN: tl.constexpr,
    RATIO: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    HAS_MISSING: tl.constexpr,
    DST: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    w = tl.program_id(0)
    if DST:  # straight into the entry cache
        row = tl.load(dst_ptr + w).to(tl.int64)
        # slot 0 (the null block) takes the candidates whose window does not close this step
        # (a captured graph launches them all): they leave at once
        if row == 0:
            return
    else:
        row = w.to(tl.int64)
    if tl.program_id(1) == 0:
        ape_ptr, norm_ptr, col, C, out_col = ape0_ptr, norm0_ptr, col0, width0, out_col0
    else:
        ape_ptr, norm_ptr, col, C, out_col = ape1_ptr, norm1_ptr, col1, width1, out_col1
    ROW = C * (SPAN // RATIO)  # the part's row width: C, or 2C with the overlap
    h = tl.arange(0, BLOCK_H)  # channel pair h: channels 2h (even) and 2h + 1 (odd)
    h_ok = h < C // 2
    even = 2 * h
    neg_inf = float("-inf")
    m_e = tl.full([BLOCK_H], neg_inf, tl.float32)
    m_o = tl.full([BLOCK_H], neg_inf, tl.float32)
    l_e = tl.zeros([BLOCK_H], tl.float32)
    l_o = tl.zeros([BLOCK_H], tl.float32)
    a_e = tl.zeros([BLOCK_H], tl.float32)
    a_o = tl.zeros([BLOCK_H], tl.float32)
    for j0 in range(0, SPAN, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        j_ok = j < SPAN
        slot = tl.load(src_ptr + w * SPAN + j, mask=j_ok, other=0)
        exists = j_ok
        if HAS_MISSING:
            gone = tl.load(missing_ptr + w * SPAN + j, mask=j_ok, other=1)
            exists = exists & (gone == 0)
        # overlap (span 2r): rows of window w-1 use the first C columns, window w the rest
        half = tl.where(j >= RATIO, C, 0) if SPAN > RATIO else tl.zeros([BLOCK_R], tl.int32)
        ok = exists[:, None] & h_ok[None, :]
        base = state_ptr + slot[:, None] * state_stride + col + half[:, None] + even[None, :]
        bias = ape_ptr + (j % RATIO)[:, None] * ROW + half[:, None] + even[None, :]
        bias_ok = j_ok[:, None] & h_ok[None, :]
        kv_e = tl.load(base, mask=ok, other=0.0).to(tl.float32)
        kv_o = tl.load(base + 1, mask=ok, other=0.0).to(tl.float32)
        g_e = tl.load(base + ROW, mask=ok, other=0.0).to(tl.float32)
        g_o = tl.load(base + ROW + 1, mask=ok, other=0.0).to(tl.float32)
        g_e = tl.where(ok, g_e + tl.load(bias, mask=bias_ok, other=0.0), neg_inf)
        g_o = tl.where(ok, g_o + tl.load(bias + 1, mask=bias_ok, other=0.0), neg_inf)
        # online softmax over the rows, per channel (a block may be entirely missing)
        new_e = tl.maximum(m_e, tl.max(g_e, 0))
        new_o = tl.maximum(m_o, tl.max(g_o, 0))
        safe_e = tl.where(new_e == neg_inf, 0.0, new_e)
        safe_o = tl.where(new_o == neg_inf, 0.0, new_o)
        p_e = tl.exp(g_e - safe_e[None, :])
        p_o = tl.exp(g_o - safe_o[None, :])
        alpha_e = tl.exp(m_e - safe_e)
        alpha_o = tl.exp(m_o - safe_o)
        l_e = l_e * alpha_e + tl.sum(p_e, 0)
        l_o = l_o * alpha_o + tl.sum(p_o, 0)
        a_e = a_e * alpha_e + tl.sum(p_e * kv_e, 0)
        a_o = a_o * alpha_o + tl.sum(p_o * kv_o, 0)
        m_e, m_o = new_e, new_o
    # pooled entry, rounded as the reference rounds it (activation dtype), then RMSNorm
    x_e = round_as(tl.where(h_ok, a_e / tl.where(l_e > 0, l_e, 1.0), 0.0), OUT_DTYPE)
    x_o = round_as(tl.where(h_ok, a_o / tl.where(l_o > 0, l_o, 1.0), 0.0), OUT_DTYPE)
    rms = tl.rsqrt((tl.sum(x_e * x_e, 0) + tl.sum(x_o * x_o, 0)) / C + eps)
    w_e = tl.load(norm_ptr + even, mask=h_ok, other=0.0)
    w_o = tl.load(norm_ptr + even + 1, mask=h_ok, other=0.0)
    n_e = round_as(w_e * (x_e * rms), OUT_DTYPE)
    n_o = round_as(w_o * (x_o * rms), OUT_DTYPE)
    # interleaved RoPE on the trailing ROPE_HALF pairs, at the entry position
    k = h - (C // 2 - ROPE_HALF)
    is_rope = (k >= 0) & h_ok
    freq = tl.load(inv_freq_ptr + k, mask=is_rope, other=0.0)
    angle = tl.load(pos_ptr + w).to(tl.float32) * freq
    cos = round_as(tl.cos(angle) * rope_scale, OUT_DTYPE)
    sin = round_as(tl.sin(angle) * rope_scale, OUT_DTYPE)
    o_e = tl.where(is_rope, n_e * cos - n_o * sin, n_e)
    o_o = tl.where(is_rope, n_o * cos + n_e * sin, n_o)
    out = out_ptr + row * out_stride + out_col + even
    tl.store(out, to_cache(o_e, out_ptr, OUT_DTYPE), mask=h_ok)  # fp8 entries: e4m3 codes
    tl.store(out + 1, to_cache(o_o, out_ptr, OUT_DTYPE), mask=h_ok)


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
    """See ``reference.compress_pool``; returns [n, C] in the state's dtype."""
    n = src.shape[0]
    width = norm_weight.shape[0]
    out = torch.empty(n, width, dtype=state.dtype, device=state.device)
    _launch(state, src, missing, None, out, [(col, ape, norm_weight, 0)], eps, positions,
            inv_freq, rope_scale)  # fmt: skip
    return out


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
    """See ``reference.compress_entries``: every part (at most 2) in one launch, written
    straight into the entry cache."""
    entries_ok = entries.dtype == state.dtype or is_fp8(entries)  # --kv-cache-dtype fp8
    if not entries_ok or entries.dim() != 2 or entries.stride(1) != 1:
        raise ValueError(
            "compress_entries: entries must be [N, W] rows in the state's dtype or e4m3"
        )
    if tuple(dst.shape) != (src.shape[0],):
        raise ValueError(f"compress_entries: dst must be [{src.shape[0]}], got {dst.shape}")
    for _, _, norm_weight, out_col in parts:
        if out_col + norm_weight.shape[0] > entries.shape[1]:
            raise ValueError("compress_entries: a part's columns run past the entry width")
    _launch(
        state, src, missing, dst, as_codes(entries), parts, eps, positions, inv_freq, rope_scale
    )


def _launch(
    state: torch.Tensor,
    src: torch.Tensor,
    missing: torch.Tensor | None,
    dst: torch.Tensor | None,
    out: torch.Tensor,
    parts: Sequence[tuple[int, torch.Tensor, torch.Tensor, int]],
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
) -> None:
    n, span = src.shape
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"compress: 1 or 2 parts, got {len(parts)}")
    if state.stride(1) != 1 or state.dtype not in _TL_DTYPE:
        raise ValueError("compress_pool: the state cache must be row-contiguous fp32/bf16/fp16")
    ratio = parts[0][1].shape[0]
    args = []
    for col, ape, norm_weight, out_col in parts:
        width = norm_weight.shape[0]
        if width % 2 or 2 * inv_freq.shape[0] > width:
            raise ValueError("compress_pool: the entry width must be even and hold the rope dims")
        if ape.shape != (ratio, width * (span // ratio)) or span not in (ratio, 2 * ratio):
            raise ValueError(
                f"compress_pool: ape must be [r, C * span / r] with span r or 2r, got "
                f"{tuple(ape.shape)} for C={width}, span={span}"
            )
        args += [ape.contiguous(), norm_weight.contiguous(), col, width, out_col]
    if len(parts) == 1:
        args += args
    if n == 0:
        return
    src = src.contiguous()
    gone = missing.contiguous().view(torch.uint8) if missing is not None else src
    widest = max(p[2].shape[0] for p in parts)
    _compress_kernel[(n, len(parts))](
        state,
        state.stride(0),
        src,
        gone,
        positions.contiguous(),
        inv_freq.to(torch.float32).contiguous(),
        out,
        out.stride(0),
        dst.contiguous() if dst is not None else src,
        eps,
        rope_scale,
        *args,
        SPAN=span,
        RATIO=ratio,
        ROPE_HALF=inv_freq.shape[0],
        HAS_MISSING=missing is not None,
        DST=dst is not None,
        OUT_DTYPE=_TL_DTYPE[state.dtype],
        BLOCK_H=triton.next_power_of_2(widest // 2),
        # [8, 256]-pair tiles over 8 warps: 128 registers, no spills (16 rows at 4 warps
        # spilled 544 bytes: 85 us for one HCA window on the H200)
        BLOCK_R=min(triton.next_power_of_2(span), 8),
        num_warps=8,
        **pdl(state.device),
    )
