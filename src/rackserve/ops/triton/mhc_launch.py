"""Launches of the fused mHC kernels on checked inputs (``mhc.py``'s ops call them).

``Tiling`` (the launch shapes; ``mhc.default_tiling`` picks them), ``_launch`` (K1 + K2,
K1's prologue optionally expanding the previous block's streams, or with ``Tiling.fused``
K1 + K2 in one launch), ``_expand`` (``hc_post``'s kernel), the one launch's per-token
counters and fn's bf16x3 pieces, split once per weight. Shape legend as ``mhc.py``: T
tokens, N streams, D hidden. The tiling always comes from the caller: ``mhc.py`` resolves
``tiling=None`` through its own ``default_tiling``, so the switches set on that module at run
time (its constants, an overridden ``default_tiling``) apply.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton

from rackserve.ops.side_stream import SideStream
from rackserve.ops.triton.common import arrival_counters, pdl
from rackserve.ops.triton.mhc_finish_kernels import hc_finish_kernel, hc_fused_kernel
from rackserve.ops.triton.mhc_kernels import (
    hc_post_kernel,
    prenorm_gemm_kernel,
    split_bf16x3_kernel,
)

SPLIT_BLOCK = 1024  # fn elements per program of the bf16x3 split


@dataclass(frozen=True)
class Tiling:
    """Launch shapes of the kernels (powers of two; see ``mhc.default_tiling``)."""

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
    # K1's prologue: three launches, faster for many tokens (``mhc.default_tiling``)
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
    # a block's K2 (one launch, not mixes_block_t or fused) as two: pre and the collapse,
    # then post and comb (the Sinkhorn chain: the next block's mHC reads them, nothing
    # before it), which a CUDA-graph capture puts on the side stream (``_comb_beside``)
    comb_beside: bool = False
    # K1's expand (FUSE_POST) a stream at a time in [T, D] tiles, a dot of K = gemm_block_d
    # each, instead of [T, N, D] tiles and one dot of K = N * gemm_block_d (session 45: an
    # A/B at hc_post_pre's prefill and decode:64 sizes)
    expand_per_stream: bool = False
    # K1's software-pipelining stages (None: Triton's default, 3). One stage keeps its
    # shared memory to the dots' operands (a few KB: several programs an SM, the memory
    # latency hidden by occupancy instead)
    gemm_stages: int | None = None


@dataclass(frozen=True)
class _BlockOut:
    """A block output as the kernels read it: rows [T, D] in the streams' dtype, or (an
    ``ExpertSlots``) fp32 slot rows [T * k, D] with their expert ids, summed on load."""

    rows: torch.Tensor
    ids: torch.Tensor  # [T * k] (a placeholder for plain rows)
    top_k: int  # 0: plain rows
    num_experts: int


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here (tests fill them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


# devices whose side stream holds a captured launch of post and comb that the main stream
# has not joined yet (``settle``)
_BESIDE_PENDING: set[torch.device] = set()


def settle(device: torch.device) -> None:
    """Join the side stream where post and comb of a captured launch are still on it: the
    mHC ops that read post and comb (and ``hc_head``, which ends a forward) call this
    first; any other reader of a captured step's post or comb must too."""
    if device in _BESIDE_PENDING:
        _BESIDE_PENDING.discard(device)
        SideStream.of(device).join()


