"""The split-K GEMV (``ops/triton/gemv.py``) against ``reference.linear``: T = 1..64 tokens,
ragged N and K (not multiples of the tiles), one split and many, strided inputs; fp32 at
1e-4 and bf16 within twice the bf16 reference's own error; outputs poisoned (NaN) first.
Also the lm_head's ``logits`` op (fp32 out) of both tables."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rackserve import ops
from rackserve.ops import reference

from kernel_checks import DEVICE, arrivals, assert_bf16_close, assert_fp32_close

CASES = [  # (T, N, K, splits)
    (1, 64, 128, 1),
    (1, 100, 300, 3),
    (2, 33, 64, 2),
    (3, 129, 257, 4),
    (4, 32, 1000, 8),
    (5, 70, 96, 1),
    (7, 1, 40, 2),
    (8, 200, 512, 5),
    (15, 48, 160, 3),
    (16, 96, 384, 6),
    (1, 257, 33, 1),
    (6, 64, 2048, 16),
    (17, 40, 256, 4),
    (33, 72, 200, 2),
    (64, 64, 512, 8),
]


@pytest.mark.parametrize("seed", range(24))
def test_gemv_matches_reference(seed, monkeypatch):
    from rackserve.ops.triton import gemv

    t, n, k, splits = CASES[seed % len(CASES)]
    dtype = torch.float32 if seed % 2 else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k + 3, generator=g)[:, 1 : k + 1]  # strided rows
    w = torch.randn(n, k, generator=g) / k**0.5
    if seed % 3 == 0:
        w = torch.randn(n, k + 5, generator=g)[:, :k] / k**0.5  # row stride > K
    x, w = x.to(DEVICE, dtype), w.to(DEVICE, dtype)
    base = gemv.default_tiling(n, k, x.device)
    # every third case: the two-launch reduce (the default: the last split of a block sums)
    tiling = gemv.GemvTiling(base.block_n, base.block_k, splits, fused_reduce=seed % 3 != 2)
    real_empty = torch.empty

    def poisoned(*a, **kw):
        return real_empty(*a, **kw).fill_(float("nan"))

    monkeypatch.setattr(gemv.torch, "empty", poisoned)
    got = gemv.gemv(x, w, tiling=tiling)
    assert got.shape == (t, n) and got.dtype == dtype
    ref_fp32 = reference.linear(x.float(), w.float())
    if dtype == torch.float32:
        assert_fp32_close(got, ref_fp32)
    else:
        assert_bf16_close(got, reference.linear(x, w), ref_fp32)


def test_gemv_is_deterministic_and_default_tiling_splits():
    from rackserve.ops.triton import gemv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1024, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(40, 1024, generator=g).to(DEVICE, torch.bfloat16)
    first = gemv.gemv(x, w)
    assert torch.equal(first, gemv.gemv(x, w))
    fused = gemv.GemvTiling(32, 32, 4, fused_reduce=True)
    two_launches = dataclasses.replace(fused, fused_reduce=False)
    for _ in range(2):  # the same sums in the same order; the counters are back at zero
        assert torch.equal(gemv.gemv(x, w, tiling=fused), gemv.gemv(x, w, tiling=two_launches))
        assert not arrivals("gemv", x.device).any()
    if DEVICE == "cpu":  # few column blocks: the K dimension is split
        assert gemv.default_tiling(40, 1024, x.device).splits > 1


@pytest.mark.parametrize(
    "n,k,splits",
    [(2560, 4096, 6), (4160, 4096, 4), (4096, 8192, 4), (64, 4096, 8), (129280, 4096, 1)],
)
def test_gpu_split_count_fills_one_wave(monkeypatch, n, k, splits):
    """On a GPU of 132 SMs (H100, H200) the split count is the most that keeps the launch
    within two programs a SM (no tail wave): V4-Flash's HCA and CSA input projections, wo_b,
    the router (its slices at least 512 inputs) and the lm_head (no split)."""
    from rackserve.ops.triton import gemv

    monkeypatch.setattr(gemv, "_num_sms", lambda device: 132)
    tiling = gemv.default_tiling(n, k, torch.device("cuda"))
    assert tiling.splits == splits
    assert -(-n // tiling.block_n) * tiling.splits <= max(264, -(-n // tiling.block_n))


@pytest.mark.parametrize("splits", [1, 3])
def test_gemv_fp32_out_is_the_unrounded_accumulator(splits):
    """out_dtype=float32 (the lm_head's logits): bf16 inputs, the fp32 sum unrounded, into a
    given strided ``out`` too; the bf16 output is that sum rounded once."""
    from rackserve.ops.triton import gemv

    g = torch.Generator().manual_seed(splits)
    x = torch.randn(3, 200, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(70, 200, generator=g).to(DEVICE, torch.bfloat16)
    tiling = gemv.GemvTiling(32, 32, splits)
    got = gemv.gemv(x, w, tiling=tiling, out_dtype=torch.float32)
    ref32 = x.float() @ w.float().t()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref32, rtol=1e-5, atol=1e-4)
    rounded = gemv.gemv(x, w, tiling=tiling)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())
    buf = torch.full((3, 80), float("nan"), device=DEVICE)
    into = gemv.gemv(x, w, tiling=tiling, out=buf[:, 5:75])
    assert into.data_ptr() == buf[:, 5:75].data_ptr() and torch.equal(into, got)
    assert buf[:, :5].isnan().all() and buf[:, 75:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        gemv.gemv(x, w, out=torch.empty(3, 71, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):  # out and out_dtype disagree
        gemv.gemv(x, w, out_dtype=torch.float32, out=torch.empty(3, 70, device=DEVICE).bfloat16())


def test_gemv_rejects_bad_inputs():
    from rackserve.ops.triton import gemv

    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        gemv.gemv(x, torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="at most"):
        gemv.gemv(torch.zeros(65, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        gemv.gemv(x, torch.zeros(4, 8, dtype=torch.float64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 4, 15])
@pytest.mark.parametrize("n,k", [(2560, 4096), (32768, 1024), (4096, 8192), (129280, 4096)])
def test_gemv_v4_flash_sizes_on_gpu(tokens, n, k):
    from rackserve.ops.triton import gemv

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    got = gemv.gemv(x, w)
    assert_bf16_close(got, reference.linear(x, w), reference.linear(x.float(), w.float()))
    assert torch.equal(got, gemv.gemv(x, w))


def test_linear_dispatch_default_on_off_on_cpu_and_only_where_k_splits(monkeypatch):
    from rackserve import ops

    monkeypatch.setenv(ops.GEMV_ENV, "0")
    assert ops.kernels("auto").linear is reference.linear
    monkeypatch.delenv(ops.GEMV_ENV)
    k = ops.kernels("triton")
    assert k.linear is not reference.linear
    x = torch.randn(2, 8).to(torch.bfloat16)
    w = torch.randn(4, 8).to(torch.bfloat16)
    assert torch.equal(k.linear(x, w), reference.linear(x, w))  # the CPU keeps the reference
    if DEVICE == "cuda":
        from rackserve.ops.triton import gemv

        g = torch.Generator(device="cuda").manual_seed(0)
        xs = torch.randn(2, 8192, generator=g, device="cuda").to(torch.bfloat16)
        ws = torch.randn(4096, 8192, generator=g, device="cuda").to(torch.bfloat16)
        assert gemv.default_tiling(4096, 8192, xs.device).splits > 1  # wo_b: the GEMV
        assert torch.equal(k.linear(xs, ws), gemv.gemv(xs, ws))
        xc, wc = x.cuda(), w.cuda()  # one split: cuBLAS
        assert torch.equal(k.linear(xc, wc), reference.linear(xc, wc))


def test_logits_reference_rounds_like_transformers():
    """``reference.logits``: the 16-bit GEMM, then a cast to float32 (transformers' head)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(300, 64, generator=g).bfloat16()
    got = ops.kernels("reference").logits(x, w)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.nn.functional.linear(x, w).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 15, 64, 256])
