"""The FP8 block-scaled linear (``ops/triton/fp8_gemm.py``) against ``ops.quant.fp8_linear``
(dequantize, then the plain linear), and the FP8 format itself.

Shapes cover T = 1, ragged M, N and K that are not multiples of the 128 scale block, the
grouped ``wo_a`` (groups sharing a scale block when out < 128), strided activations and
K splits (the decode path); outputs start poisoned (NaN) so unwritten elements fail.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from rackserve.ops import quant

from kernel_checks import DEVICE, assert_bf16_close, assert_fp32_close


@pytest.fixture(scope="module")
def gemm():
    return importlib.import_module("rackserve.ops.triton.fp8_gemm")


@pytest.fixture(autouse=True)
def poisoned_outputs(gemm, monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(gemm, "_empty", empty)


def make_weight(n: int, k: int, seed: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitude: each block gets its own scale
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None] / k**0.5
    q, s = quant.quantize_fp8(w, ue8m0=ue8m0)
    return q.to(DEVICE), s.to(DEVICE)


def check(gemm, x, w, s, groups=0, tiling=None):
    got = gemm.fp8_linear(x, w, s, groups, tiling=tiling)
    ref = quant.fp8_linear(x, w, s, groups)
    assert got.shape == ref.shape and got.dtype == x.dtype
    if x.dtype == torch.float32:
        assert_fp32_close(got, ref)
    else:
        assert_bf16_close(got, ref, quant.fp8_linear(x.float(), w, s, groups))


CASES = [  # (M, N, K)
    (1, 64, 128),
    (3, 200, 300),
    (17, 128, 256),
    (64, 96, 384),
    (5, 256, 160),
]


@pytest.mark.parametrize("m,n,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(gemm, m, n, k, dtype):
    w, s = make_weight(n, k, seed=m * 7 + n, ue8m0=dtype == torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    check(gemm, x, w, s)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("block_k", [64, 128])
def test_split_k_and_narrow_k_steps(gemm, split_k, block_k):
    w, s = make_weight(80, 520, seed=split_k, ue8m0=False)
    x = torch.randn(2, 520, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    tiling = gemm.GemmTiling(16, 32, block_k, split_k, 4, 1)
    check(gemm, x, w, s, tiling=tiling)


@pytest.mark.parametrize("t,groups,out,inp", [(1, 2, 32, 128), (7, 4, 128, 64), (20, 2, 160, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped(gemm, t, groups, out, inp, dtype):
    w, s = make_weight(groups * out, inp, seed=t, ue8m0=True)
    big = torch.randn(t, groups, inp + 8, generator=torch.Generator().manual_seed(t))
    x = big.to(DEVICE, dtype)[..., :inp]  # strided rows: a view, not a copy
    check(gemm, x, w, s, groups=groups)


def test_leading_dims_and_empty(gemm):
    w, s = make_weight(64, 128, seed=1, ue8m0=True)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    check(gemm, x, w, s)
    assert gemm.fp8_linear(x[:0, 0], w, s).shape == (0, 64)


def test_bad_inputs(gemm):
    w, s = make_weight(64, 128, seed=1, ue8m0=True)
    x = torch.randn(2, 128, device=DEVICE)
    with pytest.raises(ValueError, match="scale must be fp32"):
        gemm.fp8_linear(x, w, s[:, :0])
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        gemm.fp8_linear(x, w.float(), s)
    with pytest.raises(ValueError, match="last dim"):
        gemm.fp8_linear(x[:, :64], w, s)


# ---- the format ----------------------------------------------------------------------------
@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_round_trip(ue8m0):
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    q, s = quant.quantize_fp8(w, ue8m0=ue8m0)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    back = quant.dequantize_fp8(q, s, torch.float32)
    assert ((back - w).abs() <= w.abs() * 2**-3 + s.max() * 2**-9).all()  # 3 mantissa bits
    if ue8m0:
        assert torch.equal(quant.scale_to_float(quant.float_to_ue8m0(s)), s)
        stored = quant.float_to_ue8m0(s).view(torch.float8_e8m0fnu)
        assert torch.equal(quant.dequantize_fp8(q, stored, torch.float32), back)


def test_ue8m0_rejects_other_scales():
    with pytest.raises(ValueError, match="powers of two"):
        quant.float_to_ue8m0(torch.tensor([0.75]))
    assert quant.float_to_ue8m0(torch.tensor([1.0, 0.25, 8.0])).tolist() == [127, 125, 130]
