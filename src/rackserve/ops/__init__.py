"""The one dispatch point for model ops: the model calls ``ops.<name>`` or its
:class:`Kernels` table only.

Every op has a plain-torch reference in ``reference.py`` (the specification, CPU-tested).
Ops with a faster implementation (Triton kernels in ``ops/triton/``, grouped GEMMs) are
reached through a :class:`Kernels` table the model is built with: ``kernels("reference")``
always runs the references; ``kernels("auto")`` runs the fast implementation for tensors on
a device that has one and the reference elsewhere (so the CPU path is the specification).
Each fast implementation is tested against its reference.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from rackserve.ops import quant, reference
from rackserve.ops.grouped_moe import grouped_mm_supported, moe_experts_grouped
from rackserve.ops.reference import (
    ExpertSlots,
    apply_rope,
    attention_prologue,
    compress_entries,
    compress_pool,
    compress_windows,
    embed_streams,
    grouped_linear,
    hc_collapse,
    hc_expand,
    hc_head,
    hc_post,
    hc_post_pre,
    hc_pre,
    hc_weights,
    indexer_topk,
    kv_insert,
    linear,
    logits,
    moe_experts,
    moe_routed,
    paged_indexer_select,
    paged_indexer_topk,
    paged_sparse_attention,
    rms_norm,
    rms_norm_rope,
    rope_cos_sin,
    route,
    route_fused,
    router_scores,
    select_entries,
    sinkhorn,
    sparse_attention,
    swiglu,
    topk_earliest,
)

__all__ = [
    "KERNEL_CHOICES",
    "ExpertSlots",
    "Kernels",
    "apply_rope",
    "attention_prologue",
    "compress_entries",
    "compress_pool",
    "compress_windows",
    "embed_streams",
    "grouped_linear",
    "hc_collapse",
    "hc_expand",
    "hc_head",
    "hc_post",
    "hc_post_pre",
    "hc_pre",
    "hc_weights",
    "indexer_topk",
    "kernels",
    "kv_insert",
    "linear",
    "logits",
    "moe_experts",
    "moe_routed",
    "paged_indexer_select",
    "paged_indexer_topk",
    "paged_sparse_attention",
    "rms_norm",
    "rms_norm_rope",
    "rope_cos_sin",
    "route",
    "route_fused",
    "router_scores",
    "select_entries",
    "sinkhorn",
    "sparse_attention",
    "swiglu",
    "topk_earliest",
]

KERNEL_CHOICES = ("auto", "reference")


@dataclass(frozen=True)
class Kernels:
    """The implementation of every op that has more than one, chosen once per model."""

    name: str
    hc_pre: Callable
    hc_post: Callable
    hc_head: Callable
    hc_post_pre: Callable
    moe_experts: Callable
    paged_sparse_attention: Callable
    paged_indexer_topk: Callable
    paged_indexer_select: Callable
    compress_pool: Callable
    route: Callable
    route_fused: Callable
    rms_norm: Callable
    apply_rope: Callable
    rms_norm_rope: Callable
    kv_insert: Callable
    compress_entries: Callable
    select_entries: Callable
    attention_prologue: Callable
    fp8_linear: Callable
    moe_experts_fp4: Callable
    moe_routed: Callable
    linear: Callable
    grouped_linear: Callable
    rope_cos_sin: Callable
    logits: Callable
    embed_streams: Callable

    def fast(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes the fast implementations (then the model also fuses its
        weights: one GEMM for the projections of the layer input, the shared expert as
        one more expert); the reference path keeps the checkpoint's module structure."""
        return self.name == "triton" or (self.name == "auto" and x.is_cuda)

    def attention_norms_q(self, q: torch.Tensor) -> bool:
        """Whether ``paged_sparse_attention`` takes the raw q (``q_norm_eps``) and the
        prologue skips it: prefill-sized batches on the fast path, whose wgmma kernel norms
        and rotates q as it loads it (no normed copy of q written and read back: 2 x 537 MB
        a layer at 8192 tokens), and decode batches from ``PREFILL_ATTENTION_MIN_TOKENS``.
        Smaller batches keep the norm in the prologue's launch."""
        min_tokens = PREFILL_ATTENTION_MIN_TOKENS
        return self.fast(q) and min_tokens is not None and q.shape[0] >= min_tokens

    def indexer_beside_q(self, x: torch.Tensor) -> bool:
        """Whether a CSA layer's indexer runs on a side stream beside the q projection for the
        batch ``x`` [T, D] (``INDEXER_BESIDE_Q_MAX_TOKENS``; off CUDA in issue order)."""
        max_tokens = INDEXER_BESIDE_Q_MAX_TOKENS
        return self.fast(x) and max_tokens is not None and x.shape[0] <= max_tokens


