"""The grouped MoE's elementwise kernels (``ops/triton/prefill_moe.py``: ``moe_permute``,
``swiglu_rows``, ``moe_unpermute``) against their references, under the Triton interpreter
on CPU.

Outputs start as NaN (an unwritten element fails). Shapes: ragged row counts (1, 7, 33,
130), widths that are not powers of two, k in {1, 2, 6}, gates beyond the clamp limit.
The A/B tilings (``PermuteTiling``, ``SwigluTiling``) at small blocks: token and column
counts that are not multiples of theirs, k in {1, 2, 5, 7}; each bit for bit the default's
output (unpermute's vector slots sum in the loop kernel's order).
Tolerances (GPU_FASTPATH.md section 5): fp32 within 1e-4 relative; bf16 |kernel -
ref_fp32| <= 2 |ref_bf16 - ref_fp32| + 1e-3 for >= 99.9%.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE, assert_bf16_close, assert_fp32_close


@pytest.fixture(scope="module")
def moe():
    return importlib.import_module("rackserve.ops.triton.prefill_moe")


@pytest.fixture(autouse=True)
def nan_outputs(moe, monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(moe, "_empty", empty)


def check(got: torch.Tensor, fn, *args) -> None:
    """``got`` against ``fn`` on the same inputs (fp32 rule) or on bf16 and fp32 copies."""
    ref = fn(*args)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if got.dtype == torch.float32:
        assert_fp32_close(got, ref)
    else:
        as32 = [
            a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
        ]
        assert_bf16_close(got, ref, fn(*as32).float())


@pytest.mark.parametrize("n,inter", list(itertools.product((1, 7, 33, 130), (24, 96, 1100))))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_rows(moe, n, inter, dtype):
    g = torch.Generator().manual_seed(n * inter)
    h = (6 * torch.randn(n, 2 * inter, generator=g)).to(dtype).to(DEVICE)  # past the limit
    check(moe.swiglu_rows(h, 7.0), reference.swiglu_rows, h, 7.0)


def test_swiglu_rows_strided_input_and_matches_swiglu(moe):
    """A row-strided h; in fp32 the result equals ``reference.swiglu`` of the halves."""
    wide = torch.randn(5, 80, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    h = wide[:, :64]
    got = moe.swiglu_rows(h, 3.0)
    assert_fp32_close(got, reference.swiglu(h[:, :32], h[:, 32:], 3.0))


@pytest.mark.parametrize("t,k,dim", [(1, 1, 64), (7, 2, 96), (33, 6, 200), (130, 6, 2100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_unpermute(moe, t, k, dim, dtype):
    g = torch.Generator().manual_seed(t * k + dim)
    y = torch.randn(t * k, dim, generator=g).to(dtype).to(DEVICE)
    inverse = torch.randperm(t * k, generator=g).view(t, k).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    check(moe.moe_unpermute(y, inverse, weights), reference.moe_unpermute, y, inverse, weights)


@pytest.mark.parametrize("t,k,dim", [(1, 1, 64), (33, 6, 200), (130, 6, 2100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_unpermute_extra(moe, t, k, dim, dtype):
    """A [T, D] extra output (the shared expert run apart) is the last slot, weight 1: the
    same as an extra row of y with that weight."""
    g = torch.Generator().manual_seed(t * k + dim + 1)
    y = torch.randn(t * k, dim, generator=g).to(dtype).to(DEVICE)
    extra = torch.randn(t, dim, generator=g).to(dtype).to(DEVICE)
    inverse = torch.randperm(t * k, generator=g).view(t, k).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    got = moe.moe_unpermute(y, inverse, weights, extra)
    check(got, reference.moe_unpermute, y, inverse, weights, extra)
    folded = reference.moe_unpermute(
        torch.cat([y, extra]),
        torch.cat([inverse, t * k + torch.arange(t, device=DEVICE)[:, None]], dim=1),
        torch.cat([weights, torch.ones(t, 1, device=DEVICE)], dim=1),
    )
    assert torch.equal(reference.moe_unpermute(y, inverse, weights, extra), folded)
    if dtype == torch.float32:
        assert_fp32_close(got, folded)
    with pytest.raises(ValueError, match="extra must be"):
        moe.moe_unpermute(y, inverse, weights, extra[:, :-1])


def test_moe_unpermute_int32_inverse_and_bad_input(moe):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(12, 32, generator=g).to(DEVICE)
    inverse = torch.randperm(12, generator=g).view(4, 3).to(DEVICE)
    weights = torch.rand(4, 3, generator=g).to(DEVICE)
    expected = reference.moe_unpermute(y, inverse, weights)
    assert_fp32_close(moe.moe_unpermute(y, inverse.int(), weights), expected)
    with pytest.raises(ValueError, match="weights must be"):
        moe.moe_unpermute(y, inverse, weights[:, :2])
    with pytest.raises(ValueError, match="inverse must be"):
        moe.moe_unpermute(y, inverse.float(), weights)
    with pytest.raises(ValueError, match="h must be"):
        moe.swiglu_rows(y[:, :31], 7.0)


@pytest.mark.parametrize("t,k,dim", [(1, 1, 64), (7, 2, 96), (33, 6, 200), (130, 7, 2100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_permute(moe, t, k, dim, dtype):
    """Every sorted row is its token's row, exactly (a copy): the layout of the gather by
    ``moe_sort_pairs``' token of each row."""
    g = torch.Generator().manual_seed(t * k + dim)
    x = torch.randn(t, dim, generator=g).to(dtype).to(DEVICE)
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(t)])
    token, inverse, _ = reference.moe_sort_pairs(ids, 8)
    got = moe.moe_permute(x, inverse.to(DEVICE))
    assert got.dtype == dtype and torch.equal(got.cpu(), reference.moe_permute(x, inverse).cpu())
    assert torch.equal(got.cpu(), x.cpu().index_select(0, token.long()))


