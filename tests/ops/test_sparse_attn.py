"""The paged sparse attention kernel (``ops/triton/sparse_attn.py``) against its reference.

CPU runs use the Triton interpreter at small shapes (Dh 64, Wa 16, Wb in {0, 8, 24},
S in {1, 3, 9}, H in {4, 16}). Each query's valid mask follows one of five patterns (a
partly filled window plus some compressed rows, window rows only, no valid row, all valid,
random); invalid rows point at NaN rows of the caches (or at slot -1), so a kernel that
lets garbage reach a dot fails. Outputs and workspaces start as NaN, so an element a kernel
fails to write fails too. Tolerances (GPU_FASTPATH.md section 5): fp32 within 1e-4
relative; bf16 |kernel - ref_fp32| <= 2 |ref_bf16 - ref_fp32| + 1e-3 for >= 99.9%.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE, as_fp32, assert_bf16_close, assert_fp32_close, check_raw_q

WA = 16
CASES = list(itertools.product((1, 3, 9), (4, 16), (0, 8, 24)))  # (S, H, Wb)


@pytest.fixture(scope="module")
def attn():
    # the root conftest chose the interpreter (no GPU) before anything imported Triton
    return importlib.import_module("rackserve.ops.triton.sparse_attn")


@pytest.fixture(autouse=True)
def nan_outputs(attn, monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(attn, "_empty", empty)


def valid_mask(s: int, wa: int, wb: int, g: torch.Generator) -> torch.Tensor:
    """[S, Wa + Wb]: query i follows pattern i % 5 (see the module docstring)."""
    valid = torch.zeros(s, wa + wb, dtype=torch.bool)
    for i in range(s):
        filled = int(torch.randint(1, wa + 1, (1,), generator=g))  # window suffix p-W+1..p
        pattern = (i + int(torch.randint(0, 5, (1,), generator=g))) % 5 if s > 1 else 0
        if pattern == 0:
            valid[i, wa - filled : wa] = True
            valid[i, wa:] = torch.rand(wb, generator=g) < 0.7
        elif pattern == 1:
            valid[i, wa - filled : wa] = True
        elif pattern == 3:
            valid[i] = True
        elif pattern == 4:
            valid[i] = torch.rand(wa + wb, generator=g) < 0.5
    return valid


def make_case(
    s: int,
    h: int,
    wb: int,
    dtype: torch.dtype,
    seed: int,
    dh: int = 64,
    wa: int = WA,
    rope_dim: int = 0,
) -> tuple:
    """Arguments of ``paged_sparse_attention``: strided caches with a NaN row each."""
    g = torch.Generator().manual_seed(seed)
    na, nb = s * wa + 5, s * wb + 3
    kv_a = torch.randn(na, dh + 8, generator=g)[:, :dh]  # row stride > Dh
    kv_b = torch.randn(nb, dh + 16, generator=g)  # [kv | indexer key]
    kv_a[na - 1] = float("nan")
    kv_b[nb - 1] = float("nan")
    slots_a = torch.randint(0, na - 1, (s, wa), generator=g)
    slots_b = torch.randint(0, nb - 1, (s, wb), generator=g)
    valid = valid_mask(s, wa, wb, g)
    minus_one = torch.rand(s, wa + wb, generator=g) < 0.5  # else the NaN row
    slots_a = torch.where(valid[:, :wa], slots_a, torch.where(minus_one[:, :wa], -1, na - 1))
    slots_b = torch.where(valid[:, wa:], slots_b, torch.where(minus_one[:, wa:], -1, nb - 1))
    q = 2 * torch.randn(s, h, dh, generator=g)  # peaky softmaxes
    sinks = torch.randn(h, generator=g)
    args = [q.to(dtype), kv_a.to(dtype), slots_a, kv_b.to(dtype), slots_b, valid, sinks, dh**-0.5]
    if rope_dim:
        angle = torch.rand(s, rope_dim // 2, generator=g) * 6.3
        args += [angle.cos().to(dtype), angle.sin().to(dtype)]
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


def check(attn, args: tuple, tiling=None) -> torch.Tensor:
    got = attn.paged_sparse_attention(*args, tiling=tiling)
    q = args[0]
    assert got.shape == q.shape and got.dtype == q.dtype
    if q.dtype == torch.float32:
        assert_fp32_close(got, reference.paged_sparse_attention(*args))
    else:
        ref32 = reference.paged_sparse_attention(*as_fp32(args))
        assert_bf16_close(got, reference.paged_sparse_attention(*args), ref32)
    return got


@pytest.mark.parametrize("s,h,wb", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(attn, s, h, wb, dtype):
    check(attn, make_case(s, h, wb, dtype, seed=100 * s + 10 * h + wb))


def tilings(attn) -> dict[str, object]:
    """GPU-like shapes: split rows (the combine kernel), small tiles, dv split, 32 heads."""
    t = attn.Tiling
    return {
        "split3": t(16, 16, 1, 3, 4, 2, 16, 4),
        "split_every_tile": t(16, 16, 1, 64, 4, 2, 16, 4),
        "dv2_split2": t(16, 16, 2, 2, 4, 2, 16, 4),
        "dv4_single": t(16, 32, 4, 1, 4, 2, 16, 4),
        "heads32": t(32, 16, 1, 2, 8, 2, 32, 4),
        "no_prefetch": t(16, 16, 1, 2, 4, 3, 16, 4, prefetch=False),
        # every head in one program (H 16 here; 4 heads pad to 16)
        "wide": t(16, 16, 1, 1, 4, 2, 16, 4, prefetch=False, kernel="wide"),
        "wide_dv2_split3": t(16, 16, 2, 3, 4, 2, 16, 4, prefetch=False, kernel="wide"),
        "wide_split_every_tile": t(16, 16, 1, 64, 4, 2, 16, 4, prefetch=False, kernel="wide"),
        # PV as one dot of fp16 p and rows (16-bit rows; fp32 rows keep their fp32 dots)
        "wide_fp16": t(16, 16, 1, 1, 4, 2, 16, 4, prefetch=False, kernel="wide", pv_fp16=True),
        "wide_dv2_split3_fp16": t(
            16, 16, 2, 3, 4, 2, 16, 4, prefetch=False, kernel="wide", pv_fp16=True
        ),
    }


WIDE = ["wide", "wide_dv2_split3", "wide_split_every_tile", "wide_fp16", "wide_dv2_split3_fp16"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_q_is_normed_and_rotated_first(attn, dtype):
    """q_norm_eps: the op takes wq_b's raw q and applies the prologue's unweighted norm +
    RoPE before attending (the model's prefill path); a raw q without RoPE is refused."""
    args = make_case(3, 16, 8, dtype, seed=5, rope_dim=16)
    check_raw_q(attn, args, check)


@pytest.mark.parametrize(
    "name",
    ["split3", "split_every_tile", "dv2_split2", "dv4_single", "heads32", "no_prefetch", *WIDE],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tilings_match_reference(attn, name, dtype):
    check(attn, make_case(9, 16, 24, dtype, seed=7), tilings(attn)[name])


@pytest.mark.parametrize(
    "name",
    [None, "split3", "dv2_split2", "wide", "wide_dv2_split3", "wide_dv2_split3_fp16"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_rope_epilogue(attn, name, dtype):
    tiling = tilings(attn)[name] if name else None
    check(attn, make_case(3, 16, 8, dtype, seed=11, rope_dim=16), tiling)


def test_fp16_pv_keeps_split_p_accuracy(attn):
    """The wide kernel's fp16 PV (one dot, 11 bits of p) is as close to the fp32 reference
    as split p (two dots, ~16 bits) on average, where a bf16 p alone (8 bits) is 15% off:
    the rounding of p shows through the bf16 output's own (200 rows a query here)."""
    args = make_case(9, 16, 200, torch.bfloat16, seed=7, wa=64)
    ref32 = reference.paged_sparse_attention(*as_fp32(args))
    wide = tilings(attn)["wide"]

    def mean_error(tiling) -> float:
        got = attn.paged_sparse_attention(*args, tiling=tiling).float()
        return (got - ref32).abs().mean().item()

    split = mean_error(wide)
    assert mean_error(dataclasses.replace(wide, pv_fp16=True)) <= 1.05 * split
    assert mean_error(dataclasses.replace(wide, split_p=False)) >= 1.1 * split


def test_odd_head_dim_and_many_rows(attn):
    """Dh not a power of two (masked columns) and more rows than one tile, with RoPE."""
    args = make_case(3, 4, 40, torch.float32, seed=3, dh=48, wa=20, rope_dim=16)
    check(attn, args)
    check(attn, args, tilings(attn)["split3"])
    check(attn, args, tilings(attn)["wide"])
    check(attn, args, tilings(attn)["wide_dv2_split3"])


@pytest.mark.parametrize("s,h,wb", [(1, 4, 8), (3, 16, 0), (9, 16, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_kernel_from_the_environment(attn, monkeypatch, s, h, wb, dtype):
    """$RACKSERVE_SPARSE_ATTN=wide makes the default tiling pick the wide kernel (not for
    fp32 rows on a GPU, nor for more than 128 heads)."""
    monkeypatch.setenv(attn.KERNEL_ENV, "wide")
    device = torch.device(DEVICE)
    expected = "heads" if dtype == torch.float32 and device.type == "cuda" else "wide"
    assert attn.default_tiling(s, h, 64, WA + wb, device, dtype).kernel == expected
    assert attn.default_tiling(s, 132, 64, WA + wb, device, dtype).kernel == "heads"
    check(attn, make_case(s, h, wb, dtype, seed=300 + 100 * s + 10 * h + wb))


def test_wide_kernel_refuses_too_many_heads(attn):
    args = make_case(1, 4, 8, torch.float32, seed=0)
    q = args[0].repeat(1, 33, 1)  # 132 heads
    sinks = args[6].repeat(33)
    with pytest.raises(ValueError, match="every head"):
        attn.paged_sparse_attention(q, *args[1:6], sinks, args[7], tiling=tilings(attn)["wide"])


def test_reference_matches_gather_then_attention():
    """The reference is the model's old path (gather, cat, sparse_attention) on finite rows."""
    q, kv_a, slots_a, kv_b, slots_b, valid, sinks, scale = make_case(3, 4, 8, torch.float32, 5)
    kv_a, kv_b = kv_a.nan_to_num(), kv_b.nan_to_num()
    slots_a, slots_b = slots_a.clamp(min=0), slots_b.clamp(min=0)
    rows = torch.cat([kv_a[slots_a], kv_b[slots_b][..., :64]], dim=1)
    expected = reference.sparse_attention(q, rows, valid, sinks, scale)
    got = reference.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b, valid, sinks, scale)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_deterministic_and_layout_independent(attn):
    """Repeated calls are bitwise equal; int32 slots and a contiguous q give the same bits."""
    args = make_case(9, 16, 24, torch.bfloat16, seed=2)
    tiling = tilings(attn)["split3"]
    first = attn.paged_sparse_attention(*args, tiling=tiling)
    q, kv_a, slots_a, kv_b, slots_b, *rest = args
    wide_q = torch.zeros(q.shape[0], q.shape[1], 80, dtype=q.dtype, device=q.device)
    wide_q[..., :64] = q
    second = attn.paged_sparse_attention(
        wide_q[..., :64], kv_a, slots_a.int(), kv_b, slots_b.int(), *rest, tiling=tiling
    )
    assert torch.equal(first, second)


def test_empty_batch_and_no_rows(attn):
    args = make_case(0, 4, 8, torch.float32, seed=0)
    assert attn.paged_sparse_attention(*args).shape == (0, 4, 64)
    q, kv_a, _, kv_b, _, _, sinks, scale = make_case(2, 4, 0, torch.float32, seed=0)
    none = torch.zeros(2, 0, dtype=torch.long, device=DEVICE)
    out = attn.paged_sparse_attention(
        q, kv_a, none, kv_b, none, torch.zeros(2, 0, dtype=torch.bool, device=DEVICE), sinks, scale
    )
    assert torch.equal(out, torch.zeros_like(q))  # the sink alone: zero output


def test_bad_input_raises_clear_errors(attn):
    q, kv_a, slots_a, kv_b, slots_b, valid, sinks, scale = make_case(3, 4, 8, torch.float32, 0)
    rest = (valid, sinks, scale)
    with pytest.raises(ValueError, match="kv_a must be"):
        attn.paged_sparse_attention(q, kv_a[:, :32], slots_a, kv_b, slots_b, *rest)
    with pytest.raises(ValueError, match="kv_b must be"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b.bfloat16(), slots_b, *rest)
    with pytest.raises(ValueError, match="column stride"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b.t().contiguous().t(), slots_b, *rest)
    with pytest.raises(ValueError, match="slots_b must be"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b.float(), *rest)
    with pytest.raises(ValueError, match="valid must be"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b, valid[:, 1:], sinks, scale)
    with pytest.raises(ValueError, match="sinks must be"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b, valid, sinks[:2], scale)
    with pytest.raises(ValueError, match="q must be"):
        attn.paged_sparse_attention(q[0], kv_a, slots_a, kv_b, slots_b, *rest)
    cos = torch.ones(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="together"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b, *rest, cos)
    with pytest.raises(ValueError, match="rope dims"):
        big = torch.ones(3, 40, device=DEVICE)
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b, *rest, big, big)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("s,wb", [(1, 32), (1, 512), (64, 512), (256, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_flash_sizes_on_gpu(attn, s, wb, dtype):
    """H = 64, Dh = 512, Wa = 128 with the default GPU tiling, with and without RoPE."""
    args = make_case(s, 64, wb, dtype, seed=s + wb, dh=512, wa=128, rope_dim=64)
    check(attn, args)
    check(attn, args[:8])
    if dtype == torch.bfloat16:  # fp32 stays on "heads" (default_tiling)
        wide = attn.wide_tiling(s, 64, 512, 128 + wb, args[0].device)
        for tiling in (wide, dataclasses.replace(wide, pv_fp16=True)):
            check(attn, args, tiling)
            check(attn, args[:8], tiling)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_is_bitwise_equal_to_eager(attn):
    """Captured once (split rows: two launches), replayed on new queries."""
    args = make_case(4, 64, 512, torch.bfloat16, seed=1, dh=512, wa=128, rope_dim=64)
    q, rest = args[0].clone(), args[1:]
    for tiling in (None, attn.wide_tiling(4, 64, 512, 640, q.device)):
        attn.paged_sparse_attention(q, *rest, tiling=tiling)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn.paged_sparse_attention(q, *rest, tiling=tiling)
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attn.paged_sparse_attention(q, *rest, tiling=tiling))
