"""The fused mHC kernels (``ops/triton/mhc.py``, ``mhc_launch.py``) against their references.

CPU runs use the Triton interpreter at small shapes (N=4, D in {64, 256, 320},
T in {1, 3, 37, 130}); every output and workspace starts as NaN, so an element a kernel
fails to write fails the comparison. Tolerances (GPU_FASTPATH.md section 5): fp32 inputs
within 1e-4 relative; bf16 inputs |kernel - ref_fp32| <= 2 |ref_bf16 - ref_fp32| + 1e-3
for at least 99.9% of the elements.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE, arrivals, as_fp32, assert_bf16_close, assert_fp32_close

N = 4
ITERS = 20
HC_EPS = 1e-6
NORM_EPS = 1e-6
SHAPES = list(itertools.product((1, 3, 37, 130), (64, 256, 320)))  # (T, D)


@pytest.fixture(scope="module")
def mhc():
    # the root conftest chose the interpreter (no GPU) before anything imported Triton
    return importlib.import_module("rackserve.ops.triton.mhc")


@pytest.fixture(scope="module")
def mhc_launch():
    return importlib.import_module("rackserve.ops.triton.mhc_launch")


@pytest.fixture(autouse=True)
def nan_outputs(mhc_launch, monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(mhc_launch, "_empty", empty)


def make_streams(t: int, d: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Residual streams of unequal scale with a few outlier channels, as trained ones have."""
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(t, N, d, generator=g) * torch.exp(torch.randn(1, N, 1, generator=g))
    streams[:, :, torch.randint(0, d, (3,), generator=g)] *= 8.0
    return streams.to(DEVICE, dtype)


def make_block_params(d: int, seed: int, mixes: int) -> tuple[torch.Tensor, ...]:
    """fn, base, scale, norm_weight with the mixes O(1) (sigmoid/softmax not saturated)."""
    g = torch.Generator().manual_seed(seed + 1000)
    cols = N * d
    fn = torch.randn(mixes, cols, generator=g) * (1.5 / cols**0.5)
    base = torch.randn(mixes, generator=g) * 0.5
    scale = 0.5 + torch.rand(3 if mixes > N else 1, generator=g)
    norm_weight = 1.0 + 0.2 * torch.randn(d, generator=g)
    return tuple(p.to(DEVICE) for p in (fn, base, scale, norm_weight))


def hc_pre_args(t: int, d: int, seed: int, dtype: torch.dtype) -> tuple:
    fn, base, scale, norm_weight = make_block_params(d, seed, (2 + N) * N)
    streams = make_streams(t, d, seed, dtype)
    return streams, fn, base, scale, norm_weight, ITERS, HC_EPS, NORM_EPS