def test_moe_permute_strided_x_and_bad_input(moe):
    wide = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x, inverse = wide[:, :32], torch.randperm(12).view(6, 2).to(DEVICE)
    assert torch.equal(moe.moe_permute(x, inverse.int()), reference.moe_permute(x, inverse))
    with pytest.raises(ValueError, match="inverse must be"):
        moe.moe_permute(x, inverse[:5])
    with pytest.raises(ValueError, match="x must be"):
        moe.moe_permute(x.long(), inverse)


def permute_tilings(moe) -> list:
    """Small-block tilings of every kind: vector slots at 1, 2 and 4 tokens a program, the
    loop kernel in another shape."""
    tile = moe.PermuteTiling
    return [tile(64, 1, True, 2), tile(128, 2, True, 4), tile(64, 4, True, 1), tile(32, 1)]


def pairs_case(t: int, k: int, dim: int, dtype: torch.dtype, seed: int) -> tuple:
    """y [T k, D], inverse [T, k] (a permutation of the rows), weights [T, k], extra [T, D]."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(t * k, dim, generator=g).to(dtype).to(DEVICE)
    inverse = torch.randperm(t * k, generator=g).view(t, k).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    extra = torch.randn(t, dim, generator=g).to(dtype).to(DEVICE)
    return y, inverse, weights, extra


TILING_SHAPES = [(1, 1, 64), (7, 5, 200), (13, 7, 100), (9, 2, 96)]


@pytest.mark.parametrize("t,k,dim", TILING_SHAPES)
def test_moe_permute_tilings(moe, t, k, dim):
    _, inverse, _, x = pairs_case(t, k, dim, torch.bfloat16, t * k + dim)  # x: [T, D]
    want = reference.moe_permute(x, inverse)
    for tiling in permute_tilings(moe):
        got = moe.moe_permute(x, inverse.int(), tiling=tiling)
        assert torch.equal(got, want), tiling


@pytest.mark.parametrize("t,k,dim", TILING_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_unpermute_tilings(moe, t, k, dim, dtype):
    """Every tiling, with and without extra, against the reference and bit for bit the
    default (the slots in the same order, fp32, extra last)."""
    y, inverse, weights, extra = pairs_case(t, k, dim, dtype, t * k + dim + 2)
    for ex in (None, extra):
        default = moe.moe_unpermute(y, inverse, weights, ex)
        for tiling in permute_tilings(moe):
            got = moe.moe_unpermute(y, inverse, weights, ex, tiling=tiling)
            assert torch.equal(got, default), tiling
        check(default, reference.moe_unpermute, y, inverse, weights, ex)


@pytest.mark.parametrize("n,inter", [(1, 24), (19, 96), (37, 200)])
def test_swiglu_rows_tilings(moe, n, inter):
    g = torch.Generator().manual_seed(n + inter)
    h = (6 * torch.randn(n, 2 * inter, generator=g)).bfloat16().to(DEVICE)
    default = moe.swiglu_rows(h, 7.0)
    check(default, reference.swiglu_rows, h, 7.0)
    tile = moe.SwigluTiling
    for tiling in (tile(8, 64, 4), tile(16, 32, 2), tile(2, 256, 8), tile(1, 16, 1)):
        assert torch.equal(moe.swiglu_rows(h, 7.0, tiling=tiling), default), tiling


def test_tiling_bad_input(moe):
    y, inverse, weights, x = pairs_case(4, 3, 32, torch.float32, 0)
    with pytest.raises(ValueError, match="block_t > 1 needs vector_slots"):
        moe.moe_permute(x, inverse, tiling=moe.PermuteTiling(32, 2))
    with pytest.raises(ValueError, match="block_t > 1 needs vector_slots"):
        moe.moe_unpermute(y, inverse, weights, tiling=moe.PermuteTiling(32, 2))


@pytest.mark.gpu
def test_ab_tilings_at_model_shapes(moe):
    """The benchmark's candidates (``PERMUTE_TILINGS`` etc.) at D 4096, I 2048, k 5, bf16
    (T not a multiple of BLOCK_T): each bit for bit the default's output."""
    t, k, dim, inter = 1001, 5, 4096, 2048
    y, inverse, weights, extra = pairs_case(t, k, dim, torch.bfloat16, 3)
    x = extra  # any [T, D]
    rows = moe.moe_permute(x, inverse)
    assert torch.equal(rows, reference.moe_permute(x, inverse))
    for name, tiling in moe.PERMUTE_TILINGS.items():
        assert torch.equal(moe.moe_permute(x, inverse, tiling=tiling), rows), name
    for ex in (None, extra):
        default = moe.moe_unpermute(y, inverse, weights, ex)
        check(default, reference.moe_unpermute, y, inverse, weights, ex)
        for name, tiling in moe.UNPERMUTE_TILINGS.items():
            got = moe.moe_unpermute(y, inverse, weights, ex, tiling=tiling)
            assert torch.equal(got, default), name
    h = (6 * torch.randn(t * k, 2 * inter, device=DEVICE)).bfloat16()
    default = moe.swiglu_rows(h, 10.0)
    for name, tiling in moe.SWIGLU_TILINGS.items():
        assert torch.equal(moe.swiglu_rows(h, 10.0, tiling=tiling), default), name


