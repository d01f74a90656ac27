"""What every kernel test checks with: the device they run on (a GPU when there is one,
else the CPU under Triton's interpreter) and the tolerances of GPU_FASTPATH.md section 5."""

from __future__ import annotations

import torch

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


def assert_bf16_close(got: torch.Tensor, ref_bf16: torch.Tensor, ref_fp32: torch.Tensor) -> None:
    """|kernel - ref_fp32| <= 2 |ref_bf16 - ref_fp32| + 1e-3 for >= 99.9% of elements."""
    assert not got.isnan().any(), "unwritten (NaN) elements"
    err = (got.float() - ref_fp32).abs()
    allowed = 2 * (ref_bf16.float() - ref_fp32).abs() + 1e-3
    violations = (err > allowed).float().mean().item()
    assert violations <= 1e-3, f"{violations:.4%} of elements out of tolerance"