@pytest.mark.parametrize("t,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_matches_reference(mhc, t, d, dtype):
    args = hc_pre_args(t, d, seed=t * 1000 + d, dtype=dtype)
    got = mhc.hc_pre(*args)
    ref = reference.hc_pre(*args)
    assert got[0].dtype == dtype and got[0].shape == (t, d)
    assert got[1].shape == (t, N) and got[2].shape == (t, N, N)
    assert got[1].dtype == got[2].dtype == torch.float32
    if dtype == torch.float32:
        for g, r in zip(got, ref, strict=True):
            assert_fp32_close(g, r)
        return
    ref32 = reference.hc_pre(args[0].float(), *args[1:])
    for g, rb, rf in zip(got, ref, ref32, strict=True):
        assert_bf16_close(g, rb, rf)


@pytest.mark.parametrize("t,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_matches_reference(mhc, t, d, dtype):
    fn, base, scale, norm_weight = make_block_params(d, seed=t + d, mixes=N)
    streams = make_streams(t, d, seed=t + d, dtype=dtype)
    args = (fn, base, scale, HC_EPS, NORM_EPS, norm_weight)
    got = mhc.hc_head(streams, *args)
    ref = reference.hc_head(streams, *args)
    assert got.dtype == dtype and got.shape == (t, d)
    if dtype == torch.float32:
        assert_fp32_close(got, ref)
    else:
        assert_bf16_close(got, ref, reference.hc_head(streams.float(), *args))


@pytest.mark.parametrize("t,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_matches_reference(mhc, t, d, dtype):
    args = hc_pre_args(t, d, seed=t * 7 + d, dtype=dtype)
    streams = args[0]
    _, post, comb = reference.hc_pre(*args)
    g = torch.Generator().manual_seed(t + d)
    block_out = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    got = mhc.hc_post(streams, block_out, post, comb)
    ref = reference.hc_post(streams, block_out, post, comb)
    assert got.dtype == dtype and got.shape == (t, N, d)
    if dtype == torch.float32:
        assert_fp32_close(got, ref)
    else:
        ref32 = reference.hc_post(streams.float(), block_out.float(), post, comb)
        assert_bf16_close(got, ref, ref32)


@pytest.mark.parametrize("t,d", [(1, 64), (3, 320), (37, 256), (130, 64), (130, 320)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_pre_matches_reference(mhc, t, d, dtype):
    """The expand fused into the next pre: new streams, then x, post, comb on them."""
    args = hc_pre_args(t, d, seed=t * 3 + d, dtype=dtype)
    streams = args[0]
    _, post, comb = reference.hc_pre(*args)
    nxt = make_block_params(d, seed=t * 5 + d, mixes=(2 + N) * N)
    g = torch.Generator().manual_seed(t + 2 * d)
    block_out = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    call = (streams, block_out, post, comb, *nxt, ITERS, HC_EPS, NORM_EPS)
    got = mhc.hc_post_pre(*call)
    ref = reference.hc_post_pre(*call)
    assert [g.shape for g in got] == [r.shape for r in ref]
    assert [g.dtype for g in got] == [r.dtype for r in ref]
    if dtype == torch.float32:
        for g, r in zip(got, ref, strict=True):
            assert_fp32_close(g, r)
        return
    # bf16: the new streams are rounded once (the reference rounds comb, each product and
    # the sum), so the pre half is checked on the kernel's own streams: two bf16 pipelines
    # that differ by one rounding of their input cannot be held to 2x each other's error.
    assert_bf16_close(got[0], ref[0], reference.hc_post(streams.float(), *call[1:4]))
    pre_bf16 = reference.hc_pre(got[0], *call[4:])
    pre_fp32 = reference.hc_pre(got[0].float(), *call[4:])
    for g, rb, rf in zip(got[1:], pre_bf16, pre_fp32, strict=True):
        assert_bf16_close(g, rb, rf)


def gpu_like_tiling(mhc, finish_block_t: int, gemv: bool = False, fused: bool = False) -> object:
    """Few tokens per finish/post program (1 on the GPU), many K1 splits (more than one
    BLOCK_S step of K2's reduction at D=320), D looped in chunks by K2; gemv: K1 with one
    token per program and FMA row sums (the GPU default for T <= 4); fused: with gemv, K1 and
    K2 in one launch."""
    return mhc.Tiling(
        gemm_block_t=16,
        gemm_block_d=8,
        gemm_programs=64,
        gemm_warps=4,
        gemm_precision="ieee",
        finish_block_t=finish_block_t,
        finish_block_d=64,
        finish_warps=4,
        post_block_t=finish_block_t,
        post_block_d=128,
        post_warps=4,
        gemm_gemv=gemv,
        fused=fused,
    )


@pytest.mark.parametrize(
    "t,d,finish_block_t,gemv,fused",
    [
        (3, 320, 1, False, False),
        (19, 64, 4, False, False),
        (3, 320, 1, True, False),
        (3, 320, 1, True, True),
        (1, 64, 1, True, True),
    ],
)
def test_gpu_like_tiling_matches_reference(mhc, t, d, finish_block_t, gemv, fused):
    tiling = gpu_like_tiling(mhc, finish_block_t, gemv, fused)
    args = hc_pre_args(t, d, seed=5, dtype=torch.float32)
    x, post, comb = mhc.hc_pre(*args, tiling=tiling)
    for g, r in zip((x, post, comb), reference.hc_pre(*args), strict=True):
        assert_fp32_close(g, r)
    streams, fn, base, scale, norm_weight = args[:5]
    head_fn = fn[:N]
    head = mhc.hc_head(
        streams, head_fn, base[:N], scale[:1], HC_EPS, NORM_EPS, norm_weight, tiling=tiling
    )
    ref = reference.hc_head(streams, head_fn, base[:N], scale[:1], HC_EPS, NORM_EPS, norm_weight)
    assert_fp32_close(head, ref)
    block_out = torch.randn(t, d, device=DEVICE)
    got = mhc.hc_post(streams, block_out, post, comb, tiling=tiling)
    assert_fp32_close(got, reference.hc_post(streams, block_out, post, comb))
    call = (streams, block_out, post, comb, fn, base, scale, norm_weight, ITERS, HC_EPS, NORM_EPS)
    got = mhc.hc_post_pre(*call, tiling=tiling)
    for g, r in zip(got, reference.hc_post_pre(*call), strict=True):
        assert_fp32_close(g, r)


@pytest.mark.parametrize("t,fused", [(1, False), (2, False), (1, True), (3, True)])
def test_gemv_k1_bf16_matches_reference(mhc, mhc_launch, t, fused):
    """The T <= 4 GPU path (one token per K1 program; fused: K1 + K2 in one launch) on bf16
    streams, hc_pre and the fused hc_post_pre, with the bf16 rule; the fused launch leaves
    its arrival counters at zero (the next call, or graph replay, starts from them)."""
    tiling = gpu_like_tiling(mhc, 1, gemv=True, fused=fused)
    args = hc_pre_args(t, 256, seed=40 + t, dtype=torch.bfloat16)
    got = mhc.hc_pre(*args, tiling=tiling)
    refs = reference.hc_pre(*args), reference.hc_pre(*as_fp32(args))
    for g, rb, rf in zip(got, *refs, strict=True):
        assert_bf16_close(g, rb, rf)
    streams = args[0]
    block_out = torch.randn(t, 256, device=DEVICE).bfloat16()
    call = (streams, block_out, got[1], got[2], *args[1:])
    new = mhc.hc_post_pre(*call, tiling=tiling)
    assert_bf16_close(new[0], reference.hc_post(*call[:4]), reference.hc_post(*as_fp32(call[:4])))
    refs = reference.hc_pre(new[0], *args[1:]), reference.hc_pre(new[0].float(), *args[1:])
    for g, rb, rf in zip(new[1:], *refs, strict=True):
        assert_bf16_close(g, rb, rf)
    if fused:
        assert not arrivals("mhc", streams.device).any()  # keyed by the tensors' device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,gemv,fused", [(1, True, False), (3, False, False), (2, True, True)])
def test_comb_beside_equals_one_finish_launch(mhc, dtype, t, gemv, fused):
    """``Tiling.comb_beside`` (K2 as pre + the collapse, then post + comb in a launch of its
    own; fused: K1 + the first half in one launch) gives the one-launch K2's outputs
    bitwise, for hc_pre and hc_post_pre (which reads the first's post and comb). Outside a
    CUDA-graph capture both launches run on the current stream; the captured side stream
    (and the head's join) is the GPU test's."""
    one = gpu_like_tiling(mhc, 1, gemv=gemv, fused=fused)
    split = dataclasses.replace(one, comb_beside=True)
    args = hc_pre_args(t, 64, seed=70 + t, dtype=dtype)
    block_out = torch.randn(t, 64, device=DEVICE).to(dtype)
    outs = []
    for tiling in (one, split):
        x, post, comb = mhc.hc_pre(*args, tiling=tiling)
        call = (args[0], block_out + x, post, comb, *args[1:])
        outs.append((x, post, comb, *mhc.hc_post_pre(*call, tiling=tiling)))
    for a, b in zip(*outs, strict=True):
        assert not b.isnan().any()
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("per_stream", [False, True])
def test_post_apart_equals_the_fused_prologue(mhc, dtype, slots, per_stream):
    """``Tiling.post_apart`` (the streams expanded by hc_post's kernel, then K1 on them: the
    default from ``POST_APART_MIN_TOKENS`` tokens) gives hc_post_pre's outputs, with a plain
    block output and with a fused MoE's unsummed slots. The streams bitwise under the
    interpreter; on a GPU the two kernels' compiled arithmetic may round apart (seen
    2026-12-02), so within fp32 rounding of the streams there. x, post and comb within
    rounding everywhere: the apart K1 is the flat one (``Tiling.gemm_flat``), whose splits
    sum the products in another order. ``per_stream``: the fused prologue a stream at a
    time (``Tiling.expand_per_stream``), one pipelining stage."""
    t, d, k, e = 5, 256, 3, 8
    args = hc_pre_args(t, d, seed=61, dtype=dtype)
    _, post, comb = reference.hc_pre(*args)
    g = torch.Generator().manual_seed(62)
    if slots:
        ids = torch.randint(0, e + 1, (t, k), generator=g)  # e: an unrouted slot
        rows = torch.randn(t * k, d, generator=g).to(DEVICE)
        block_out = reference.ExpertSlots(rows, ids.to(DEVICE), e, dtype)
    else:
        block_out = torch.randn(t, d, generator=g).to(device=DEVICE, dtype=dtype)
    call = (args[0], block_out, post, comb, *args[1:])
    fused = gpu_like_tiling(mhc, 2)
    if per_stream:
        fused = dataclasses.replace(fused, expand_per_stream=True, gemm_stages=1)
    apart = dataclasses.replace(fused, post_apart=True)
    want, got = mhc.hc_post_pre(*call, tiling=fused), mhc.hc_post_pre(*call, tiling=apart)
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # one rounding of the streams
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if DEVICE == "cuda" or i > 0:
            torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol)
        else:
            assert torch.equal(a, b)


def test_split_bf16x3_carries_fn_to_fp32_precision(mhc):
    """The pieces' sum is fn within 2^-24 |fn| (the reference), and the one-launch kernel
    gives the reference's pieces bitwise (its output starts as NaN)."""
    fn = make_block_params(256, seed=80, mixes=(2 + N) * N)[0]
    fn[0, :3] = torch.tensor([1e-30, -3e5, 0.0])  # tiny, large and zero weights too
    pieces = reference.split_bf16x3(fn)
    assert pieces.shape == (3, *fn.shape) and pieces.dtype == torch.bfloat16
    assert torch.equal(mhc.split_bf16x3(fn), pieces)
    total = pieces.double().sum(0)
    assert ((total - fn.double()).abs() <= 2.0**-24 * fn.double().abs()).all()
    assert (pieces[1].float().abs() <= 2.0**-8 * fn.abs()).all()  # each piece the rest's


@pytest.mark.parametrize("t,d", [(21, 256), (5, 320)])
def test_bf16x3_k1_has_fp32_accuracy(mhc, t, d):
    """``gemm_precision="bf16x3"``: K1's dots of the bf16 streams against fn's three bf16
    pieces give the mixes of the fp32 GEMM of the same values, so post and comb meet the
    fp32 tolerance against the fp32 reference on the bf16 streams' values (the bf16 rule
    allows far more), x the bf16 rule; hc_head, and hc_post_pre with K1's fused expand.
    Under the interpreter the dots run in fp32 on the pieces' values (the same products)."""
    tiling = dataclasses.replace(gpu_like_tiling(mhc, 1), gemm_precision="bf16x3")
    args = hc_pre_args(t, d, seed=81 + t, dtype=torch.bfloat16)
    streams, fn, base, scale, norm_weight = args[:5]
    x, post, comb = mhc.hc_pre(*args, tiling=tiling)
    ref32 = reference.hc_pre(streams.float(), *args[1:])
    assert_fp32_close(post, ref32[1])
    assert_fp32_close(comb, ref32[2])
    assert_bf16_close(x, reference.hc_pre(*args)[0], ref32[0])
    head = (fn[:N], base[:N], scale[:1], HC_EPS, NORM_EPS, norm_weight)
    assert_bf16_close(
        mhc.hc_head(streams, *head, tiling=tiling),
        reference.hc_head(streams, *head),
        reference.hc_head(streams.float(), *head),
    )
    block_out = torch.randn(t, d, device=DEVICE).bfloat16()
    new, _, post2, comb2 = mhc.hc_post_pre(streams, block_out, post, comb, *args[1:], tiling=tiling)
    assert torch.equal(new, mhc.hc_post(streams, block_out, post, comb, tiling=tiling))
    ref32 = reference.hc_pre(new.float(), *args[1:])
    assert_fp32_close(post2, ref32[1])
    assert_fp32_close(comb2, ref32[2])
    with pytest.raises(ValueError, match=r"bf16x3.*needs bf16 streams"):
        mhc.hc_pre(streams.float(), *args[1:], tiling=tiling)
    # the expand-fused K1 takes expand_precision: "ieee" serves fp32 streams there
    fp32_call = (streams.float(), block_out.float(), post, comb, *args[1:])
    got = mhc.hc_post_pre(*fp32_call, tiling=dataclasses.replace(tiling, expand_precision="ieee"))
    for g, r in zip(got, reference.hc_post_pre(*fp32_call), strict=True):
        assert_fp32_close(g, r)
    with pytest.raises(ValueError, match="gemm_gemv=False"):
        mhc.hc_pre(*args, tiling=dataclasses.replace(tiling, gemm_gemv=True))


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("precision", ["ieee", "bf16x3"])
def test_flat_and_3d_k1_match_reference(mhc, flat, precision):
    """K1 without the expand (hc_pre, hc_head) in both layouts: the streams as [T, N*D]
    rows in 2D tiles (``gemm_flat``, splits of N*D columns that start mid-stream here) or
    in [T, N, D] tiles; fp32 streams with the "ieee" dot, bf16 ones with "bf16x3"."""
    dtype = torch.float32 if precision == "ieee" else torch.bfloat16
    tiling = dataclasses.replace(
        gpu_like_tiling(mhc, 1), gemm_flat=flat, gemm_precision=precision, gemm_programs=15
    )
    args = hc_pre_args(21, 320, seed=90, dtype=dtype)
    streams, fn, base, scale, norm_weight = args[:5]
    got = mhc.hc_pre(*args, tiling=tiling)
    head = (fn[:N], base[:N], scale[:1], HC_EPS, NORM_EPS, norm_weight)
    got_head = mhc.hc_head(streams, *head, tiling=tiling)
    ref32 = reference.hc_pre(streams.float(), *args[1:])
    for g, r in zip(got[1:], ref32[1:], strict=True):  # post, comb: fp32 accuracy either way
        assert_fp32_close(g, r)
    if dtype == torch.float32:
        assert_fp32_close(got[0], ref32[0])
        assert_fp32_close(got_head, reference.hc_head(streams, *head))
    else:
        assert_bf16_close(got[0], reference.hc_pre(*args)[0], ref32[0])
        want = reference.hc_head(streams, *head), reference.hc_head(streams.float(), *head)
        assert_bf16_close(got_head, *want)


def test_fn_pieces_split_once_per_weight(mhc_launch):
    """The bf16x3 K1 splits fn once and keeps the pieces on fn; a write to fn in place
    splits it again; the pieces are ``split_bf16x3``'s."""
    fn = make_block_params(64, seed=91, mixes=(2 + N) * N)[0]
    first = mhc_launch._fn_pieces(fn)
    assert torch.equal(first, reference.split_bf16x3(fn))
    assert mhc_launch._fn_pieces(fn) is first
    fn.mul_(0.5)
    again = mhc_launch._fn_pieces(fn)
    assert again is not first and torch.equal(again, reference.split_bf16x3(fn))
    with torch.inference_mode():
        frozen = fn.clone()
    assert torch.equal(mhc_launch._fn_pieces(frozen), reference.split_bf16x3(frozen))


def assert_same_sums(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise on the interpreter. On a GPU the mixes' sums run in another order (a token
    a thread against a token across a program's threads; measured on the H200 at
    2026-12-02: fp32 outputs apart by a few ulps, bf16 x by one bf16 ulp in 669 of 33.5M
    elements at 8192 x 4096): fp32 within 1e-5 of the largest value, bf16 within one ulp."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if DEVICE == "cpu":
        assert torch.equal(a, b)
        return
    diff = (a.float() - b.float()).abs()
    if a.dtype == torch.bfloat16:  # one ulp of x is at most 2^-7 |x|
        assert (diff <= 2.0**-7 * torch.maximum(a.float().abs(), b.float().abs())).all()
    else:
        assert (diff <= 1e-5 * a.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d,mixes_block_t", [(21, 256, 16), (5, 320, 32), (1, 64, 16)])
def test_mixes_apart_equals_one_finish_launch(mhc, t, d, mixes_block_t, dtype):
    """``Tiling.mixes_block_t`` (K2 as a mixes launch of many tokens a program, storing pre,
    then a collapse launch reading it) gives hc_pre's, hc_head's and hc_post_pre's outputs:
    the same per-token arithmetic in two programs instead of one, bitwise on the
    interpreter (``assert_same_sums`` on a GPU). Token counts leave a partial mixes tile
    (21 of 32, 5 of 32, 1 of 16), D = 320 loops the collapse over D (two passes), and the
    outputs start as NaN."""
    one = gpu_like_tiling(mhc, 1)
    two = dataclasses.replace(one, mixes_block_t=mixes_block_t)
    args = hc_pre_args(t, d, seed=70 + t, dtype=dtype)
    want, got = mhc.hc_pre(*args, tiling=one), mhc.hc_pre(*args, tiling=two)
    for a, b in zip(want, got, strict=True):
        assert_same_sums(a, b)
    if dtype == torch.float32:
        for g, r in zip(got, reference.hc_pre(*args), strict=True):
            assert_fp32_close(g, r)
    streams, fn, base, scale, norm_weight = args[:5]
    head = (streams, fn[:N], base[:N], scale[:1], HC_EPS, NORM_EPS, norm_weight)
    assert_same_sums(mhc.hc_head(*head, tiling=one), mhc.hc_head(*head, tiling=two))
    block_out = torch.randn(t, d, device=DEVICE).to(dtype)
    call = (streams, block_out, want[1], want[2], *args[1:])
    for a, b in zip(
        mhc.hc_post_pre(*call, tiling=one), mhc.hc_post_pre(*call, tiling=two), strict=True
    ):
        assert_same_sums(a, b)


@pytest.mark.parametrize(
    "t,dtype,tiling",
    [
        (3, torch.bfloat16, None),
        (37, torch.float32, None),
        (3, torch.bfloat16, "gpu"),
        (1, torch.bfloat16, "gemv"),
        (3, torch.bfloat16, "fused"),
    ],
)
def test_expert_slots_summed_on_load(mhc, t, dtype, tiling):
    """``hc_post`` / ``hc_post_pre`` given a fused MoE's unsummed slots (``ExpertSlots``:
    k fp32 rows a token, unrouted ids adding nothing) equal the same calls on the summed
    output bitwise: the sum is the MoE's own (slot order, fp32, one rounding), moved into
    the mHC's first kernel."""
    d, k, e = 256, 3, 8
    tiling = (
        None
        if tiling is None
        else gpu_like_tiling(mhc, 1, gemv=tiling in ("gemv", "fused"), fused=tiling == "fused")
    )
    args = hc_pre_args(t, d, seed=60 + t, dtype=dtype)
    streams = args[0]
    _, post, comb = reference.hc_pre(*args)
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(0, e + 2, (t, k), generator=g).to(DEVICE)  # ids e, e + 1: unrouted
    rows = torch.randn(t * k, d, generator=g).to(DEVICE)
    rows[(ids.view(-1) >= e).nonzero()] = float("nan")  # an unrouted slot is never read
    slots = reference.ExpertSlots(rows, ids, e, dtype)
    summed = slots.sum()
    assert not summed.isnan().any()
    got = mhc.hc_post(streams, slots, post, comb, tiling=tiling)
    assert torch.equal(got, mhc.hc_post(streams, summed, post, comb, tiling=tiling))
    nxt = (*args[1:5], ITERS, HC_EPS, NORM_EPS)
    got = mhc.hc_post_pre(streams, slots, post, comb, *nxt, tiling=tiling)
    want = mhc.hc_post_pre(streams, summed, post, comb, *nxt, tiling=tiling)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        reference.hc_post(streams, slots, post, comb),
        reference.hc_post(streams, summed, post, comb),
    )


def test_slots_expand_apart_from_slots_apart_min_tokens(mhc):
    """From ``SLOTS_APART_MIN_TOKENS`` tokens, hc_post_pre on a fused MoE's slots with the
    default tiling expands the streams in hc_post's kernel first (``post_apart``): the same
    outputs as that tiling given explicitly, and the reference's under the bf16 rule."""
    t, d, k, e = mhc.SLOTS_APART_MIN_TOKENS, 64, 3, 8
    args = hc_pre_args(t, d, seed=95, dtype=torch.bfloat16)
    streams = args[0]
    _, post, comb = reference.hc_pre(*args)
    g = torch.Generator().manual_seed(96)
    ids = torch.randint(0, e, (t, k), generator=g).to(DEVICE)
    slots = reference.ExpertSlots(
        torch.randn(t * k, d, generator=g).to(DEVICE), ids, e, args[0].dtype
    )
    call = (streams, slots, post, comb, *args[1:])
    got = mhc.hc_post_pre(*call)
    base = mhc.default_tiling(t, N, d, streams.device, streams.dtype)
    apart = mhc.hc_post_pre(*call, tiling=dataclasses.replace(base, post_apart=True))
    for a, b in zip(got, apart, strict=True):
        assert torch.equal(a, b)
    summed = slots.sum()
    want = reference.hc_post(streams, summed, post, comb)
    assert_bf16_close(got[0], want, reference.hc_post(*as_fp32((streams, summed, post, comb))))


def test_strided_streams_and_determinism(mhc):
    """A non-contiguous view gives the contiguous result, and repeated calls are bitwise equal."""
    args = hc_pre_args(37, 256, seed=3, dtype=torch.bfloat16)
    wide = torch.zeros(37, N, 300, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :, :256] = args[0]
    first = mhc.hc_pre(wide[:, :, :256], *args[1:])
    second = mhc.hc_pre(*args)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_empty_batch(mhc):
    args = hc_pre_args(0, 64, seed=0, dtype=torch.float32)
    x, post, comb = mhc.hc_pre(*args)
    assert x.shape == (0, 64) and post.shape == (0, N) and comb.shape == (0, N, N)
    assert mhc.hc_post(args[0], x, post, comb).shape == (0, N, 64)


def test_bad_input_raises_clear_errors(mhc):
    streams, fn, base, scale, norm_weight = hc_pre_args(3, 64, seed=0, dtype=torch.float32)[:5]
    with pytest.raises(ValueError, match="fn must have shape"):
        mhc.hc_pre(streams, fn[:, :-1], base, scale, norm_weight, ITERS, HC_EPS, NORM_EPS)
    with pytest.raises(ValueError, match="streams must be"):
        mhc.hc_pre(streams[0], fn, base, scale, norm_weight, ITERS, HC_EPS, NORM_EPS)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        mhc.hc_pre(streams, fn, base, scale, norm_weight, 0, HC_EPS, NORM_EPS)
    with pytest.raises(ValueError, match="dtype"):
        mhc.hc_pre(streams.double(), fn, base, scale, norm_weight, ITERS, HC_EPS, NORM_EPS)
    with pytest.raises(ValueError, match="block_out"):
        post, comb = torch.ones(3, N), torch.ones(3, N, N)
        mhc.hc_post(streams, streams[:, 0].bfloat16(), post, comb)
    with pytest.raises(ValueError, match="comb must have shape"):
        mhc.hc_post(streams, streams[:, 0], post, comb[:, :, :2])
    with pytest.raises(ValueError, match="post must have shape"):  # post, comb on the CPU
        mhc.hc_post_pre(streams, streams[:, 0], post[:2], comb, *args_tail(fn, base, scale))
    with pytest.raises(ValueError, match="scale must have shape"):
        mhc.hc_head(streams, fn[:N], base[:N], scale, HC_EPS, NORM_EPS, norm_weight)


def args_tail(fn, base, scale) -> tuple:
    """fn, base, scale, norm_weight, iters, eps of a block whose shapes are right for D=64."""
    return fn, base, scale, torch.ones(64, device=DEVICE), ITERS, HC_EPS, NORM_EPS


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 64, 256, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "bf16x3"])
def test_v4_flash_sizes_on_gpu(mhc, t, dtype, precision):
    """V4-Flash shapes (N=4, D=4096) with the GPU tiling; the same tolerances ("bf16x3":
    bf16 streams only, with a dot K1 at every T)."""
    if precision == "bf16x3" and dtype != torch.bfloat16:
        pytest.skip("bf16x3 dots take bf16 streams")
    d = 4096
    tiling = mhc.default_tiling(t, N, d, torch.device(DEVICE))
    tiling = dataclasses.replace(tiling, gemm_precision=precision)
    if precision == "bf16x3":
        tiling = dataclasses.replace(tiling, gemm_gemv=False, fused=False)
    args = hc_pre_args(t, d, seed=t, dtype=dtype)
    streams, fn, base, scale, norm_weight = args[:5]
    head_args = (fn[:N], base[:N], scale[:1], HC_EPS, NORM_EPS, norm_weight)
    block_out = torch.randn(t, d, device=DEVICE).to(dtype)
    got = mhc.hc_pre(*args, tiling=tiling)
    got_post = mhc.hc_post(streams, block_out, got[1], got[2], tiling=tiling)
    got_head = mhc.hc_head(streams, *head_args, tiling=tiling)
    post_pre_args = (streams, block_out, got[1], got[2], *args[1:])
    got_post_pre = mhc.hc_post_pre(*post_pre_args, tiling=tiling)
    ref = reference.hc_pre(*args)
    ref_post = reference.hc_post(streams, block_out, got[1], got[2])
    ref_head = reference.hc_head(streams, *head_args)
    if dtype == torch.float32:
        for g, r in zip((*got, got_post, got_head), (*ref, ref_post, ref_head), strict=True):
            assert_fp32_close(g, r)
        for g, r in zip(got_post_pre, reference.hc_post_pre(*post_pre_args), strict=True):
            assert_fp32_close(g, r)
        return
    ref32 = reference.hc_pre(streams.float(), *args[1:])
    for g, rb, rf in zip(got, ref, ref32, strict=True):
        assert_bf16_close(g, rb, rf)
    post32 = reference.hc_post(streams.float(), block_out.float(), got[1], got[2])
    assert_bf16_close(got_post, ref_post, post32)
    assert_bf16_close(got_head, ref_head, reference.hc_head(streams.float(), *head_args))
    assert_bf16_close(got_post_pre[0], ref_post, post32)
    pre_bf16 = reference.hc_pre(got_post_pre[0], *args[1:])
    pre_fp32 = reference.hc_pre(got_post_pre[0].float(), *args[1:])
    for g, rb, rf in zip(got_post_pre[1:], pre_bf16, pre_fp32, strict=True):
        assert_bf16_close(g, rb, rf)


def _expand_cases() -> list[tuple[int, str | None]]:
    from rackserve.ops.triton import mhc

    cases = [(t, None) for t in (2048, 8192)]
    cases += [(64, name) for name in mhc.EXPAND_K1_DECODE]
    return cases + [(t, name) for t in (2048, 8192) for name in mhc.EXPAND_K1_PREFILL]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t, candidate", _expand_cases())
def test_fused_prologue_at_prefill_sizes_on_gpu(mhc, t, candidate):
    """hc_post_pre with the expand in K1's prologue (``post_apart`` off; timed in session
    30: ~10 ms slower at 8192 tokens, so only small steps take it; or a candidate of
    ``mhc.EXPAND_K1_*``) within the bf16 rules of the references, and within one rounding
    of the streams of the outputs of the apart expand."""
    d = 4096
    args = hc_pre_args(t, d, seed=t + 1, dtype=torch.bfloat16)
    streams = args[0]
    _, post, comb = mhc.hc_pre(*args)
    block_out = torch.randn(t, d, device=DEVICE).bfloat16()
    call = (streams, block_out, post, comb, *args[1:])
    default = mhc.default_tiling(t, N, d, torch.device(DEVICE), torch.bfloat16)
    want = mhc.hc_post_pre(*call, tiling=dataclasses.replace(default, post_apart=True))
    fused = dataclasses.replace(default, post_apart=False)
    if candidate is not None:
        every = mhc.EXPAND_K1_DECODE | mhc.EXPAND_K1_PREFILL
        fused = mhc.expand_k1_tiling(default, every[candidate])
    got = mhc.hc_post_pre(*call, tiling=fused)
    post32 = reference.hc_post(streams.float(), block_out.float(), post, comb)
    assert_bf16_close(got[0], reference.hc_post(streams, block_out, post, comb), post32)
    pre_bf16 = reference.hc_pre(got[0], *args[1:])
    pre_fp32 = reference.hc_pre(got[0].float(), *args[1:])
    for g, rb, rf in zip(got[1:], pre_bf16, pre_fp32, strict=True):
        assert_bf16_close(g, rb, rf)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_is_bitwise_equal_to_eager(mhc):
    """Captured once, replayed on new inputs copied into the static buffers."""
    t, d = 64, 4096
    args = hc_pre_args(t, d, seed=1, dtype=torch.bfloat16)
    streams, params = args[0].clone(), args[1:]
    block_out = torch.randn(t, d, device=DEVICE).bfloat16()

    def step():
        x, post, comb = mhc.hc_pre(streams, *params)
        new, x, post, comb = mhc.hc_post_pre(streams, block_out + x, post, comb, *params)
        return mhc.hc_post(new, x, post, comb)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    streams.copy_(make_streams(t, d, seed=2, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t,fused", [(1, False), (64, False), (1, True), (4, True)])
def test_comb_beside_in_a_captured_step(mhc, mhc_launch, t, fused):
    """``Tiling.comb_beside`` in CUDA-graph capture: post and comb on the side stream, joined
    by the next block's mHC and by the head (the capture would fail on an unjoined fork);
    replay bitwise equal to eager (the same two launches in series) and to the one-launch
    K2 (fused: K1 + K2 in one launch, with comb_beside K1 + pre and x); nothing left
    pending after the capture."""
    d = 4096
    one = mhc.default_tiling(t, N, d, torch.device(DEVICE), torch.bfloat16)
    one = dataclasses.replace(one, comb_beside=False, fused=fused)
    split = dataclasses.replace(one, comb_beside=True)
    args = hc_pre_args(t, d, seed=t + 7, dtype=torch.bfloat16)
    streams, params = args[0].clone(), args[1:]
    head_params = (params[0][:N], params[1][:N], params[2][:1], HC_EPS, NORM_EPS, params[3])
    block_out = torch.randn(t, d, device=DEVICE).bfloat16()

    def step(tiling):
        x, post, comb = mhc.hc_pre(streams, *params, tiling=tiling)
        new, x2, post, comb = mhc.hc_post_pre(
            streams, block_out + x, post, comb, *params, tiling=tiling
        )
        new = mhc.hc_post(new, x2, post, comb, tiling=tiling)
        return new, mhc.hc_head(new, *head_params, tiling=tiling)

    step(one), step(split)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(split)
    assert not mhc_launch._BESIDE_PENDING
    for seed in (2, 3):
        streams.copy_(make_streams(t, d, seed=seed, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        eager, one_launch = step(split), step(one)
        for a, b, c in zip(out, eager, one_launch, strict=True):
            assert torch.equal(a, b)
            assert torch.equal(a, c)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 3, 4])
def test_fused_launch_on_gpu(mhc, mhc_launch, t):
    """The one-launch K1 + K2 (its counters and release / acquire ordering only run for real
    on a GPU): bf16 rule against the reference, counters back at zero, and CUDA-graph replay
    (twice: the counters must be reset by the first) bitwise equal to eager."""
    import dataclasses

    d = 4096
    tiling = dataclasses.replace(mhc.default_tiling(t, N, d, torch.device(DEVICE)), fused=True)
    assert tiling.gemm_gemv
    args = hc_pre_args(t, d, seed=t, dtype=torch.bfloat16)
    streams, params = args[0].clone(), args[1:]
    block_out = torch.randn(t, d, device=DEVICE).bfloat16()
    got = mhc.hc_pre(*args, tiling=tiling)
    refs = reference.hc_pre(*args), reference.hc_pre(*as_fp32(args))
    for g, rb, rf in zip(got, *refs, strict=True):
        assert_bf16_close(g, rb, rf)
    assert not arrivals("mhc", streams.device).any()

    def step():
        x, post, comb = mhc.hc_pre(streams, *params, tiling=tiling)
        new, x, post, comb = mhc.hc_post_pre(
            streams, block_out + x, post, comb, *params, tiling=tiling
        )
        head = mhc.hc_head(new, params[0][:N], params[1][:N], params[2][:1], HC_EPS, NORM_EPS,
                           params[3], tiling=tiling)  # fmt: skip
        return x + head

    step()  # compile and allocate the counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (2, 3):
        streams.copy_(make_streams(t, d, seed=seed, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
    assert not arrivals("mhc", streams.device).any()