def _on_cuda(module: str, name: str, ref: Callable, everywhere: bool = False) -> Callable:
    """Call ``module.name`` (a Triton kernel) when the first tensor argument is on a CUDA
    device (``everywhere``: on any device), else ``ref``. The kernel module is imported on
    the first such call only, so a CPU-only run never imports Triton (and tests choose its
    interpreter first)."""
    fast: list[Callable] = []

    def dispatch(x, *args, **kwargs):
        if not (x.is_cuda or everywhere):
            return ref(x, *args, **kwargs)
        if not fast:
            fast.append(getattr(importlib.import_module(module), name))
        return fast[0](x, *args, **kwargs)

    dispatch.__name__ = name
    return dispatch


# Decode-sized batches take the fused Triton MoE (weights streamed once per step, no
# padding to GEMM tiles); larger ones the grouped GEMMs (tensor-core tiles for prefill).
FUSED_MOE_MAX_TOKENS = 256


def _moe_for(fused: Callable) -> Callable:
    def moe(x, *args, shared_last: bool = False, **kwargs):
        """``shared_last``: the picks' last column is the shared expert (the grouped path
        may run it apart: ``grouped_moe.SHARED_APART``)."""
        if x.shape[0] <= FUSED_MOE_MAX_TOKENS:
            return fused(x, *args, **kwargs)
        if x.is_cuda and grouped_mm_supported(x):
            return moe_experts_grouped(x, *args, shared_last=shared_last, **kwargs)
        return reference.moe_experts(x, *args, **kwargs)

    return moe


# The indexer over at least this many queries (prefill and mixed steps) takes the prefill
# kernels, with query tiles sharing key tiles. Smaller (decode) batches keep the decode
# kernels, whose splits fill the SMs when queries are few.
PREFILL_ATTN_MIN_TOKENS = 512
# The attention's own threshold (None: the decode kernel at every size). From 512 queries the
# prefill kernel with a bf16 p (prefill_attn.default_tiling): on the H200 (2026-12-03, one
# layer at 8192 queries) CSA 4.53 ms and HCA 1.73 ms against the split-KV decode kernel's
# 6.44 and 2.41, with 0.000-0.004% of outputs outside the bf16 rule at these shapes (the
# limit is 0.1%). Sessions 9-13 kept the decode kernel, reading the rule from Dh-64 test
# shapes (0.04-0.39% outside there). On sm_90 at V4's shapes the prefill kernel hands over
# to the Gluon wgmma kernel (``prefill_attn.WGMMA``, 2026-12-04: HCA 1.46 ms, CSA 3.21 ms).
# From 128 since 2026-12-06 (H100, results/2026-12-06-h100-s26.md): with hc_post_pre's
# expand apart from 128 too (``mhc.POST_APART_MIN_TOKENS``), bench forward decode:256@4096
# 6.374 / 6.333 ms against 6.718 / 6.498 and decode:128 5.887 / 5.848 against 6.291 / 6.133
# (alternating, two passes); each alone had the lower minimum in both passes of an A/B.
PREFILL_ATTENTION_MIN_TOKENS: int | None = 128
# Up to this many tokens a CSA layer on the fast path runs its indexer (the prologue, the
# compressor, the top-k; its q projection goes first, in series) on a side stream beside the
# attention's q projection, the step's largest GEMM before attention
# (``Attention._indexer_beside_q``); None: in series.
# Off: no gain measured (H100, 2026-12-06, bench forward in two alternating passes:
# decode:1 1.597 / 1.565 ms beside against 1.582 / 1.691 in series, decode:256 6.438 / 6.447
# against 6.418 / 6.447; the overlap's ~25 us at most in the bench's one CSA layer is within
# the spread). Graph replay is bit-identical to eager with it on (GPU test).
INDEXER_BESIDE_Q_MAX_TOKENS: int | None = None
# From MIN to MAX tokens the fused MoE runs its shared expert on a side stream from the
# start, beside the router's logits, the route + align and the routed experts (aligned
# without it), which are latency-bound at decode sizes while the shared expert streams its
# weights (``moe_routed``'s ``shared_beside``). MAX None: off.
# H200, bench forward, two alternating passes (results/2026-12-06-s28.md, call 3), default
# against beside at every size: decode:4 2.106 / 2.105 ms against 1.966 / 2.022, decode:64
# 4.422 / 4.294 against 4.241 / 4.283, decode:256 5.067 / 4.939 against 5.050 / 4.992; but
# decode:1 1.269 / 1.247 against 1.300 / 1.292 (alone, the shared expert's 64 + 32 programs
# stream slower than beside the routed ones in one launch), hence from 2 tokens. H100, this
# range against off, four passes (call 6): decode:4 -2%, decode:64 -1.7% (lower in each).
SHARED_BESIDE_ROUTER_MIN_TOKENS = 2
SHARED_BESIDE_ROUTER_MAX_TOKENS: int | None = 128


