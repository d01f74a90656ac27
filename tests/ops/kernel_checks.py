"""What every kernel test checks with: the device they run on (a GPU when there is one,
else the CPU under Triton's interpreter) and the tolerances of GPU_FASTPATH.md section 5."""

from __future__ import annotations

import pytest
import torch

from rackserve.ops import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def as_fp32(args: tuple) -> tuple:
    """The floating-point tensors of ``args`` in float32 (the fp32 reference's inputs)."""
    return tuple(
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def assert_fp32_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Relative error <= 1e-4, relative to max(|ref|, rms(ref)) so zeros don't divide."""
    assert not got.isnan().any(), "unwritten (NaN) elements"
    floor = ref.float().pow(2).mean().sqrt().clamp_min(1e-30)
    rel = (got.float() - ref.float()).abs() / torch.maximum(ref.float().abs(), floor)
    assert rel.max().item() <= 1e-4, rel.max().item()


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |x| (8 significant bits)."""
    _, exponent = torch.frexp(x.float().abs().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def assert_bf16_close(
    got: torch.Tensor, ref_bf16: torch.Tensor, ref_fp32: torch.Tensor, ulps: int = 0
) -> None:
    """|kernel - ref_fp32| <= 2 |ref_bf16 - ref_fp32| + 1e-3 for >= 99.9% of elements.
    ``ulps``: that many bf16 spacings of the output more, where ref_bf16 is the kernel's own
    rounding (one rounding of an fp32 sum whose order differs: the two may land on adjacent
    bf16 values where ref_bf16 happens to sit next to the truth)."""
    assert not got.isnan().any(), "unwritten (NaN) elements"
    err = (got.float() - ref_fp32).abs()
    allowed = 2 * (ref_bf16.float() - ref_fp32).abs() + 1e-3 + ulps * bf16_ulp(ref_fp32)
    violations = (err > allowed).float().mean().item()
    apart = ((got.float() - ref_bf16.float()).abs() > bf16_ulp(ref_fp32)).float().mean().item()
    assert violations <= 1e-3, (
        f"{violations:.4%} of elements out of tolerance ({apart:.4%} more than a bf16 "
        "spacing from ref_bf16)"
    )


def check_raw_q(attn, args: tuple, check) -> None:
    """``q_norm_eps`` on ``attn.paged_sparse_attention`` (``args`` with cos, sin): a raw q
    (wq_b's output: here not unit-RMS, with a nonzero mean) is normed and rotated as the
    prologue does before attending, and a raw q without RoPE is refused. ``check(attn,
    args)``: the op against the reference, returning its output."""
    dtype = args[0].dtype
    raw = (args[0].float() * 5 + 1).to(dtype)
    args = (raw, *args[1:])
    got = attn.paged_sparse_attention(*args, q_norm_eps=1e-6)
    normed = reference.rms_norm_rope(raw, None, 1e-6, args[-2], args[-1])
    want = reference.paged_sparse_attention(*args, q_norm_eps=1e-6)
    assert torch.equal(want, reference.paged_sparse_attention(normed, *args[1:]))
    # the kernel on the prologue's q (checked against the reference): in bf16 the
    # interpreter's norm is the reference's bit for bit; fp32 sums and a GPU's bf16 norm may
    # round an element the other way
    on_normed = check(attn, (normed, *args[1:]))
    if dtype == torch.float32:
        assert_fp32_close(got, on_normed)
    elif DEVICE == "cpu":
        assert torch.equal(got, on_normed)
    else:
        assert (got - on_normed).abs().max().item() <= 0.02 * on_normed.abs().max().item()
    with pytest.raises(ValueError, match="q_norm_eps"):
        attn.paged_sparse_attention(*args[:-2], q_norm_eps=1e-6)


def arrivals(op: str, device: torch.device) -> torch.Tensor:
    """The arrival counters ``op``'s one-launch reductions use on ``device`` (every launch
    leaves them at zero; ``ops/triton/common.py``'s ``arrival_counters``)."""
    from rackserve.ops.triton.common import ARRIVALS

    return ARRIVALS[op, device]
