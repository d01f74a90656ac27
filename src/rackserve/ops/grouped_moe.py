"""Routed experts as two grouped GEMMs (no per-expert loop, no host sync).

Shape legend: T tokens, k experts per token, E experts, D hidden, I expert width.

The (token, expert) pairs are sorted by expert (``moe_sort_pairs``: a counting sort on a
GPU) and each token's row is written to its k sorted rows (``moe_permute``);
``F.grouped_mm`` multiplies each expert's contiguous run of rows by that expert's weights,
with run ends (``offs``) computed on the device. The activation (``swiglu_rows``) and the
combine (``moe_unpermute``: each token's k expert outputs gathered back, weighted and
summed in a fixed order, no float atomics, so the output is deterministic) are one pass
each: Triton kernels on a GPU (``ops/triton/prefill_moe.py``, imported on the first CUDA
call), their references on CPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rackserve.ops import reference
from rackserve.ops.side_stream import SideStream


def _fast(name: str) -> Callable:
    """``name`` from the Triton module for CUDA tensors, from the references otherwise (a
    CPU-only run never imports Triton)."""

    def dispatch(x: torch.Tensor, *args):
        if not x.is_cuda:
            return getattr(reference, name)(x, *args)
        return getattr(importlib.import_module("rackserve.ops.triton.prefill_moe"), name)(x, *args)

    return dispatch


_moe_sort_pairs = _fast("moe_sort_pairs")
_moe_permute = _fast("moe_permute")
_swiglu_rows = _fast("swiglu_rows")
_moe_unpermute = _fast("moe_unpermute")

# On a GPU, the Triton GEMMs over expert-aligned blocks (``ops/triton/prefill_experts.py``:
# the gather and the SwiGLU inside the gate-up GEMM, no argsort) where the shapes tile,
# instead of ``F.grouped_mm``. Off: slower on the H200 (2026-12-04-h200-s22.md, E = 64,
# k = 6, D = 4096, I = 2048, the whole op: 1.63 / 4.93 ms at 2048 / 8192 tokens against
# 1.43 / 4.77; its best GEMMs at 399-557 TF/s where CUTLASS's grouped GEMM runs at 436-573).
TILED = False
# The gate-up GEMM's rows written from each token's row (``moe_permute``: x read once)
# instead of gathered by sorted row (``index_select``: each x row read k times, in expert
# order, from DRAM once x outgrows L2). bench forward on the H100, two alternating passes
# of 8 runs (2026-12-06-s27.md): prefill:8192 46.30 / 46.53 -> 46.11 / 45.78 ms,
# prefill:8192@65536 76.54 / 77.09 -> 76.45 / 76.60.
PERMUTE_BY_TOKEN = True
# The shared expert (every token's last pick when ``shared_last``, its weights stacked last)
# apart from the routed experts' grouped GEMMs: two dense GEMMs over x itself (no permuted
# copy of x; cuBLAS's dense tiles over all T rows), its output added in the combine as the
# last slot of weight 1 (the same sum in the same order). "beside": on the side stream,
# beside the sort, the permute, the routed GEMMs and their SwiGLU (memory-bound passes next
# to a compute-bound GEMM); "series": in line; None: one more group of the grouped GEMMs;
# from SHARED_APART_MIN_TOKENS tokens. bench forward on the H100, two alternating passes of
# 10 runs (2026-12-06-s30.md, gpu_s29c.sh): prefill:8192 folded 46.15 / 45.75 ms, beside
# 45.36 / 45.13, series 45.79 (one pass); prefill:2048 folded 13.27 / 13.21, beside
# 13.41 / 13.16: no change there, hence from 4096.
SHARED_APART: str | None = "beside"
SHARED_APART_MIN_TOKENS = 4096


def moe_experts_grouped(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    shared_last: bool = False,
) -> torch.Tensor:
    """Same contract as ``reference.moe_experts``.

    x: [T, D]; topk_ids, topk_weights: [T, k]; w13: [E, 2I, D]; w2: [E, D, I] -> [T, D].
    shared_last: every token's last pick is the shared expert E - 1 with weight 1
    (``route_fused``'s layout), which ``SHARED_APART`` runs apart.
    """
    if TILED and x.is_cuda:
        tiled = importlib.import_module("rackserve.ops.triton.prefill_experts")
        tiling = tiled.default_tiling(x.device)
        if tiled.supported(x, w13, w2, tiling):
            return tiled.moe_experts_tiled(x, topk_ids, topk_weights, w13, w2, limit, tiling)
    apart = SHARED_APART in ("series", "beside") and x.shape[0] >= SHARED_APART_MIN_TOKENS
    if not (shared_last and apart):
        y, inverse = _routed_rows(x, topk_ids, w13, w2, limit)
        return _moe_unpermute(y, inverse, topk_weights)
    side = SideStream.of(x.device) if SHARED_APART == "beside" else SideStream(None)
    side.fork()
    with side.active():
        shared = F.linear(_swiglu_rows(F.linear(x, w13[-1]), limit), w2[-1])  # [T, D]
    y, inverse = _routed_rows(x, topk_ids[:, :-1], w13[:-1], w2[:-1], limit)
    side.join()
    return _moe_unpermute(y, inverse, topk_weights[:, :-1], shared)


def _routed_rows(
    x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped GEMMs over the (token, pick) pairs: their outputs y [T*k, D] in expert
    order and the row of y of each pair, inverse [T, k]."""
    token_of_row, inverse, offs = _moe_sort_pairs(topk_ids, w13.shape[0])
    # [T*k, D] sorted by expert
    rows = _moe_permute(x, inverse) if PERMUTE_BY_TOKEN else x.index_select(0, token_of_row)
    h = F.grouped_mm(rows, w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    y = F.grouped_mm(_swiglu_rows(h, limit), w2.transpose(1, 2), offs=offs)  # [T*k, D]
    return y, inverse


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether the grouped path runs natively (CUDA: bf16 on Hopper and newer; CPU: any)."""
    if x.device.type == "cpu":
        return True
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] >= 9