# compiles the vector-slot kernels for sm_90 (no GPU: Triton's bundled ptxas) in a process
# without the interpreter; prints, per kernel, its shared memory and its PTX's local memory
# (arrays LLVM could not keep in registers), fp32 adds and fmas
_COMPILE_SM90 = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rackserve.ops.triton import prefill_moe as m

def report(fn, consts, warps):
    names = list(fn.arg_names)
    types = {"inverse_ptr": "*i32", "w_ptr": "*fp32"}
    sig = {n: "constexpr" if n in consts else types.get(n, "*bf16" if n.endswith("_ptr")
           else "i32") for n in names}
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride") or n == "dim"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, "local": ptx.count(".local"),
            "adds": ptx.count("add.f32"), "fmas": ptx.count("fma.rn.f32")}

slots = {"K": 5, "K_PAD": 8, "BLOCK_D": 1024}
print(json.dumps({
    "permute": report(m.permute_slots_kernel, slots | {"BLOCK_T": 2}, 4),
    "unpermute": report(m.unpermute_slots_kernel, slots | {"BLOCK_T": 1, "HAS_EXTRA": True}, 4),
}))
"""


def test_slot_kernels_compile_for_sm90():
    """At the model's shapes (k 5, D 4096, 1024 columns, 4 warps: 8 columns a thread) the
    vector-slot kernels compile with no shared or local memory, and unpermute's slot picks
    fold away: 5 fma a column (the loop kernel's acc += w * y, contracted) and 1 add
    (extra)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["permute"]["shared"] == 0 and report["permute"]["local"] == 0
    unpermute = report["unpermute"]
    assert unpermute["shared"] == 0 and unpermute["local"] == 0
    assert unpermute["fmas"] == 5 * 8 and unpermute["adds"] == 8, unpermute


def test_empty(moe):
    assert moe.swiglu_rows(torch.zeros(0, 8, device=DEVICE), 7.0).shape == (0, 4)
    empty = torch.zeros(0, 2, dtype=torch.long, device=DEVICE)
    out = moe.moe_unpermute(torch.zeros(0, 8, device=DEVICE), empty, empty.float())
    assert out.shape == (0, 8)
    assert moe.moe_permute(torch.zeros(0, 8, device=DEVICE), empty).shape == (0, 8)
    vector = moe.PermuteTiling(8, 2, True, 1)
    assert moe.moe_permute(torch.zeros(0, 8, device=DEVICE), empty, tiling=vector).shape == (0, 8)


@pytest.mark.parametrize(
    "t,k,e", [(1, 1, 4), (5, 3, 8), (300, 7, 65), (1000, 6, 256), (37, 2, 3), (2100, 6, 64)]
)
def test_moe_sort_pairs(moe, t, k, e):
    """The counting sort equals the stable argsort layout exactly, across many segments
    (300 x 7 pairs: 9 segments of 256; 2100 x 6: 50, read 16 at a time by each program)
    and experts that get no pairs (e = 256)."""
    g = torch.Generator().manual_seed(t * k + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if e == 3:  # skewed: most pairs on expert 1
        ids[: t // 2, 0] = 1
        ids[: t // 2, 1] = 2
    got = moe.moe_sort_pairs(ids.to(DEVICE), e)
    ref = reference.moe_sort_pairs(ids, e)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == torch.int32 and torch.equal(a.cpu(), b)


def test_moe_sort_pairs_no_tokens(moe):
    token, inverse, ends = moe.moe_sort_pairs(torch.zeros(0, 6, dtype=torch.int64).to(DEVICE), 8)
    assert (
        token.shape == (0,)
        and inverse.shape == (0, 6)
        and torch.equal(ends.cpu(), torch.zeros(8, dtype=torch.int32))
    )
