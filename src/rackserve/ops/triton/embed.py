"""The step's first op: each token's embedding row written into its N mHC streams in one
launch (equals ``reference.embed_streams``), where the model took a gather and a copy
(``F.embedding``, then ``torch.cat`` of N copies: two launches, and the gathered [T, D]
written and read back).

Grid (T, cdiv(D, BLOCK)): program (t, c) loads columns c of the token's row once and stores
them N times. Launch shapes depend on the shapes only: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl, pdl_wait


@triton.jit
def _embed_streams_kernel(
    ids_ptr,  # [T] token ids
    weight_ptr,  # [V, D], unit column stride
    out_ptr,  # [T, N, D] contiguous
    stride_w,
    D,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    token = tl.load(ids_ptr + t).to(tl.int64)
    row = tl.load(weight_ptr + token * stride_w + cols, mask=ok)
    for s in tl.static_range(N):
        tl.store(out_ptr + (t * N + s) * D + cols, row, mask=ok)


def embed_streams(input_ids: torch.Tensor, weight: torch.Tensor, num_streams: int) -> torch.Tensor:
    """``reference.embed_streams``: input_ids [T] (int), weight [V, D] -> [T, N, D]."""
    if input_ids.dim() != 1 or weight.dim() != 2 or input_ids.device != weight.device:
        raise ValueError(
            f"embed_streams: ids [T] and weight [V, D] on one device expected, got "
            f"{tuple(input_ids.shape)} on {input_ids.device}, {tuple(weight.shape)} on "
            f"{weight.device}"
        )
    t, d = input_ids.shape[0], weight.shape[1]
    out = torch.empty(t, num_streams, d, dtype=weight.dtype, device=weight.device)
    if t == 0 or d == 0:
        return out
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    block = min(1024, triton.next_power_of_2(d))
    _embed_streams_kernel[(t, triton.cdiv(d, block))](
        input_ids, weight, out, weight.stride(0), d, N=num_streams, BLOCK=block, num_warps=4,
        **pdl(weight.device),
    )  # fmt: skip
    return out
