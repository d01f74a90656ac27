"""The rows a CSA query attends to besides its window, in one launch (equals
``reference.select_entries``): the slots of the indexer's picks and the [window | picks]
validity mask the sparse attention reads.

One program per query: it gathers the K picked entries' slots from the query's row of entry
slots, marks the picks that are visible, and copies the window mask in front. Grid S:
fixed for a batch, so the op can be captured in a CUDA graph. K and W are runtime
arguments: while a request's entries are fewer than top-k, K grows with the context, and a
compile-time K made every eager step (speculative drafts, prefill chunks) a JIT compile.

Shape legend: S queries, E entries per query (the context bucket's), K picks, W window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl, pdl_wait


@triton.jit
def store_selection(
    s, ids, k, k_ok, slots_ptr, stride_slots, num_visible_ptr, window_ptr, stride_window,
    out_slots_ptr, out_valid_ptr, K, W, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Query ``s``'s picks ``ids`` (at positions ``k``, ``k_ok``) as slots, and its
    [window | picks] validity: what ``reference.select_entries`` returns for that row."""
    slot = tl.load(slots_ptr + s * stride_slots + ids, mask=k_ok, other=0)
    tl.store(out_slots_ptr + s * K + k, slot, mask=k_ok)
    visible = tl.load(num_visible_ptr + s)
    tl.store(out_valid_ptr + s * (W + K) + W + k, (ids < visible).to(tl.uint8), mask=k_ok)
    w = tl.arange(0, BLOCK_W)
    w_ok = w < W
    window = tl.load(window_ptr + s * stride_window + w, mask=w_ok, other=0)
    tl.store(out_valid_ptr + s * (W + K) + w, window, mask=w_ok)


@triton.jit
def _select_kernel(
    ids_ptr,  # [S, K] int picks (entry ids), unit column stride
    slots_ptr,  # [S, E] int64 entry slots
    num_visible_ptr,  # [S] int
    window_ptr,  # [S, W] uint8 (bool) window mask
    out_slots_ptr,  # [S, K] int64
    out_valid_ptr,  # [S, W + K] uint8 (bool)
    stride_ids,
    stride_slots,
    stride_window,
    K,  # runtime: K = min(E, top-k) follows the context until E reaches top-k
    W,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    k_ok = k < K
    ids = tl.load(ids_ptr + s * stride_ids + k, mask=k_ok, other=0)
    store_selection(
        s, ids, k, k_ok, slots_ptr, stride_slots, num_visible_ptr, window_ptr, stride_window,
        out_slots_ptr, out_valid_ptr, K, W, BLOCK_W,
    )  # fmt: skip


def select_entries(
    ids: torch.Tensor,
    slots: torch.Tensor,
    num_visible: torch.Tensor,
    window_valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference.select_entries``."""
    s, k = ids.shape
    out_slots, valid = selection_outputs(s, k, slots, num_visible, window_valid)
    if s == 0:
        return out_slots, valid
    ids = ids if ids.stride(1) == 1 else ids.contiguous()
    slots = slots if slots.stride(1) == 1 else slots.contiguous()
    window = window_valid if window_valid.stride(1) == 1 else window_valid.contiguous()
    _select_kernel[(s,)](
        ids,
        slots,
        num_visible.contiguous(),
        window.view(torch.uint8),
        out_slots,
        valid.view(torch.uint8),
        ids.stride(0),
        slots.stride(0),
        window.stride(0),
        k,
        window.shape[1],
        BLOCK_K=max(2, triton.next_power_of_2(k)),
        BLOCK_W=max(2, triton.next_power_of_2(window.shape[1])),
        num_warps=4,
        **pdl(ids.device),
    )
    return out_slots, valid


def selection_outputs(
    s: int, k: int, slots: torch.Tensor, num_visible: torch.Tensor, window_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked shapes; the empty (slots [S, K], valid [S, W + K]) a selection fills."""
    e, w = slots.shape[1], window_valid.shape[1]
    if slots.shape[0] != s or num_visible.shape != (s,) or window_valid.shape[0] != s:
        raise ValueError(
            f"select_entries: slots [{s}, E], num_visible [{s}] and window_valid [{s}, W] "
            f"expected, got {tuple(slots.shape)}, {tuple(num_visible.shape)}, "
            f"{tuple(window_valid.shape)}"
        )
    if window_valid.dtype != torch.bool or k > e:
        raise ValueError(f"select_entries: window_valid must be bool and K={k} <= E={e}")
    out_slots = torch.empty(s, k, dtype=slots.dtype, device=slots.device)
    return out_slots, torch.empty(s, w + k, dtype=torch.bool, device=slots.device)
