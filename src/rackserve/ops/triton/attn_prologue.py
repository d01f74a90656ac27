"""What attention does to its projections before the sparse attention, in one launch
(equals ``reference.attention_prologue``): the per-head q norm + RoPE, the kv norm + RoPE
straight into the window cache with the compressor's raw rows into the state cache
(``kv_insert``; an e4m3 window cache gets the reference's fp8 codes, ``fp8.py``), and on
CSA layers the indexer's q RoPE and its head weights' scaling.

The grid is the concatenation of each part's row blocks (``norm_rope_rows`` of
``norm_rope.py`` per part; the program id picks the part)::

    programs  0 ...... nq | nq ... + nk | ... + ni | ... + nw
              q rows (T*H) | kv (T)      | index q  | weights (T*Hi)

Sizes depend on the shapes only: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl, pdl_wait
from rackserve.ops.triton.fp8 import as_codes, is_fp8
from rackserve.ops.triton.norm_rope import _block_rows, norm_rope_rows


@triton.jit
def _prologue_kernel(
    q_ptr,  # [T, H, Dh] unit channel stride
    q_out_ptr,  # [T, H, Dh] contiguous
    kv_ptr,  # [T, Dh]
    kv_w_ptr,  # [Dh] fp32
    cos_ptr,
    sin_ptr,
    swa_ptr,
    swa_slots_ptr,
    rows_ptr,  # [T, W] COPY only
    state_ptr,
    state_slots_ptr,
    iq_ptr,  # [T, Hi, Di] INDEX only
    iq_out_ptr,
    hl_ptr,  # [T, Hi] head logits, INDEX only
    w_out_ptr,  # [T, Hi] fp32
    num_tokens,
    nq,  # program counts of the parts
    nk,
    ni,
    eps,
    head_scale,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_ct,
    stride_st,
    stride_swa,
    stride_rows,
    stride_state,
    stride_iqt,
    stride_iqh,
    stride_hl,
    H: tl.constexpr,
    DH: tl.constexpr,
    HALF: tl.constexpr,
    BQ: tl.constexpr,  # rows per program of each part
    BK: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    COPY: tl.constexpr,
    BLOCK_COPY: tl.constexpr,
    INDEX: tl.constexpr,
    HI: tl.constexpr,
    DI: tl.constexpr,
    BI: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    BW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    if pid < nq:  # q: the unweighted per-head norm, then RoPE
        norm_rope_rows(
            pid, q_ptr, q_ptr, cos_ptr, sin_ptr, q_out_ptr, q_ptr, q_ptr, q_ptr, q_ptr,
            num_tokens * H, H, eps, stride_qt, stride_qh, stride_ct, stride_st, 0, 0, 0,
            DH, HALF, BQ, BLOCK_DH, BLOCK_HALF, True, False, True, False, 0, 16,
        )  # fmt: skip
    elif pid < nq + nk:  # kv: weighted norm + RoPE into its window slot; state rows
        norm_rope_rows(
            pid - nq, kv_ptr, kv_w_ptr, cos_ptr, sin_ptr, swa_ptr, swa_slots_ptr, rows_ptr,
            state_ptr, state_slots_ptr, num_tokens, 1, eps, stride_kvt, 0, stride_ct,
            stride_st, stride_swa, stride_rows, stride_state,
            DH, HALF, BK, BLOCK_DH, BLOCK_HALF, True, True, True, True, COPY, BLOCK_COPY,
        )  # fmt: skip
    elif INDEX:
        if pid < nq + nk + ni:  # the indexer's q: RoPE only
            norm_rope_rows(
                pid - nq - nk, iq_ptr, iq_ptr, cos_ptr, sin_ptr, iq_out_ptr, iq_ptr, iq_ptr,
                iq_ptr, iq_ptr, num_tokens * HI, HI, eps, stride_iqt, stride_iqh, stride_ct,
                stride_st, 0, 0, 0,
                DI, HALF, BI, BLOCK_DI, BLOCK_HALF, False, False, True, False, 0, 16,
            )  # fmt: skip
        else:  # the indexer's head weights: float32 logits times the head scale
            i = (pid - nq - nk - ni) * BW + tl.arange(0, BW)
            ok = i < num_tokens * HI
            t = i // HI
            logit = tl.load(hl_ptr + t.to(tl.int64) * stride_hl + i % HI, mask=ok, other=0.0)
            tl.store(w_out_ptr + i, logit.to(tl.float32) * head_scale, mask=ok)


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
    """See ``reference.attention_prologue`` (``norm_q`` False: no q programs)."""
    t, h, dh = q.shape
    half = cos.shape[-1]
    if kv.shape != (t, dh) or tuple(cos.shape) != (t, half) or tuple(sin.shape) != (t, half):
        raise ValueError(
            f"attention_prologue: kv [{t}, {dh}] and cos, sin [{t}, R/2] expected, got "
            f"{tuple(kv.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if 2 * half > dh or half == 0:
        raise ValueError(f"attention_prologue: 0 < R = {2 * half} <= {dh} expected")
    swa_ok = swa.dtype == kv.dtype or is_fp8(swa)  # --kv-cache-dtype fp8: e4m3 rows
    if not swa_ok or q.dtype != kv.dtype or swa.dim() != 2 or swa.shape[1] < dh:
        raise ValueError(
            "attention_prologue: q, kv and the window cache must share a dtype (or the "
            "cache be float8_e4m3fn)"
        )
    if tuple(kv_weight.shape) != (dh,) or tuple(swa_slots.shape) != (t,):
        raise ValueError("attention_prologue: kv_weight must be [Dh] and swa_slots [T]")
    copy = 0
    if rows is not None:
        if state is None or state_slots is None or tuple(state_slots.shape) != (t,):
            raise ValueError("attention_prologue: rows need the state cache and [T] slots")
        if rows.shape[0] != t or state.shape[1] < rows.shape[1] or state.dtype != rows.dtype:
            raise ValueError("attention_prologue: rows [T, W] into a state of >= W columns")
        copy = rows.shape[1]
    index = index_q is not None
    if index and (head_logits is None or index_q.shape[0] != t or head_logits.shape[0] != t):
        raise ValueError("attention_prologue: index_q [T, Hi, Di] needs head_logits [T, Hi]")
    q_out = torch.empty(t, h, dh, dtype=q.dtype, device=q.device) if norm_q else q
    iq_out = torch.empty_like(index_q, memory_format=torch.contiguous_format) if index else None
    w_out = (
        torch.empty(t, head_logits.shape[1], dtype=torch.float32, device=q.device)
        if index
        else None
    )
    if t == 0:
        return q_out, iq_out, w_out
    unit = lambda a: a if a.stride(-1) == 1 else a.contiguous()  # noqa: E731
    q, kv, cos, sin = unit(q), unit(kv), unit(cos), unit(sin)
    block_dh = triton.next_power_of_2(dh)
    bq, warps = _block_rows(t * h, block_dh, q.device)
    bk, _ = _block_rows(t, block_dh, q.device)
    nq, nk = triton.cdiv(t * h, bq) if norm_q else 0, triton.cdiv(t, bk)
    hi = di = bi = bw = ni = nw = 1
    if index:
        assert head_logits is not None
        index_q, head_logits = unit(index_q), unit(head_logits)
        hi, di = index_q.shape[1], index_q.shape[2]
        bi, _ = _block_rows(t * hi, triton.next_power_of_2(di), q.device)
        bw = min(1024, triton.next_power_of_2(t * hi))
        ni, nw = triton.cdiv(t * hi, bi), triton.cdiv(t * hi, bw)
    dummy = kv
    _prologue_kernel[(nq + nk + (ni + nw if index else 0),)](
        q, q_out, kv, kv_weight.contiguous(), cos, sin, as_codes(swa), swa_slots.contiguous(),
        rows if rows is not None else dummy,
        state if state is not None else dummy,
        state_slots.contiguous() if state_slots is not None else swa_slots,
        index_q if index else dummy, iq_out if index else dummy,
        head_logits if index else dummy, w_out if index else dummy,
        t, nq, nk, ni, eps, head_scale,
        q.stride(0), q.stride(1), kv.stride(0), cos.stride(0), sin.stride(0), swa.stride(0),
        rows.stride(0) if rows is not None else 0,
        state.stride(0) if state is not None else 0,
        index_q.stride(0) if index else 0, index_q.stride(1) if index else 0,
        head_logits.stride(0) if index else 0,
        H=h, DH=dh, HALF=half, BQ=bq, BK=bk, BLOCK_DH=block_dh,
        BLOCK_HALF=max(1, triton.next_power_of_2(half)),
        COPY=copy, BLOCK_COPY=min(1024, triton.next_power_of_2(max(copy, 1))),
        INDEX=index, HI=hi, DI=di, BI=bi, BLOCK_DI=triton.next_power_of_2(di), BW=bw,
        num_warps=warps, **pdl(q.device),
    )  # fmt: skip
    return q_out, iq_out, w_out