def _by_num_tokens(small: Callable, large: Callable, min_tokens: int) -> Callable:
    """``large`` for a first argument of at least ``min_tokens`` rows, else ``small``."""

    def dispatch(x, *args, **kwargs):
        fn = large if x.shape[0] >= min_tokens else small
        return fn(x, *args, **kwargs)

    dispatch.__name__ = small.__name__
    return dispatch


# ops on quantized weights (``ops/quant.py``), each with its Triton kernel
_QUANT_OPS = {"fp8_linear": "fp8_gemm", "moe_experts_fp4": "fused_moe_fp4"}


def _moe_routed_for(
    fused: Callable, route_fused: Callable, experts: Callable, linear: Callable
) -> Callable:
    """Decode-sized batches: router + align in one launch and the fused MoE (``fused``);
    larger ones: the router kernel, then ``experts`` (grouped GEMMs on a GPU). The router's
    logits go through ``linear`` (the table's: the GEMV for a few tokens on a GPU)."""

    def moe_routed(
        x, gate_weight, bias, table, input_ids, top_k, scoring, scaling, *rest, defer_sum=False
    ):
        if x.shape[0] <= FUSED_MOE_MAX_TOKENS:
            beside = SHARED_BESIDE_ROUTER_MAX_TOKENS
            return fused(
                x, gate_weight, bias, table, input_ids, top_k, scoring, scaling, *rest,
                defer_sum=defer_sum, linear=linear,
                shared_beside=x.is_cuda and beside is not None
                and SHARED_BESIDE_ROUTER_MIN_TOKENS <= x.shape[0] <= beside,
            )  # fmt: skip
        shared, counts, mask, w13, w2, limit = rest
        ids, weights = route_fused(
            x, gate_weight, bias, table, input_ids, top_k, scoring, scaling, shared, counts, mask,
            linear,
        )  # fmt: skip
        return experts(x, ids, weights, w13, w2, limit, shared_last=shared is not None)

    return moe_routed


# Projections of fewer than GEMV_MAX_TOKENS rows (16-bit, on a GPU) whose K the split-K
# Triton GEMV (``ops/triton/gemv.py``) splits take it: one launch with its reduce, where
# cuBLAS takes two (``splitKreduce_kernel``: the launches over issue 12's 20 per decoder layer
# on the H200). In graph replay it ties cuBLAS there (2026-12-01, ``benchmarks/gemv_bench.py``
# at T = 1 and 8: 7.9 against 8.3 us for an HCA layer's input projection, 9.2 against 10.5 for
# CSA's, 20.5 against 21.8 for wo_b). Shapes it does not split (wq_b) stay on cuBLAS; the
# lm_head's logits: ``LOGITS_GEMV_MAX_TOKENS``. $RACKSERVE_GEMV=0 when the table is made:
# cuBLAS for every projection.
GEMV_ENV = "RACKSERVE_GEMV"
GEMV_MAX_TOKENS = 16


