"""Routed experts as two grouped GEMMs (no per-expert loop, no host sync).

Shape legend: T tokens, k experts per token, E experts, D hidden, I expert width.

The (token, expert) pairs are sorted by expert; ``F.grouped_mm`` multiplies each expert's
contiguous run of rows by that expert's weights, with run ends (``offs``) computed on the
device. Results go back to their (token, slot) place and the k slots are summed in a fixed
order, so the output is deterministic (no float atomics): a CUDA-graph replay is
bit-identical to the eager call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rackserve.ops.reference import swiglu


def moe_experts_grouped(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Same contract as ``reference.moe_experts``.

    x: [T, D]; topk_ids, topk_weights: [T, k]; w13: [E, 2I, D]; w2: [E, D, I] -> [T, D].
    """
    t, k = topk_ids.shape
    flat_ids = topk_ids.flatten()  # [T*k]
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's run
    rows = x[order // k]  # [T*k, D] sorted by expert
    gate, up = F.grouped_mm(rows, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = F.grouped_mm(swiglu(gate, up, limit), w2.transpose(1, 2), offs=offs)  # [T*k, D]
    y = (y * topk_weights.flatten()[order, None]).to(x.dtype)
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted.view(t, k, -1).sum(dim=1)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether the grouped path runs natively (CUDA: bf16 on Hopper and newer; CPU: any)."""
    if x.device.type == "cpu":
        return True
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] >= 9
