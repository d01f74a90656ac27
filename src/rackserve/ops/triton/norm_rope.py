"""RMSNorm and interleaved RoPE in one Triton kernel: ``rms_norm``, ``apply_rope`` and the
fused ``rms_norm_rope`` (the q and kv paths of attention), one launch each; and the step's
RoPE tables (``rope_cos_sin``).

Each equals its ``ops.reference`` namesake, roundings included: the norm rounds to x's
dtype (the unweighted norm also rounds the rsqrt factor first, as the reference's
``x * rsqrt(..).to(x.dtype)`` does), and the rotation runs in fp32 on the rounded value and
rounds once. Shape legend: T tokens, M rows per token (heads; 1 for [T, C]), C channels,
R rope channels (the trailing 2 * cos.shape[-1]).

Grid: cdiv(T * M, BLOCK_ROWS); a program holds BLOCK_ROWS full rows::

    channels  0 ............... C - R ............ C
              |- nope: normed / copied -|- rope: pairs (2i, 2i+1) rotated -|

The rope slice is reloaded (an L1 hit) as [rows, R/2, 2] and split into even / odd, so no
register shuffles are needed. Launch shapes depend on the shapes only: CUDA-graph safe.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rackserve.ops.triton.common import pdl, pdl_wait, round_as
from rackserve.ops.triton.fp8 import as_codes, is_fp8, to_cache

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_CHANNELS = 16384  # one row in registers


@triton.jit
def norm_rope_rows(
    pid,  # the program's block of rows
    x_ptr,  # [T, M, C] with unit channel stride
    w_ptr,  # [C] norm weight (unused unless WEIGHTED)
    cos_ptr,  # [T, R/2] (unused unless ROPE)
    sin_ptr,
    out_ptr,  # [T, M, C] contiguous, x's dtype (SCATTER: cache rows [N, >= C] by slot, x's
    # dtype or an e4m3 cache as uint8 codes)
    out_slots_ptr,  # [T] SCATTER only: the cache row of each token (M = 1)
    copy_src_ptr,  # [T, COPY] COPY only: rows copied to copy_dst[copy_slots[t]]
    copy_dst_ptr,
    copy_slots_ptr,
    num_rows,  # T * M
    rows_per_token,  # M
    eps,
    stride_xt,
    stride_xm,
    stride_ct,
    stride_st,
    stride_out,  # SCATTER only: the cache's row stride
    stride_copy_src,
    stride_copy_dst,
    CHANNELS: tl.constexpr,  # C; constexpr so channel masks allow 16-byte vectors
    HALF: tl.constexpr,  # R/2
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ROPE: tl.constexpr,
    SCATTER: tl.constexpr = False,
    COPY: tl.constexpr = 0,  # columns of the copied rows (0: no copy)
    BLOCK_COPY: tl.constexpr = 16,
):
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    token = rows // rows_per_token
    x_row = x_ptr + token.to(tl.int64) * stride_xt + (rows % rows_per_token) * stride_xm
    if SCATTER:  # straight into the cache: the row's slot
        slot = tl.load(out_slots_ptr + rows, mask=row_ok, other=0)
        out_row = out_ptr + slot.to(tl.int64) * stride_out
    else:
        out_row = out_ptr + rows.to(tl.int64) * CHANNELS
    if COPY:  # the compressor's raw rows into the state cache, same tokens
        dst = tl.load(copy_slots_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        src_row = copy_src_ptr + rows.to(tl.int64) * stride_copy_src
        dst_row = copy_dst_ptr + dst * stride_copy_dst
        for c0 in range(0, COPY, BLOCK_COPY):
            c = c0 + tl.arange(0, BLOCK_COPY)
            m = row_ok[:, None] & (c < COPY)[None, :]
            v = tl.load(src_row[:, None] + c[None, :], mask=m, other=0.0)
            tl.store(dst_row[:, None] + c[None, :], v, mask=m)
    nope = CHANNELS - 2 * HALF if ROPE else CHANNELS
    cols = tl.arange(0, BLOCK_C)
    # the norm needs every channel; a plain rope only copies the nope ones
    load_cols = CHANNELS if NORM else nope
    x = tl.load(
        x_row[:, None] + cols[None, :],
        mask=row_ok[:, None] & (cols < load_cols)[None, :],
        other=0.0,
    ).to(tl.float32)
    factor = tl.full((BLOCK_ROWS,), 1.0, tl.float32)
    if NORM:
        mean_sq = tl.sum(x * x, axis=1) / CHANNELS
        factor = 1.0 / tl.sqrt_rn(mean_sq + eps)
        if not WEIGHTED:  # the reference rounds the factor to x's dtype first
            factor = round_as(factor, x_ptr.dtype.element_ty)
        y = x * factor[:, None]
        if WEIGHTED:  # weight * (x * factor): the reference's order
            w = tl.load(w_ptr + cols, mask=cols < CHANNELS, other=0.0).to(tl.float32)
            y = w[None, :] * y
    else:
        y = x
    tl.store(
        out_row[:, None] + cols[None, :],
        to_cache(y, out_ptr, x_ptr.dtype.element_ty),  # fp8 caches: e4m3 codes
        mask=row_ok[:, None] & (cols < nope)[None, :],
    )
    if ROPE:
        pair = tl.arange(0, BLOCK_HALF)
        lane = tl.arange(0, 2)
        pair_ok = pair < HALF
        offs = nope + 2 * pair[None, :, None] + lane[None, None, :]  # [1, BLOCK_HALF, 2]
        mask = row_ok[:, None, None] & pair_ok[None, :, None] & (lane < 2)[None, None, :]
        xr = tl.load(x_row[:, None, None] + offs, mask=mask, other=0.0).to(tl.float32)
        if NORM:  # the normed value, rounded as the reference's rms_norm output
            w_offs = nope + 2 * pair[:, None] + lane[None, :]  # [BLOCK_HALF, 2]
            w_mask = pair_ok[:, None] & (lane < 2)[None, :]
            xr = xr * factor[:, None, None]
            if WEIGHTED:
                wr = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32)
                xr = wr[None, :, :] * xr
            xr = round_as(xr, x_ptr.dtype.element_ty)
        even, odd = tl.split(xr)  # [BLOCK_ROWS, BLOCK_HALF] each
        trig_off = token[:, None].to(tl.int64)
        trig_mask = row_ok[:, None] & pair_ok[None, :]
        cos = tl.load(cos_ptr + trig_off * stride_ct + pair[None, :], mask=trig_mask, other=0.0)
        sin = tl.load(sin_ptr + trig_off * stride_st + pair[None, :], mask=trig_mask, other=0.0)
        cos = cos.to(tl.float32)
        sin = sin.to(tl.float32)
        rotated = tl.join(even * cos - odd * sin, odd * cos + even * sin)
        tl.store(out_row[:, None, None] + offs, to_cache(rotated, out_ptr, x_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


@triton.jit
def norm_rope_kernel(
    x_ptr,  # [T, M, C] with unit channel stride
    w_ptr,  # [C] norm weight (unused unless WEIGHTED)
    cos_ptr,  # [T, R/2] (unused unless ROPE)
    sin_ptr,
    out_ptr,  # [T, M, C] contiguous, x's dtype (SCATTER: cache rows [N, >= C], by slot)
    out_slots_ptr,  # [T] SCATTER only: the cache row of each token (M = 1)
    copy_src_ptr,  # [T, COPY] COPY only: rows copied to copy_dst[copy_slots[t]]
    copy_dst_ptr,
    copy_slots_ptr,
    num_rows,  # T * M
    rows_per_token,  # M
    eps,
    stride_xt,
    stride_xm,
    stride_ct,
    stride_st,
    stride_out,  # SCATTER only: the cache's row stride
    stride_copy_src,
    stride_copy_dst,
    CHANNELS: tl.constexpr,  # C; constexpr so channel masks allow 16-byte vectors
    HALF: tl.constexpr,  # R/2
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ROPE: tl.constexpr,
    SCATTER: tl.constexpr = False,
    COPY: tl.constexpr = 0,  # columns of the copied rows (0: no copy)
    BLOCK_COPY: tl.constexpr = 16,
    PDL: tl.constexpr = False,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    norm_rope_rows(
        tl.program_id(0),
        x_ptr,
        w_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        out_slots_ptr,
        copy_src_ptr,
        copy_dst_ptr,
        copy_slots_ptr,
        num_rows,
        rows_per_token,
        eps,
        stride_xt,
        stride_xm,
        stride_ct,
        stride_st,
        stride_out,
        stride_copy_src,
        stride_copy_dst,
        CHANNELS,
        HALF,
        BLOCK_ROWS,
        BLOCK_C,
        BLOCK_HALF,
        NORM,
        WEIGHTED,
        ROPE,
        SCATTER,
        COPY,
        BLOCK_COPY,
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_rows(num_rows: int, block_c: int, device: torch.device) -> tuple[int, int]:
    """(rows per program, warps): ~4K-element tiles, but >= 2 programs per SM when the
    rows allow (T=1 decode: 64 heads of 512 spread over 32 programs, not 8). The
    interpreter gets big tiles (fewer interpreted programs)."""
    if device.type != "cuda":
        return max(1, min(triton.next_power_of_2(num_rows), 16384 // block_c)), 4
    most = max(1, 4096 // block_c)
    spread = max(1, num_rows // (2 * _num_sms(device)))
    rows = min(most, 1 << (spread.bit_length() - 1))
    return rows, 4 if rows * block_c <= 4096 else 8


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output comes from here (tests fill them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    norm: bool,
) -> torch.Tensor:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype {x.dtype} not in {_DTYPES}")
    if x.dim() == 0:
        raise ValueError("x must have a channel dim")
    channels = x.shape[-1]
    if channels > _MAX_CHANNELS:
        raise ValueError(f"C={channels} > {_MAX_CHANNELS}: rows must fit one program")
    rope = cos is not None
    half = 0
    if rope:
        assert sin is not None
        if x.dim() < 2:
            raise ValueError(f"x must be [T, ..., C] for the rope, got shape {tuple(x.shape)}")
        half = cos.shape[-1]
        want = (x.shape[0], half)
        if tuple(cos.shape) != want or tuple(sin.shape) != want or 2 * half > channels:
            raise ValueError(
                f"cos, sin must be [T, R/2] = {want} with R <= C={channels}, "
                f"got {tuple(cos.shape)}, {tuple(sin.shape)}"
            )
        if cos.device != x.device or sin.device != x.device:
            raise ValueError(f"cos / sin on {cos.device} / {sin.device}, x on {x.device}")
        cos = cos if cos.stride(-1) == 1 else cos.contiguous()
        sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if weight is not None:
        if tuple(weight.shape) != (channels,) or weight.device != x.device:
            raise ValueError(
                f"weight must be [{channels}] on {x.device}, got {tuple(weight.shape)} "
                f"on {weight.device}"
            )
        weight = weight.contiguous()
    out = _new_output(tuple(x.shape), x.dtype, x.device)
    if x.numel() == 0:
        return out
    tokens = x.shape[0] if x.dim() >= 2 else 1
    x3 = x.reshape(tokens, -1, channels)  # a view when the strides allow
    if x3.stride(2) != 1:
        x3 = x3.contiguous()
    num_rows = x3.shape[0] * x3.shape[1]
    block_c = triton.next_power_of_2(channels)
    block_rows, warps = _block_rows(num_rows, block_c, x.device)
    norm_rope_kernel[(triton.cdiv(num_rows, block_rows),)](
        x3,
        weight if weight is not None else x3,
        cos if rope else x3,
        sin if rope else x3,
        out,
        x3,
        x3,
        x3,
        x3,
        num_rows,
        x3.shape[1],
        eps,
        x3.stride(0),
        x3.stride(1),
        cos.stride(0) if rope else 0,
        sin.stride(0) if rope else 0,
        0,
        0,
        0,
        CHANNELS=channels,
        HALF=half,
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_c,
        BLOCK_HALF=max(1, triton.next_power_of_2(half)),
        NORM=norm,
        WEIGHTED=weight is not None,
        ROPE=rope,
        num_warps=warps,
        **pdl(x3.device),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``ops.reference.rms_norm``: x [..., C]; weight [C] (float32) or None. One launch."""
    return _launch(x, weight, eps, None, None, norm=True)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``ops.reference.apply_rope``: x [T, ..., C]; cos, sin [T, R/2]. One launch."""
    return _launch(x, None, 0.0, cos, sin, norm=False)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """``ops.reference.rms_norm_rope`` (apply_rope(rms_norm(x, weight, eps), cos, sin)):
    x [T, ..., C]; weight [C] float32 or None; cos, sin [T, R/2]. One launch."""
    return _launch(x, weight, eps, cos, sin, norm=True)


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
    """``reference.kv_insert`` in one launch: the kv row normed and roped straight into
    its window slot, and the compressor's raw rows copied into their state slots."""
    t, channels = kv.shape
    half = cos.shape[-1]
    if (swa.dtype != kv.dtype and not is_fp8(swa)) or (
        rows is not None and (state is None or state.dtype != rows.dtype)
    ):
        raise ValueError(
            "kv_insert: the caches must have the dtype of the rows written (swa: or e4m3)"
        )
    if swa.dim() != 2 or swa.shape[1] < channels or swa.stride(1) != 1:
        raise ValueError(f"kv_insert: swa must be [N, >= {channels}] rows, got {swa.shape}")
    if tuple(cos.shape) != (t, half) or tuple(sin.shape) != (t, half) or 2 * half > channels:
        raise ValueError(f"kv_insert: cos, sin must be [{t}, R/2], got {tuple(cos.shape)}")
    if tuple(weight.shape) != (channels,) or tuple(swa_slots.shape) != (t,):
        raise ValueError("kv_insert: weight must be [C] and swa_slots [T]")
    copy = 0
    if rows is not None:
        assert state is not None and state_slots is not None
        if rows.dim() != 2 or rows.shape[0] != t or rows.stride(1) != 1:
            raise ValueError(f"kv_insert: rows must be [{t}, W] with unit column stride")
        if state.dim() != 2 or state.shape[1] < rows.shape[1] or state.stride(1) != 1:
            raise ValueError(f"kv_insert: state must be [N, >= {rows.shape[1]}] rows")
        if tuple(state_slots.shape) != (t,):
            raise ValueError(f"kv_insert: state_slots must be [{t}]")
        copy = rows.shape[1]
    if t == 0:
        return
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block_c = triton.next_power_of_2(channels)
    block_rows, warps = _block_rows(t, block_c, kv.device)
    swa_slots = swa_slots.contiguous()
    norm_rope_kernel[(triton.cdiv(t, block_rows),)](
        kv,
        weight.contiguous(),
        cos,
        sin,
        as_codes(swa),  # fp8: the codes of the reference's cast
        swa_slots,
        rows if rows is not None else kv,
        state if state is not None else kv,
        state_slots.contiguous() if state_slots is not None else swa_slots,
        t,
        1,
        eps,
        kv.stride(0),
        0,
        cos.stride(0),
        sin.stride(0),
        swa.stride(0),
        rows.stride(0) if rows is not None else 0,
        state.stride(0) if state is not None else 0,
        CHANNELS=channels,
        HALF=half,
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_c,
        BLOCK_HALF=max(1, triton.next_power_of_2(half)),
        NORM=True,
        WEIGHTED=True,
        ROPE=half > 0,
        SCATTER=True,
        COPY=copy,
        BLOCK_COPY=min(1024, triton.next_power_of_2(max(copy, 1))),
        num_warps=warps,
        **pdl(kv.device),
    )


