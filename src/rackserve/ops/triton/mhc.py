"""Fused mHC (hyper-connection) ops: ``hc_pre``, ``hc_post`` and ``hc_head``.

Each equals its ``ops.reference`` namesake. Shape legend: T tokens, N streams, D hidden.

    hc_pre  = K1 (split-K prenorm GEMM) + K2 (finish) -> x [T, D], post [T, N], comb [T, N, N]
    hc_head = K1 with N mixes + K2 (HEAD)              -> x [T, D]
    hc_post = one elementwise kernel                   -> streams [T, N, D]
    hc_post_pre = K1 with the expand in its prologue + K2 -> hc_post, then hc_pre of the result
                  (or, for many tokens, hc_post's kernel + K1 + K2: ``Tiling.post_apart``)

(kernels in ``mhc_kernels.py`` and ``mhc_finish_kernels.py``; with ``Tiling.fused`` and
T <= 4, K1 + K2 are one launch; with ``Tiling.comb_beside`` a captured step computes post
and comb on the side stream and ``settle`` joins it: the ops that read them call it).
Grids and workspaces depend on T and the weights' shapes only: no host syncs, so the ops
can be captured in CUDA graphs. Under TRITON_INTERPRET=1 (CPU tests) the same kernels run
on CPU tensors, with larger token tiles.

This module holds the ops and the launch-shape policy: the switches below and
``default_tiling``, read from this module at call time (benchmarks set them on it, or
replace ``default_tiling``, in the process), so an op given ``tiling=None`` resolves it
here. The input checks are in ``mhc_inputs.py``; ``Tiling`` and the launches (K1 + K2, the
expand, fn's bf16x3 pieces) in ``mhc_launch.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton

from rackserve.ops.reference import ExpertSlots
from rackserve.ops.triton.mhc_inputs import _block_params, _check_streams, _post_inputs
from rackserve.ops.triton.mhc_launch import Tiling, _expand, _launch, settle, split_bf16x3

__all__ = [
    "Tiling",
    "default_tiling",
    "expand_k1_tiling",
    "hc_head",
    "hc_post",
    "hc_post_pre",
    "hc_pre",
    "settle",
    "split_bf16x3",
]

# "1": default_tiling fuses K1 + K2 for T <= 4 (GPU); with the comb beside the one launch
# computes pre and x, and post and comb go to the side launch (gpu_s32b.sh times it)
FUSED_ENV = "RACKSERVE_MHC_FUSED"
# from this many tokens hc_post_pre expands the streams in hc_post's kernel (3.9 TB/s at
# 8192 tokens) and runs K1 on them: 155 + 673 us against 1007 us fused (H200, 2026-12-02);
# at 256 tokens 28.7 against 35.0 us (H200, session 20). From 128 since 2026-12-06 (with
# ``ops.PREFILL_ATTENTION_MIN_TOKENS``; H100: decode:256 and decode:128 4-5% faster in bench
# forward, results/2026-12-06-h100-s26.md)
POST_APART_MIN_TOKENS = 128
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
# up to this many tokens (on a GPU) a block's K2 runs as two launches, pre + the collapse
# and post + comb (the Sinkhorn chain), the second on the side stream while a CUDA graph
# is captured (``Tiling.comb_beside``): off the step's critical path until the next block's
# mHC, which joins it. None: one launch. bench forward on the H100, two alternating passes
# of 30 runs (results/2026-12-06-s31.md): decode:1 1.558 / 1.552 -> 1.535 / 1.532 ms,
# decode:8 3.598 / 3.594 -> 3.577 / 3.579, but decode:64 5.810 / 5.806 -> 5.824 / 5.821.
COMB_BESIDE_MAX_TOKENS: int | None = 16
# from this many tokens K1 takes 128-token tiles (64 below): fn's [K, mixes] tile is loaded
# once for twice the tokens (ncu at 8192 tokens, 64-token tiles: L1/TEX 82% busy, DRAM
# 16%). H200, 2026-12-02, mhc_bench with the split K2, graph replay: hc_pre 440 -> 386 us
# and hc_post_pre 589 -> 537 at 8192 tokens, 154 -> 85 and 194 -> 126 at 2048
K1_WIDE_TILE_MIN_TOKENS = 2048
# K1's dot for bf16 streams on a GPU: "tf32x3" or "bf16x3" (half the wgmma instructions,
# no tf32 conversions of the streams' tile; fn's pieces split once per weight,
# ``mhc_launch._fn_pieces``).
# H200, 2026-12-04 (mhc_bench, graph replay, results/2026-12-04-h200-s20.md): hc_pre with
# the flat K1 at 8192 tokens 186.9 us against 526.7 (tf32x3 flat) and 385.4 (tf32x3 in
# [T, N, D] tiles, the default before); 59.8 against 109.4 / 84.4 at 2048; hc_post_pre at 64
# tokens 24.8 against 26.7, at 256 37.5 against 35.0 (both with the split launched each call)
BF16_DOT_PRECISION = "bf16x3"
# Candidates for hc_post_pre's K1 with the expand in its prologue at the bf16x3 dot, for an
# A/B against the defaults (``benchmarks/mhc_bench.py`` times them as variants;
# tests/ops/test_mhc_sm90.py compiles each for sm_90 without spills): (block_t, block_d,
# warps, a stream at a time, pipelining stages; None: Triton's 3). Compiled for sm_90
# (session 45, ``benchmarks/sass_audit.py``), the defaults' expand-fused K1 keeps 888 bytes
# of stack at 64 tokens (32 x 32 columns, tf32x3; 672 after a fused MoE's slots) and 656 at
# prefill sizes (128 x 16); at decode:64 on an H100 it took 18 us a call where the flat K1
# without the expand took 5 (session 43's replay)
EXPAND_K1_DECODE = {
    "fused_t16_d32_w4": (16, 32, 4, False, None),
    "fused_t32_d16_w4": (32, 16, 4, False, None),
    "stream_t32_d32_w4_s1": (32, 32, 4, True, 1),
}
EXPAND_K1_PREFILL = {
    "fused_t64_d16_w8": (64, 16, 8, False, None),
    "fused_t64_d32_w8": (64, 32, 8, False, None),
    "fused_t128_d16_w8": (128, 16, 8, False, None),
    "stream_t64_d32_w8": (64, 32, 8, True, None),
    "stream_t64_d32_w8_s1": (64, 32, 8, True, 1),
    "stream_t64_d64_w8_s1": (64, 64, 8, True, 1),
    "stream_t128_d32_w8_s1": (128, 32, 8, True, 1),
}


def expand_k1_tiling(base: Tiling, candidate: tuple[int, int, int, bool, int | None]) -> Tiling:
    """``base`` with hc_post_pre's K1 expanding the streams at the bf16x3 dot in the
    candidate's launch shape (an ``EXPAND_K1_*`` value)."""
    block_t, block_d, warps, per_stream, stages = candidate
    return dataclasses.replace(
        base, post_apart=False, expand_precision=None, gemm_precision="bf16x3", gemm_gemv=False,
        fused=False, gemm_block_t=block_t, gemm_block_d=block_d, gemm_warps=warps,
        expand_per_stream=per_stream, gemm_stages=stages,
    )  # fmt: skip


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
    expand reads the streams as [T, N*D] rows (``gemm_flat``). Up to
    ``COMB_BESIDE_MAX_TOKENS`` a block's K2 leaves post and comb to a launch of their own
    (``comb_beside``: on the side stream in a captured step). On CPU (the Triton
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
            post_apart=num_tokens >= POST_APART_MIN_TOKENS,
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
        comb_beside=COMB_BESIDE_MAX_TOKENS is not None and num_tokens <= COMB_BESIDE_MAX_TOKENS,
    )


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
    num_tokens, n, hidden = streams.shape
    tiling = tiling or default_tiling(num_tokens, n, hidden, streams.device, streams.dtype)
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
    tiling = tiling or default_tiling(num_tokens, n, hidden, streams.device, streams.dtype)
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
    num_tokens, n, hidden = streams.shape
    tiling = tiling or default_tiling(num_tokens, n, hidden, streams.device, streams.dtype)
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
