"""Input checks of the fused mHC ops (``mhc.py``): shapes and dtypes first, devices last (a
call gets the same message on every device), each message naming the expected shape. A
block output comes back as the kernels read it (``mhc_launch._BlockOut``)."""

from __future__ import annotations

import torch

from rackserve.ops.reference import ExpertSlots
from rackserve.ops.triton.mhc_launch import _BlockOut

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