@triton.jit
def rope_table_kernel(
    pos_ptr,  # [T] int
    inv_freq_ptr,  # [R/2] fp32
    cos_ptr,  # [T, R/2] out
    sin_ptr,  # [T, R/2] out
    num_tokens,
    scale,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # libdevice's cosf / sinf (a GPU; the interpreter has tl.cos)
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_HALF)
    t_ok, h_ok = t < num_tokens, h < HALF
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.float32)
    angle = pos[:, None] * tl.load(inv_freq_ptr + h, mask=h_ok, other=0.0)[None, :]
    if LIBDEVICE:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    offs = t[:, None] * HALF + h[None, :]
    ok = t_ok[:, None] & h_ok[None, :]
    tl.store(cos_ptr + offs, (cos * scale).to(cos_ptr.dtype.element_ty), mask=ok)
    tl.store(sin_ptr + offs, (sin * scale).to(sin_ptr.dtype.element_ty), mask=ok)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.rope_cos_sin`` in one launch (the reference takes eight): positions [T]
    -> cos, sin [T, R/2] in ``dtype``, scaled by ``scale``."""
    half = inv_freq.shape[0]
    num_tokens = positions.shape[0]
    cos = _new_output((num_tokens, half), dtype, positions.device)
    sin = _new_output((num_tokens, half), dtype, positions.device)
    if num_tokens == 0:
        return cos, sin
    block_half = triton.next_power_of_2(half)
    block_t = max(1, min(64, 2048 // block_half, triton.next_power_of_2(num_tokens)))
    rope_table_kernel[(triton.cdiv(num_tokens, block_t),)](
        positions.contiguous(), inv_freq.to(device=positions.device, dtype=torch.float32),
        cos, sin, num_tokens, float(scale),
        HALF=half, BLOCK_T=block_t, BLOCK_HALF=block_half,
        LIBDEVICE=positions.device.type == "cuda", **pdl(positions.device),
    )  # fmt: skip
    return cos, sin
