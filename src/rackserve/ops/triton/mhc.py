"""Fused mHC (hyper-connection) ops: ``hc_pre``, ``hc_post`` and ``hc_head``.

Each equals its ``ops.reference`` namesake. Shape legend: T tokens, N streams, D hidden.

    hc_pre  = K1 (split-K prenorm GEMM) + K2 (finish) -> x [T, D], post [T, N], comb [T, N, N]
    hc_head = K1 with N mixes + K2 (HEAD)              -> x [T, D]
    hc_post = one elementwise kernel                   -> streams [T, N, D]
    hc_post_pre = K1 with the expand in its prologue + K2 -> hc_post, then hc_pre of the result
                  (or, for many tokens, hc_post's kernel + K1 + K2: ``Tiling.post_apart``)

(kernels in ``mhc_kernels.py`` and ``mhc_finish_kernels.py``; with ``Tiling.fused`` and
T <= 4, K1 + K2 are one launch). Grids and workspaces depend on T and the weights' shapes
only: no host syncs, so the ops can be captured in CUDA graphs. Under TRITON_INTERPRET=1
(CPU tests) the same kernels run on CPU tensors, with larger token tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton

from rackserve.ops.reference import ExpertSlots
from rackserve.ops.triton.common import pdl
from rackserve.ops.triton.mhc_finish_kernels import hc_finish_kernel, hc_fused_kernel
from rackserve.ops.triton.mhc_kernels import (
    hc_post_kernel,
    prenorm_gemm_kernel,
    split_bf16x3_kernel,
)

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FUSED_ENV = "RACKSERVE_MHC_FUSED"  # "1": default_tiling fuses K1 + K2 for T <= 4 (GPU)
# from this many tokens hc_post_pre expands the streams in hc_post's kernel (3.9 TB/s at
# 8192 tokens) and runs K1 on them: 155 + 673 us against 1007 us fused (H200, 2026-12-02)
POST_APART_MIN_TOKENS = 1024
# the same from this many tokens when the block output is a fused MoE's unsummed slots (the
# expand sums each token's k fp32 slot rows; one launch more a decoder layer, so not at the
# decode:64 gate's 20 launches a layer). None: by POST_APART_MIN_TOKENS only. H200, session
# 17 (results/2026-12-03-h200-s17.md): hc_post_pre with k = 7 slots at 256 tokens 58.1 ->
# 41.4 us
SLOTS_APART_MIN_TOKENS: int | None = 128
# from this many tokens K2 runs as a mixes launch (``MIXES_BLOCK_T`` tokens a program) and
# a collapse launch; None: never. H200, 2026-12-02 (benchmarks/results/*-s12.md), graph
# replay: hc_pre 204 -> 154 us at 2048 tokens and 665 -> 444 at 8192, hc_post_pre 243 ->
# 193 and 814 -> 591 (32, 64 and 128 tokens a mixes program within 1%); bench forward's
# prefill:8192 56.8 / 57.1 -> 55.8 / 55.8 ms in two alternating passes
MIXES_APART_MIN_TOKENS: int | None = 2048
MIXES_BLOCK_T = 64
# from this many tokens K1 takes 128-token tiles (64 below): fn's [K, mixes] tile is loaded
# once for twice the tokens (ncu at 8192 tokens, 64-token tiles: L1/TEX 82% busy, DRAM
# 16%). H200, 2026-12-02, mhc_bench with the split K2, graph replay: hc_pre 440 -> 386 us
# and hc_post_pre 589 -> 537 at 8192 tokens, 154 -> 85 and 194 -> 126 at 2048
K1_WIDE_TILE_MIN_TOKENS = 2048
# K1's dot for bf16 streams on a GPU: "tf32x3" or "bf16x3" (half the wgmma instructions,
# no tf32 conversions of the streams' tile; fn's pieces split once per weight, ``_fn_pieces``).
# H200, 2026-12-04 (mhc_bench, graph replay, results/2026-12-04-h200-s20.md): hc_pre with
# the flat K1 at 8192 tokens 186.9 us against 526.7 (tf32x3 flat) and 385.4 (tf32x3 in
# [T, N, D] tiles, the default before); 59.8 against 109.4 / 84.4 at 2048; hc_post_pre at 64
# tokens 24.8 against 26.7, at 256 37.5 against 35.0 (both with the split launched each call)
BF16_DOT_PRECISION = "bf16x3"
SPLIT_BLOCK = 1024  # fn elements per program of the bf16x3 split


@dataclass(frozen=True)
class Tiling:
    """Launch shapes of the kernels (powers of two; see ``default_tiling``)."""

    gemm_block_t: int  # K1 tokens per program (>= 16: tl.dot's minimum)
    gemm_block_d: int  # K1 hidden columns per loop step (of all N streams: K = N * this)
    gemm_programs: int  # K1 target program count: sets the split count S
    gemm_warps: int
    # "ieee" (fp32 FMA), "tf32x3" (tensor cores, ~fp32 accuracy) or, for bf16 streams and a
    # dot K1, "bf16x3" (bf16 tensor-core dots against fn's three bf16 pieces: fp32 accuracy)
    gemm_precision: str
    finish_block_t: int  # K2 tokens per program
    finish_block_d: int  # K2 hidden chunk; >= next_pow2(D) keeps the row in registers
    finish_warps: int
    post_block_t: int
    post_block_d: int
    post_warps: int
    gemm_gemv: bool = False  # K1 with one token per program, FMA row sums (no tl.dot)
    # with gemm_gemv: K1 + K2 in one launch (``hc_fused_kernel``: the last split of a token
    # finishes it, through an int32 counter per token)
    fused: bool = False
    # hc_post_pre: expand the streams with ``hc_post``'s kernel, then K1 on the stored streams
    # (the same values: K1's fused prologue computes them in the same order), instead of in
    # K1's prologue: three launches, faster for many tokens (``default_tiling``)
    post_apart: bool = False
    # K2 as two launches from this many tokens a program (0: one launch): the mixes, a token
    # a thread, store pre [T, N]; then the collapse + RMSNorm, ``finish_block_t`` tokens a
    # program. A program of one token runs the 4 x 4 Sinkhorn chain in every thread: about
    # 0.2 of K2's 0.29 ms at 8192 tokens (sm_90 PTX, 2026-12-02)
    mixes_block_t: int = 0
    # K1 without an expand (hc_pre, hc_head, post_apart) reads the streams as [T, N*D] rows
    # in 2D tiles of N * gemm_block_d contiguous columns, its splits runs of those columns
    gemm_flat: bool = True
    # K1's dot when it expands the streams in its prologue (FUSE_POST; None: gemm_precision)
    expand_precision: str | None = None


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_tiling(
    num_tokens: int,
    num_streams: int,
    hidden: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> Tiling:
    """Launch shapes from T, N, D, the streams' dtype and the device (host ints only:
    graph-safe).

    K1's dot: "tf32x3" (three tf32 passes, about fp32 accuracy) for 16-bit streams, where
    the H200 measured it 1.3-3x faster than fp32 FMA at the same output error (hc_pre
    11.7 vs 14.9 us at T=1, 24 vs 55 us at T=256, 478 vs 1500 us at T=8192;
    benchmarks/results/2026-12-01-h200-m2.md); "ieee" for fp32 streams (the strict gates);
    for bf16 streams and a dot K1, ``BF16_DOT_PRECISION`` ("bf16x3"), except where K1
    expands the streams in its prologue (``expand_precision``: tf32x3).

    On a GPU, K1 aims at two programs per SM: few tokens -> many splits of D (at T=1 the
    1.5 MB fn read is the whole cost), many tokens -> few; T <= 4: one token per K1
    program with FMA row sums (``gemm_gemv``: a 16-row dot tile would be mostly padding,
    and the fp32 FMA dot cost 3 us more than tf32x3 at T = 1), in one launch with K2 when
    ``$RACKSERVE_MHC_FUSED`` is "1" (opt-in until measured). K2 keeps a token's N x D streams
    in registers up to 16K values and loops over D beyond. From ``K1_WIDE_TILE_MIN_TOKENS``
    K1's token tiles are 128 wide. From ``POST_APART_MIN_TOKENS``
    tokens hc_post_pre expands the streams in a launch of its own (from
    ``SLOTS_APART_MIN_TOKENS`` when the block output is a fused MoE's slots: ``hc_post_pre``
    decides that); from ``MIXES_APART_MIN_TOKENS`` K2 is two launches. K1 without the
    expand reads the streams as [T, N*D] rows (``gemm_flat``). On CPU (the Triton
    interpreter) larger token tiles keep the number of interpreted programs small.
    """
    block_n = triton.next_power_of_2(num_streams)
    d_pow2 = triton.next_power_of_2(hidden)
    mixes_apart = MIXES_APART_MIN_TOKENS is not None and num_tokens >= MIXES_APART_MIN_TOKENS
    if device.type != "cuda":
        return Tiling(
            gemm_block_t=min(64, max(16, triton.next_power_of_2(num_tokens))),
            gemm_block_d=32,
            gemm_programs=4,
            gemm_warps=4,
            gemm_precision="ieee",
            finish_block_t=16,
            finish_block_d=d_pow2,
            finish_warps=4,
            post_block_t=16,
            post_block_d=d_pow2,
            post_warps=4,
            mixes_block_t=16 if mixes_apart else 0,
        )
    gemm_block_t = 16 if num_tokens <= 16 else 32 if num_tokens <= 128 else 64
    if num_tokens >= K1_WIDE_TILE_MIN_TOKENS:
        gemm_block_t = 128
    precision = "ieee" if dtype == torch.float32 else "tf32x3"
    if dtype == torch.bfloat16 and num_tokens > 4:  # a dot K1 (T <= 4: the GEMV)
        precision = BF16_DOT_PRECISION
    finish_block_d = min(d_pow2, max(256, 16384 // block_n))
    return Tiling(
        gemm_block_t=gemm_block_t,
        gemm_block_d=max(1, (128 if gemm_block_t <= 32 else 64) // block_n),
        gemm_programs=2 * _num_sms(device),
        gemm_warps=4,
        gemm_precision=precision,
        # the expand-fused K1 keeps tf32x3 (bf16x3 measured no faster in its [T, N, D]
        # tiles: hc_pre at 2048 tokens 84.9 against 84.4 us; bench forward decode:64, which
        # takes it twice a layer with bf16x3, 4.40 against 4.31-4.33 ms; s20 calls 2, 3)
        expand_precision="tf32x3" if precision == "bf16x3" else None,
        finish_block_t=1,
        finish_block_d=finish_block_d,
        finish_warps=8 if block_n * finish_block_d >= 8192 else 4,
        post_block_t=1,
        post_block_d=min(d_pow2, 1024),
        post_warps=4,
        gemm_gemv=num_tokens <= 4,
        fused=num_tokens <= 4 and os.environ.get(FUSED_ENV, "0") == "1",
        post_apart=num_tokens >= POST_APART_MIN_TOKENS,
        mixes_block_t=MIXES_BLOCK_T if mixes_apart else 0,
    )


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, num_tokens: int) -> torch.Tensor | None:
    """The fused launch's per-token arrival counters: int32 zeros, kept per device and left
    at zero by every launch (the finishing program resets its token's). None while a CUDA
    graph is being captured and no buffer is large enough: allocating inside a capture would
    tie the buffer to the graph's pool, so that call takes the two-launch path. The ops of
    one device must run on one stream at a time (they do: the model's main stream)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < num_tokens:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(256, num_tokens), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def split_bf16x3(fn: torch.Tensor) -> torch.Tensor:
    """``ops.reference.split_bf16x3`` in one launch: fn [M, K] fp32 -> [3, M, K] bf16."""
    out = _empty((3, *fn.shape), torch.bfloat16, fn.device)
    numel = fn.numel()
    split_bf16x3_kernel[(triton.cdiv(numel, SPLIT_BLOCK),)](fn, out, numel, BLOCK=SPLIT_BLOCK)
    return out


_PIECES_ATTR = "_rackserve_bf16x3"


def _fn_pieces(fn: torch.Tensor) -> torch.Tensor:
    """fn's bf16x3 pieces, split once per weight: kept on the fn tensor itself (they live
    and die with it) and split again when fn was written in place since (its version
    counter). Not stored while a CUDA graph is captured (the graph's pool would own them):
    the capture then records the split launch, as an uncached call does. A tensor made in
    inference mode has no version counter (and cannot be written outside it): its pieces
    are split once."""
    try:
        version = fn._version
    except RuntimeError:  # an inference-mode tensor counts no versions: taken as fixed
        version = -1
    cached = getattr(fn, _PIECES_ATTR, None)
    if cached is not None and cached[0] == version:
        return cached[1]
    pieces = split_bf16x3(fn)
    if not (fn.is_cuda and torch.cuda.is_current_stream_capturing()):
        setattr(fn, _PIECES_ATTR, (version, pieces))
    return pieces


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here (tests fill them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_streams(streams: torch.Tensor) -> torch.Tensor:
    if streams.dim() != 3:
        raise ValueError(f"streams must be [T, N, D], got shape {tuple(streams.shape)}")
    if streams.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"streams dtype {streams.dtype} not in {_ACTIVATION_DTYPES}")
    return streams.contiguous()


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _param(name: str, t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 copy-if-needed of a parameter, after a shape/device check."""
    _check_shape(name, t, shape)
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, streams on {like.device}")
    return t.to(torch.float32).contiguous()


@dataclass(frozen=True)
class _BlockOut:
    """A block output as the kernels read it: rows [T, D] in the streams' dtype, or (an
    ``ExpertSlots``) fp32 slot rows [T * k, D] with their expert ids, summed on load."""

    rows: torch.Tensor
    ids: torch.Tensor  # [T * k] (a placeholder for plain rows)
    top_k: int  # 0: plain rows
    num_experts: int


def _post_inputs(
    streams: torch.Tensor,
    block_out: torch.Tensor | ExpertSlots,
    post: torch.Tensor,
    comb: torch.Tensor,
) -> tuple[_BlockOut, torch.Tensor, torch.Tensor]:
    """Checked block_out [T, D] (the streams' dtype) or its unsummed slots, post [T, N],
    comb [T, N, N] (fp32). Shapes and dtypes first, devices last: a call gets the same
    message on every device."""
    num_tokens, n, hidden = streams.shape
    if isinstance(block_out, ExpertSlots):
        k = block_out.ids.shape[1] if block_out.ids.dim() == 2 else -1
        slots = block_out.slots
        ok = block_out.ids.shape[0] == num_tokens and block_out.dtype == streams.dtype
        if not ok or tuple(slots.shape) != (num_tokens * k, hidden) or slots.dtype != torch.float32:
            raise ValueError(
                f"block_out slots must be [{num_tokens} * k, {hidden}] float32 with ids "
                f"[{num_tokens}, k] summing to {streams.dtype}, got {tuple(slots.shape)} "
                f"{slots.dtype}, ids {tuple(block_out.ids.shape)}, {block_out.dtype}"
            )
        rows = _BlockOut(
            slots.contiguous(), block_out.ids.contiguous().view(-1), k, block_out.num_experts
        )
    elif tuple(block_out.shape) != (num_tokens, hidden) or block_out.dtype != streams.dtype:
        raise ValueError(
            f"block_out must be [{num_tokens}, {hidden}] {streams.dtype}, "
            f"got {tuple(block_out.shape)} {block_out.dtype}"
        )
    else:
        rows = _BlockOut(block_out.contiguous(), block_out, 0, 0)
    _check_shape("post", post, (num_tokens, n))
    _check_shape("comb", comb, (num_tokens, n, n))
    if rows.rows.device != streams.device or rows.ids.device != streams.device:
        raise ValueError(f"block_out is on {rows.rows.device}, streams on {streams.device}")
    post = _param("post", post, (num_tokens, n), streams)
    comb = _param("comb", comb, (num_tokens, n, n), streams)
    return rows, post, comb


def _block_params(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    sinkhorn_iters: int,
    head: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked fn [M, N*D], base [M], scale [3] ([1] for the head), norm_weight [D]."""
    _, n, hidden = streams.shape
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    mixes = n if head else (2 + n) * n
    shapes = {
        "fn": (fn, (mixes, n * hidden)),
        "base": (base, (mixes,)),
        "scale": (scale, (1 if head else 3,)),
        "norm_weight": (norm_weight, (hidden,)),
    }
    for name, (t, shape) in shapes.items():  # every shape before any device
        _check_shape(name, t, shape)
    fn, base, scale, norm_weight = (_param(k, t, sh, streams) for k, (t, sh) in shapes.items())
    return fn, base, scale, norm_weight


def _launch(
    streams: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    head: bool,
    expand: tuple[_BlockOut, torch.Tensor, torch.Tensor] | None,
    tiling: Tiling | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """K1 + K2 on checked inputs -> (streams K2 read, x, post, comb); post/comb None for head.

    expand: (block_out, post, comb) of the previous block: K1 first expands the streams
    (``hc_post``), writes them and runs on them; with ``tiling.post_apart`` hc_post's own
    kernel expands them first.
    """
    num_tokens, n, hidden = streams.shape
    fn, base, scale, norm_weight = params
    device = streams.device
    tiling = tiling or default_tiling(num_tokens, n, hidden, device, streams.dtype)
    if expand is not None and tiling.post_apart and not (tiling.fused and tiling.gemm_gemv):
        streams, expand = _expand(streams, *expand, tiling), None
    new = streams if expand is None else _empty(streams.shape, streams.dtype, device)
    x = _empty((num_tokens, hidden), streams.dtype, device)
    post = None if head else _empty((num_tokens, n), torch.float32, device)
    comb = None if head else _empty((num_tokens, n, n), torch.float32, device)
    if num_tokens == 0:
        return new, x, post, comb
    block_n = triton.next_power_of_2(n)
    block_m = max(16, triton.next_power_of_2(fn.shape[0]))
    block_d = min(tiling.gemm_block_d, triton.next_power_of_2(hidden))
    gemm_block_t = 1 if tiling.gemm_gemv else tiling.gemm_block_t
    t_blocks = triton.cdiv(num_tokens, gemm_block_t)
    # K1's splits: runs of hidden columns (of all N streams), or with a flat K1 runs of the
    # [T, N*D] rows' columns, block_n * block_d of them a step
    flat = expand is None and tiling.gemm_flat and not (tiling.fused and tiling.gemm_gemv)
    cols, step = (n * hidden, block_n * block_d) if flat else (hidden, block_d)
    col_blocks = triton.cdiv(cols, step)
    splits = max(1, min(col_blocks, triton.cdiv(tiling.gemm_programs, t_blocks)))
    d_per_split = triton.cdiv(col_blocks, splits) * step
    splits = triton.cdiv(cols, d_per_split)  # no split without columns
    mix = _empty((splits, num_tokens, block_m), torch.float32, device)
    sq = _empty((splits, num_tokens), torch.float32, device)
    bo, prev_post, prev_comb = expand if expand is not None else (_BlockOut(x, x, 0, 0), x, x)
    block_out, slot_args = bo.rows, (bo.ids, max(1, bo.top_k), bo.num_experts)
    finish_block_d = min(tiling.finish_block_d, triton.next_power_of_2(hidden))
    block_s = min(128, triton.next_power_of_2(splits))
    counters = _counters(device, num_tokens) if tiling.fused and tiling.gemm_gemv else None
    if counters is not None:  # one launch: the last split of a token runs K2 for it
        hc_fused_kernel[(num_tokens, splits)](
            streams, fn, mix, sq, block_out, prev_post, prev_comb, new,
            base, scale, norm_weight, x, x if head else post, x if head else comb, counters,
            num_tokens, hidden, fn.shape[0], d_per_split,
            1.0 / (n * hidden), hc_eps, norm_eps, sinkhorn_iters,
            streams.stride(0), streams.stride(1), fn.stride(0),
            mix.stride(0), mix.stride(1), sq.stride(0), block_out.stride(0), *slot_args,
            new.stride(0), new.stride(1), x.stride(0),
            N=n, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_D=block_d,
            FINISH_BLOCK_D=finish_block_d, BLOCK_S=block_s, FUSE_POST=expand is not None,
            SLOTS=bo.top_k > 0,
            HEAD=head, SINGLE_PASS=finish_block_d >= hidden,
            num_warps=max(tiling.gemm_warps, tiling.finish_warps), **pdl(streams.device),
        )  # fmt: skip
        return new, x, post, comb
    w = fn
    precision = tiling.gemm_precision
    if expand is not None and tiling.expand_precision is not None:
        precision = tiling.expand_precision
    if precision == "bf16x3":
        if streams.dtype != torch.bfloat16 or tiling.gemm_gemv:
            raise ValueError(
                f"gemm_precision 'bf16x3' needs bf16 streams and gemm_gemv=False, got "
                f"{streams.dtype} streams, gemm_gemv={tiling.gemm_gemv}"
            )
        w = _fn_pieces(fn)
    prenorm_gemm_kernel[(t_blocks, splits)](
        streams, w, mix, sq, block_out, prev_post, prev_comb, new,
        num_tokens, hidden, fn.shape[0], d_per_split,
        streams.stride(0), streams.stride(1), fn.stride(0),
        mix.stride(0), mix.stride(1), sq.stride(0), block_out.stride(0), *slot_args,
        N=n, BLOCK_N=block_n, BLOCK_T=gemm_block_t, BLOCK_M=block_m, BLOCK_D=block_d,
        FUSE_POST=expand is not None, SLOTS=bo.top_k > 0, PRECISION=precision,
        GEMV=tiling.gemm_gemv, NATIVE_BF16=device.type == "cuda", FLAT=flat,
        num_warps=tiling.gemm_warps, **pdl(streams.device),
    )  # fmt: skip

    def finish(pre: torch.Tensor, block_t: int, warps: int, mixes: bool, collapse: bool):
        """One K2 launch: the mixes, the collapse or both; pre [T, BLOCK_N] carries pre
        from a mixes-only launch to a collapse-only one."""
        hc_finish_kernel[(triton.cdiv(num_tokens, block_t),)](
            new, mix, sq, base, scale, norm_weight,
            x, x if head else post, x if head else comb, pre,
            num_tokens, splits, hidden, 1.0 / (n * hidden), hc_eps, norm_eps, sinkhorn_iters,
            new.stride(0), new.stride(1), mix.stride(0), mix.stride(1), sq.stride(0),
            x.stride(0),
            N=n, BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_D=finish_block_d,
            HEAD=head, SINGLE_PASS=finish_block_d >= hidden, MIXES=mixes, COLLAPSE=collapse,
            num_warps=warps, **pdl(new.device),
        )  # fmt: skip

    if tiling.mixes_block_t:  # a token a thread for the mixes, then the collapse
        pre = _empty((num_tokens, block_n), torch.float32, device)
        finish(pre, tiling.mixes_block_t, max(1, min(4, tiling.mixes_block_t // 32)), True, False)
        finish(pre, tiling.finish_block_t, tiling.finish_warps, False, True)
    else:
        finish(x, tiling.finish_block_t, tiling.finish_warps, True, True)
    return new, x, post, comb


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    tiling: Tiling | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``ops.reference.hc_pre``: two launches.

    streams: [T, N, D] (fp32/bf16/fp16); fn: [(2+N)N, N*D]; base: [(2+N)N]; scale: [3];
    norm_weight: [D]. Returns x [T, D] in the streams' dtype, post [T, N] and comb [T, N, N]
    in float32.
    """
    streams = _check_streams(streams)
    params = _block_params(streams, fn, base, scale, norm_weight, sinkhorn_iters, False)
    _, x, post, comb = _launch(
        streams, params, sinkhorn_iters, hc_eps, norm_eps, False, None, tiling
    )
    assert post is not None and comb is not None
    return x, post, comb


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
    *,
    tiling: Tiling | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``ops.reference.hc_post_pre``: two launches instead of three.

    streams, block_out, post, comb: as ``hc_post`` (the block just run); fn, base, scale,
    norm_weight: the next block's, as ``hc_pre``. Returns the new streams [T, N, D] and the
    next block's x [T, D], post [T, N], comb [T, N, N].
    """
    streams = _check_streams(streams)
    expand = _post_inputs(streams, block_out, post, comb)
    params = _block_params(streams, fn, base, scale, norm_weight, sinkhorn_iters, False)
    num_tokens, n, hidden = streams.shape
    slots_apart = SLOTS_APART_MIN_TOKENS is not None and num_tokens >= SLOTS_APART_MIN_TOKENS
    if tiling is None and expand[0].top_k > 0 and slots_apart:
        tiling = default_tiling(num_tokens, n, hidden, streams.device, streams.dtype)
        tiling = dataclasses.replace(tiling, post_apart=True)
    new, x, post, comb = _launch(
        streams, params, sinkhorn_iters, hc_eps, norm_eps, False, expand, tiling
    )
    assert post is not None and comb is not None
    return new, x, post, comb


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    norm_weight: torch.Tensor,
    *,
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """Fused ``ops.reference.hc_head``: two launches.

    streams: [T, N, D]; fn: [N, N*D]; base: [N]; scale: [1]; norm_weight: [D].
    Returns [T, D] in the streams' dtype.
    """
    streams = _check_streams(streams)
    params = _block_params(streams, fn, base, scale, norm_weight, 1, True)
    return _launch(streams, params, 1, hc_eps, norm_eps, True, None, tiling)[1]


def hc_post(
    streams: torch.Tensor,
    block_out: torch.Tensor | ExpertSlots,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """Fused ``ops.reference.hc_post``: one launch.

    streams: [T, N, D]; block_out: [T, D] (the streams' dtype); post: [T, N]; comb: [T, N, N]
    (comb[j, k] weighs input stream j into output stream k). Returns [T, N, D].
    """
    streams = _check_streams(streams)
    num_tokens, n, hidden = streams.shape
    tiling = tiling or default_tiling(num_tokens, n, hidden, streams.device, streams.dtype)
    return _expand(streams, *_post_inputs(streams, block_out, post, comb), tiling)


def _expand(
    streams: torch.Tensor, bo: _BlockOut, post: torch.Tensor, comb: torch.Tensor, tiling: Tiling
) -> torch.Tensor:
    """``hc_post``'s kernel on checked inputs -> the new streams [T, N, D]."""
    num_tokens, n, hidden = streams.shape
    out = _empty((num_tokens, n, hidden), streams.dtype, streams.device)
    if num_tokens == 0:
        return out
    block_d = min(tiling.post_block_d, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_tokens, tiling.post_block_t), triton.cdiv(hidden, block_d))
    hc_post_kernel[grid](
        streams, bo.rows, post, comb, out, num_tokens, hidden,
        streams.stride(0), streams.stride(1), bo.rows.stride(0), post.stride(0), comb.stride(0),
        bo.ids, max(1, bo.top_k), bo.num_experts,
        N=n, BLOCK_N=triton.next_power_of_2(n), BLOCK_T=tiling.post_block_t, BLOCK_D=block_d,
        SLOTS=bo.top_k > 0, num_warps=tiling.post_warps, **pdl(streams.device),
    )  # fmt: skip
    return out