@functools.cache
def _gemv() -> ModuleType:
    """``ops/triton/gemv.py``, imported on first use (Triton may be absent)."""
    return importlib.import_module("rackserve.ops.triton.gemv")


def _cuda_16bit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x and weight share a 16-bit dtype on CUDA: where the GEMV may take a product."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype


def _linear_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``reference.linear``, or the GEMV for decode-sized 16-bit inputs on CUDA where it
    splits K (never on the CPU, where the interpreter would only be slower)."""
    if _cuda_16bit(x, weight) and x.dim() == 2 and x.shape[0] < GEMV_MAX_TOKENS:
        gemv = _gemv()
        tiling = gemv.default_tiling(weight.shape[0], weight.shape[1], x.device)
        if tiling.splits > 1:
            return gemv.gemv(x, weight, tiling=tiling)
    return reference.linear(x, weight)


# Grouped projections (the attention's ``wo_a``: 8 groups of 4096 -> 1024 in V4-Flash) of
# fewer rows than this (16-bit, on a GPU) take the GEMV with ``groups``: its column blocks
# each read their group's inputs, split K as ``linear``'s do, in one launch. None (the
# default): cuBLAS's batched GEMM (``reference.grouped_linear``) at every size. Opt-in until
# an H200 says otherwise: on the H100 (2026-12-07, results/*-s42.md) wo_a took 26.2 us in
# the decode:1 replay against cuBLAS's 26.1 (s36), and bench forward back to back ran
# decode:1 1.421 / 1.417 ms against 1.414 / 1.415, decode:4 2.427 / 2.425 against 2.421 /
# 2.422. The H200's cuBLAS wo_a: 19.3 us a layer (session 24's replay, ~3.5 TB/s).
GROUPED_GEMV_MAX_TOKENS: int | None = None


def _grouped_linear_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``reference.grouped_linear`` of x [T, G, in], or the grouped GEMV for decode-sized
    16-bit inputs on CUDA below ``GROUPED_GEMV_MAX_TOKENS`` (read at call time)."""
    limit = GROUPED_GEMV_MAX_TOKENS
    if limit is not None and _cuda_16bit(x, weight) and x.dim() == 3 and x.shape[0] < limit:
        gemv, (n, k), groups = _gemv(), weight.shape, x.shape[1]
        tiling = gemv.default_tiling(n, k, x.device, groups)
        if (n // groups) % tiling.block_n == 0:  # else no block of 16 rows divides a group
            return gemv.gemv(x, weight, tiling=tiling, groups=groups)
    return reference.grouped_linear(x, weight)


# Logits of fewer rows than this (16-bit, on a GPU) come from the Triton GEMV writing its fp32
# accumulator (one split: the lm_head's 2,020 column blocks fill the SMs) instead of cuBLAS:
# H100, 2026-12-06, gemv_bench in graph replay, 129,280 x 4096: 345 against 378 us at 1 token,
# 347 against 379 at 4 (results/2026-12-06-s30.md); H200, 2026-12-07, bench forward: a tie
# (back to back 1.086 / 1.087 ms against 1.085 / 1.085 at decode:1, 1.865 / 1.864 against
# 1.868 / 1.867 at decode:4; results/2026-12-07-s41.md). None: cuBLAS at every size.
LOGITS_GEMV_MAX_TOKENS: int | None = GEMV_MAX_TOKENS


def _logits_fp32(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``reference.logits`` with the fp32 accumulator written for 16-bit inputs on CUDA: the
    GEMV below ``LOGITS_GEMV_MAX_TOKENS`` rows, cuBLAS above (``torch.mm``'s ``out_dtype``):
    the [S, V] bf16 -> fp32 cast after the GEMM was a kernel of its own (H200, 2026-12-03:
    96 us at 256 rows, 23 at 64; 129,280 columns)."""
    if _cuda_16bit(x, weight):
        limit = LOGITS_GEMV_MAX_TOKENS
        if limit is not None and x.dim() == 2 and x.shape[0] < limit:
            return _gemv().gemv(x, weight, out_dtype=torch.float32, out=out)
        if out is None:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)
    return reference.logits(x, weight, out)


def kernels(name: str = "auto") -> Kernels:
    """The op table for ``name`` in :data:`KERNEL_CHOICES`, or "triton": the fast
    implementations on every device (on CPU only under ``TRITON_INTERPRET=1``: the tests
    that run the whole fast path, and the launch counts, use it)."""
    if name not in (*KERNEL_CHOICES, "triton"):
        raise ValueError(f"unknown kernels {name!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    ops = [f.name for f in dataclasses.fields(Kernels) if f.name != "name"]
    refs = {op: getattr(quant if op in _QUANT_OPS else reference, op) for op in ops}
    ref = Kernels("reference", **refs)
    if name == "reference" or importlib.util.find_spec("triton") is None:
        return ref
    triton_ops = {  # op -> the module of its Triton kernel
        "hc_pre": "mhc",
        "hc_post": "mhc",
        "hc_head": "mhc",
        "hc_post_pre": "mhc",
        "paged_sparse_attention": "sparse_attn",
        "paged_indexer_topk": "indexer",
        "paged_indexer_select": "indexer",
        "compress_pool": "compress",
        "route": "route",
        "route_fused": "route",
        "rms_norm": "norm_rope",
        "apply_rope": "norm_rope",
        "rms_norm_rope": "norm_rope",
        "kv_insert": "norm_rope",
        "compress_entries": "compress",
        "select_entries": "select",
        "attention_prologue": "attn_prologue",
        "rope_cos_sin": "norm_rope",
        "embed_streams": "embed",
        **_QUANT_OPS,
    }
    everywhere = name == "triton"
    fast = {
        op: _on_cuda(f"rackserve.ops.triton.{module}", op, getattr(ref, op), everywhere)
        for op, module in triton_ops.items()
    }
    prefill_attn = _on_cuda(
        "rackserve.ops.triton.prefill_attn",
        "paged_sparse_attention",
        ref.paged_sparse_attention,
        everywhere,
    )
    if PREFILL_ATTENTION_MIN_TOKENS is not None:
        fast["paged_sparse_attention"] = _by_num_tokens(
            fast["paged_sparse_attention"], prefill_attn, PREFILL_ATTENTION_MIN_TOKENS
        )
    prefill_indexer = _on_cuda(
        "rackserve.ops.triton.prefill_indexer",
        "paged_indexer_topk",
        ref.paged_indexer_topk,
        everywhere,
    )
    fast["paged_indexer_topk"] = _by_num_tokens(
        fast["paged_indexer_topk"], prefill_indexer, PREFILL_ATTN_MIN_TOKENS
    )
    select_entries = fast["select_entries"]

    def prefill_indexer_select(q, key_cache, slots, weights, scale, num_visible, k, window):
        ids = prefill_indexer(q, key_cache, slots, weights, scale, num_visible, k)
        return select_entries(ids, slots, num_visible, window)

    fast["paged_indexer_select"] = _by_num_tokens(
        fast["paged_indexer_select"], prefill_indexer_select, PREFILL_ATTN_MIN_TOKENS
    )
    fused_moe = _on_cuda(
        "rackserve.ops.triton.fused_moe", "moe_experts", reference.moe_experts, everywhere
    )
    experts = _moe_for(fused_moe)
    routed = _on_cuda(
        "rackserve.ops.triton.moe_routed", "moe_routed", reference.moe_routed, everywhere
    )
    gemv_on = os.environ.get(GEMV_ENV, "1") == "1"
    fast["linear"] = _linear_gemv if gemv_on else reference.linear
    fast["grouped_linear"] = _grouped_linear_gemv if gemv_on else reference.grouped_linear
    fast["logits"] = _logits_fp32
    return Kernels(
        name,
        moe_experts=experts,
        moe_routed=_moe_routed_for(routed, fast["route_fused"], experts, fast["linear"]),
        **fast,
    )