def test_logits_fp32_accumulator_on_gpu(rows):
    """The fast table's lm_head on CUDA writes cuBLAS's fp32 accumulator: float32 out,
    within the bf16 rule of the fp32 product, and no farther from it than the rounded
    reference (V4-Flash's 129,280 x 4096 head)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 4096, generator=g).bfloat16().cuda()
    w = (torch.randn(129280, 4096, generator=g) / 64).bfloat16().cuda()
    got = ops.kernels("auto").logits(x, w)
    ref = ops.kernels("reference").logits(x, w)
    ref32 = x.float() @ w.float().t()
    assert got.dtype == torch.float32 and got.shape == (rows, 129280)
    assert_bf16_close(got, ref, ref32)
    assert (got - ref32).abs().max() <= (ref - ref32).abs().max()


GROUPED_CASES = [  # (T, G, out a group, in, block_n, splits)
    (1, 8, 64, 128, 32, 2),
    (3, 2, 32, 200, 32, 1),
    (5, 4, 48, 96, 16, 3),
    (16, 3, 32, 64, 32, 2),
]


@pytest.mark.parametrize("case", GROUPED_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemv_matches_reference(case, dtype, monkeypatch):
    """groups > 1 (``wo_a``): every column block reads its own group's inputs; against
    ``reference.grouped_linear`` (the batched GEMM), outputs poisoned first."""
    from rackserve.ops.triton import gemv

    t, groups, out, k, block_n, splits = case
    g = torch.Generator().manual_seed(t * groups)
    x = torch.randn(t, groups, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(groups * out, k, generator=g) / k**0.5).to(DEVICE, dtype)
    real_empty = torch.empty
    monkeypatch.setattr(
        gemv.torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan"))
    )
    got = gemv.gemv(x, w, tiling=gemv.GemvTiling(block_n, 32, splits), groups=groups)
    assert got.shape == (t, groups * out) and got.dtype == dtype
    ref_fp32 = reference.grouped_linear(x.float(), w.float())
    # each group alone is a plain product: no group read another's inputs
    for j in range(groups):
        rows = slice(j * out, (j + 1) * out)
        torch.testing.assert_close(
            ref_fp32[:, rows], x[:, j].float() @ w[rows].float().t(), rtol=1e-5, atol=1e-5
        )
    if dtype == torch.float32:
        assert_fp32_close(got, ref_fp32)
    else:
        assert_bf16_close(got, reference.grouped_linear(x, w), ref_fp32)
    flat = gemv.gemv(x.flatten(1), w, tiling=gemv.GemvTiling(block_n, 32, splits), groups=groups)
    assert torch.equal(got, flat)


def test_grouped_gemv_tiling_and_bad_inputs(monkeypatch):
    from rackserve.ops.triton import gemv

    monkeypatch.setattr(gemv, "_num_sms", lambda device: 132)
    # V4-Flash's wo_a: 8 groups of 1024 outputs from 4096 inputs: 64-row blocks, 2 splits
    tiling = gemv.default_tiling(8192, 4096, torch.device("cuda"), groups=8)
    assert (tiling.block_n, tiling.splits) == (64, 2)
    # 48 outputs a group: the rows a step halved to a divisor
    assert gemv.default_tiling(96, 512, torch.device("cuda"), groups=2).block_n == 16
    x = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="G = 3"):
        gemv.gemv(x, torch.zeros(10, 8, device=DEVICE), groups=3)  # 3 does not divide 10
    with pytest.raises(ValueError, match="G = 3"):
        gemv.gemv(x, torch.zeros(12, 9, device=DEVICE), groups=3)
    with pytest.raises(ValueError, match="multiple of block_n"):
        gemv.gemv(x, torch.zeros(48, 8, device=DEVICE), tiling=gemv.GemvTiling(32, 8, 1), groups=3)


def test_grouped_linear_dispatch(monkeypatch):
    """The op table: the reference off CUDA and with the GEMV off; on CUDA below
    ``GROUPED_GEMV_MAX_TOKENS`` (opt-in) the grouped GEMV, the batched GEMM from there."""
    monkeypatch.setattr(ops, "GROUPED_GEMV_MAX_TOKENS", 16)
    monkeypatch.setenv(ops.GEMV_ENV, "0")
    assert ops.kernels("auto").grouped_linear is reference.grouped_linear
    monkeypatch.delenv(ops.GEMV_ENV)
    k = ops.kernels("triton")
    x = torch.randn(2, 4, 16).to(torch.bfloat16)
    w = torch.randn(4 * 32, 16).to(torch.bfloat16)
    assert torch.equal(k.grouped_linear(x, w), reference.grouped_linear(x, w))
    if DEVICE == "cuda":
        # 40 outputs a group: no block of 16 rows or more divides it, the batched GEMM
        x40, w40 = x.cuda(), torch.randn(4 * 40, 16).to("cuda", torch.bfloat16)
        assert torch.equal(k.grouped_linear(x40, w40), reference.grouped_linear(x40, w40))
        from rackserve.ops.triton import gemv

        xc, wc = x.cuda(), w.cuda()
        assert torch.equal(k.grouped_linear(xc, wc), gemv.gemv(xc, wc, groups=4))
        monkeypatch.setattr(ops, "GROUPED_GEMV_MAX_TOKENS", None)
        assert torch.equal(k.grouped_linear(xc, wc), reference.grouped_linear(xc, wc))