def _comb_beside(device: torch.device, workspaces: tuple[torch.Tensor, ...]) -> SideStream | None:
    """The side stream for a block's post and comb launch while a CUDA graph is captured
    (forked here; ``settle`` joins it), else None (eager: the launch follows on the main
    stream, the same kernels, so replay equals eager bitwise). The workspaces it reads are
    recorded on it: the allocator keeps blocks freed with another stream's uses out of the
    capture's reuse."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return None
    side = SideStream.of(device)
    side.fork()
    for w in workspaces:
        w.record_stream(side.stream)
    _BESIDE_PENDING.add(device)
    return side


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


def _launch(
    streams: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    head: bool,
    expand: tuple[_BlockOut, torch.Tensor, torch.Tensor] | None,
    tiling: Tiling,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """K1 + K2 on checked inputs -> (streams K2 read, x, post, comb); post/comb None for head.

    expand: (block_out, post, comb) of the previous block: K1 first expands the streams
    (``hc_post``), writes them and runs on them; with ``tiling.post_apart`` hc_post's own
    kernel expands them first. tiling: the caller's (``mhc.py`` resolves ``tiling=None`` through
    its ``default_tiling`` before this launch).
    """
    num_tokens, n, hidden = streams.shape
    fn, base, scale, norm_weight = params
    device = streams.device
    if expand is not None or head:  # reads a previous block's post and comb / ends a step
        settle(device)
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

    def finish(
        pre: torch.Tensor,
        block_t: int,
        warps: int,
        mixes: bool,
        collapse: bool,
        pre_only: bool = head,
        comb_only: bool = False,
    ):
        """One K2 launch: the mixes, the collapse or both; pre [T, BLOCK_N] carries pre
        from a mixes-only launch to a collapse-only one. pre_only: the mixes as the head's
        (no post, comb); comb_only: post and comb alone (``comb_beside``)."""
        hc_finish_kernel[(triton.cdiv(num_tokens, block_t),)](
            new, mix, sq, base, scale, norm_weight,
            x, x if head else post, x if head else comb, pre,
            num_tokens, splits, hidden, 1.0 / (n * hidden), hc_eps, norm_eps, sinkhorn_iters,
            new.stride(0), new.stride(1), mix.stride(0), mix.stride(1), sq.stride(0),
            x.stride(0),
            N=n, BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_D=finish_block_d,
            HEAD=pre_only, SINGLE_PASS=finish_block_d >= hidden, MIXES=mixes,
            COLLAPSE=collapse, COMB_ONLY=comb_only, num_warps=warps, **pdl(new.device),
        )  # fmt: skip

    def comb_beside() -> None:
        """A block's post and comb (mixes, softmax, Sinkhorn) in a launch of their own, on the
        side stream while a graph is captured, after a K2 that computed pre and x only."""
        side = _comb_beside(device, (mix, sq))
        with contextlib.nullcontext() if side is None else side.active():
            finish(x, tiling.finish_block_t, tiling.finish_warps, True, False, comb_only=True)

    fused = tiling.fused and tiling.gemm_gemv
    counters = arrival_counters("mhc", device, num_tokens) if fused else None
    if counters is not None:  # one launch: the last split of a token runs K2 for it
        pre_only = head or tiling.comb_beside  # comb_beside: then post + comb beside
        hc_fused_kernel[(num_tokens, splits)](
            streams, fn, mix, sq, block_out, prev_post, prev_comb, new,
            base, scale, norm_weight, x, x if pre_only else post, x if pre_only else comb,
            counters,
            num_tokens, hidden, fn.shape[0], d_per_split,
            1.0 / (n * hidden), hc_eps, norm_eps, sinkhorn_iters,
            streams.stride(0), streams.stride(1), fn.stride(0),
            mix.stride(0), mix.stride(1), sq.stride(0), block_out.stride(0), *slot_args,
            new.stride(0), new.stride(1), x.stride(0),
            N=n, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_D=block_d,
            FINISH_BLOCK_D=finish_block_d, BLOCK_S=block_s, FUSE_POST=expand is not None,
            SLOTS=bo.top_k > 0,
            HEAD=pre_only, SINGLE_PASS=finish_block_d >= hidden,
            num_warps=max(tiling.gemm_warps, tiling.finish_warps), **pdl(streams.device),
        )  # fmt: skip
        if pre_only and not head:
            comb_beside()
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
    stages = {} if tiling.gemm_stages is None else {"num_stages": tiling.gemm_stages}
    prenorm_gemm_kernel[(t_blocks, splits)](
        streams, w, mix, sq, block_out, prev_post, prev_comb, new,
        num_tokens, hidden, fn.shape[0], d_per_split,
        streams.stride(0), streams.stride(1), fn.stride(0),
        mix.stride(0), mix.stride(1), sq.stride(0), block_out.stride(0), *slot_args,
        N=n, BLOCK_N=block_n, BLOCK_T=gemm_block_t, BLOCK_M=block_m, BLOCK_D=block_d,
        FUSE_POST=expand is not None, SLOTS=bo.top_k > 0, PRECISION=precision,
        GEMV=tiling.gemm_gemv, NATIVE_BF16=device.type == "cuda", FLAT=flat,
        PER_STREAM=expand is not None and tiling.expand_per_stream and not tiling.gemm_gemv,
        num_warps=tiling.gemm_warps, **stages, **pdl(streams.device),
    )  # fmt: skip

    if tiling.comb_beside and not head and not tiling.mixes_block_t:
        finish(x, tiling.finish_block_t, tiling.finish_warps, True, True, pre_only=True)
        comb_beside()
    elif tiling.mixes_block_t:  # a token a thread for the mixes, then the collapse
        pre = _empty((num_tokens, block_n), torch.float32, device)
        finish(pre, tiling.mixes_block_t, max(1, min(4, tiling.mixes_block_t // 32)), True, False)
        finish(pre, tiling.finish_block_t, tiling.finish_warps, False, True)
    else:
        finish(x, tiling.finish_block_t, tiling.finish_warps, True, True)
    return new, x, post, comb


def _expand(
    streams: torch.Tensor, bo: _BlockOut, post: torch.Tensor, comb: torch.Tensor, tiling: Tiling
) -> torch.Tensor:
    """``hc_post``'s kernel on checked inputs -> the new streams [T, N, D]."""
    num_tokens, n, hidden = streams.shape
    settle(streams.device)  # post and comb may still be on the side stream
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
