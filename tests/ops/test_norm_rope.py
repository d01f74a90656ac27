"""The RMSNorm / RoPE kernels (``ops/triton/norm_rope.py``) against their references.

CPU runs use the Triton interpreter at small shapes: x [T, C] and [T, H, C] (attention's q
and kv, the indexer q, compressor entries), C in {64, 96, 320} (non powers of two too),
rope widths R in {0+, 16, 64, C}, T in {1, 5, 33}; views with strides; cos/sin in x's
dtype and in fp32; the inverse rope (-sin). Outputs start as NaN (unwritten elements
fail). fp32: relative error <= 1e-4; bf16: |kernel - ref_fp32| <= 2 |ref_bf16 - ref_fp32|
+ 1e-3 for >= 99.9% of the elements, where ref_fp32 runs the reference on fp32 copies.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE

EPS = 1e-6


@pytest.fixture(scope="module")
def norm_rope():
    # the root conftest chose the interpreter (no GPU) before anything imported Triton
    return importlib.import_module("rackserve.ops.triton.norm_rope")


@pytest.fixture(autouse=True)
def nan_outputs(norm_rope, monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(norm_rope, "_new_output", empty)


def make_x(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of unequal scale with an outlier channel, as activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    x[..., 3] *= 10.0
    return x.to(DEVICE, dtype)


def make_cos_sin(t: int, half: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed + 7)
    positions = torch.randint(0, 100_000, (t,), generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half) / half))
    cos, sin = reference.rope_cos_sin(positions, inv_freq, 1.3, dtype)
    return cos.to(DEVICE), sin.to(DEVICE)


def assert_close(got: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert not got.isnan().any(), "unwritten (NaN) elements"
    if got.dtype == torch.float32:
        floor = ref.pow(2).mean().sqrt().clamp_min(1e-30)
        rel = (got - ref).abs() / torch.maximum(ref.abs(), floor)
        assert rel.max().item() <= 1e-4, rel.max().item()
        return
    err = (got.float() - ref32).abs()
    allowed = 2 * (ref.float() - ref32).abs() + 1e-3
    violations = (err > allowed).float().mean().item()
    assert violations <= 1e-3, f"{violations:.4%} of elements out of tolerance"


CASES = [  # (x shape, rope half-width)
    ((1, 64), 8),
    ((5, 320), 32),
    ((33, 96), 48),  # rope over every channel
    ((1, 4, 64), 8),
    ((5, 8, 320), 32),
    ((33, 3, 96), 8),
    ((7, 16, 64), 32),
    ((2, 2, 2, 64), 16),
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("shape,half", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_rms_norm_matches_reference(norm_rope, shape, half, dtype, weighted):
    del half
    x = make_x(shape, seed=sum(shape), dtype=dtype)
    g = torch.Generator().manual_seed(len(shape))
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(DEVICE) if weighted else None
    got = norm_rope.rms_norm(x, weight, EPS)
    assert_close(
        got, reference.rms_norm(x, weight, EPS), reference.rms_norm(x.float(), weight, EPS)
    )


@pytest.mark.parametrize("shape,half", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_matches_reference(norm_rope, shape, half, dtype, inverse):
    x = make_x(shape, seed=sum(shape) + 1, dtype=dtype)
    cos, sin = make_cos_sin(shape[0], half, seed=sum(shape), dtype=dtype)
    sin = -sin if inverse else sin
    got = norm_rope.apply_rope(x, cos, sin)
    ref32 = reference.apply_rope(x.float(), cos.float(), sin.float())
    assert_close(got, reference.apply_rope(x, cos, sin), ref32)
    nope = shape[-1] - 2 * half
    assert torch.equal(got[..., :nope], x[..., :nope])  # passed through bit for bit


@pytest.mark.parametrize("shape,half", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_rms_norm_rope_matches_reference(norm_rope, shape, half, dtype, weighted):
    x = make_x(shape, seed=sum(shape) + 2, dtype=dtype)
    cos, sin = make_cos_sin(shape[0], half, seed=len(shape), dtype=dtype)
    g = torch.Generator().manual_seed(half)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(DEVICE) if weighted else None
    got = norm_rope.rms_norm_rope(x, weight, EPS, cos, sin)
    ref = reference.rms_norm_rope(x, weight, EPS, cos, sin)
    ref32 = reference.rms_norm_rope(x.float(), weight, EPS, cos.float(), sin.float())
    assert_close(got, ref, ref32)


def test_bf16_matches_unfused_bits(norm_rope):
    """The roundings follow the reference's: bf16 results equal the reference's bits on
    (nearly) every element, not just within the tolerance."""
    x = make_x((9, 8, 320), seed=1, dtype=torch.bfloat16)
    cos, sin = make_cos_sin(9, 32, seed=1, dtype=torch.bfloat16)
    got = norm_rope.rms_norm_rope(x, None, EPS, cos, sin)
    ref = reference.rms_norm_rope(x, None, EPS, cos, sin)
    assert (got != ref).float().mean().item() <= 1e-3


def test_strided_views_and_fp32_tables(norm_rope):
    """A head slice of a wider tensor, fp32 cos/sin with bf16 x, a strided cos."""
    wide = make_x((6, 5, 200), seed=3, dtype=torch.bfloat16)
    x = wide[:, 1:4, 40:168]  # [6, 3, 128], row strides 1000 / 200
    cos, sin = make_cos_sin(6, 32, seed=3, dtype=torch.float32)
    cos_wide = torch.zeros(6, 64, device=DEVICE)
    cos_wide[:, ::2] = cos
    got = norm_rope.rms_norm_rope(x, None, EPS, cos_wide[:, ::2], sin)
    ref = reference.rms_norm_rope(x, None, EPS, cos, sin)
    ref32 = reference.rms_norm_rope(x.float(), None, EPS, cos, sin)
    assert_close(got, ref, ref32)
    assert_close(norm_rope.apply_rope(x, cos, sin), reference.apply_rope(x, cos, sin),
                 reference.apply_rope(x.float(), cos, sin))  # fmt: skip


def test_empty_and_bad_input(norm_rope):
    cos, sin = make_cos_sin(0, 8, seed=0, dtype=torch.float32)
    x = torch.zeros(0, 4, 64, device=DEVICE)
    assert norm_rope.rms_norm_rope(x, None, EPS, cos, sin).shape == (0, 4, 64)
    x = make_x((3, 64), seed=0, dtype=torch.float32)
    cos, sin = make_cos_sin(3, 8, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="cos, sin must be"):
        norm_rope.apply_rope(x, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="cos, sin must be"):
        norm_rope.apply_rope(x[:, :8], cos, sin)
    with pytest.raises(ValueError, match="weight must be"):
        norm_rope.rms_norm(x, torch.ones(63, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="dtype"):
        norm_rope.rms_norm(x.int(), None, EPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("t", [1, 64, 8192])
def test_v4_flash_sizes_on_gpu(norm_rope, t):
    x = make_x((t, 64, 512), seed=t, dtype=torch.bfloat16)
    cos, sin = make_cos_sin(t, 32, seed=t, dtype=torch.bfloat16)
    got = norm_rope.rms_norm_rope(x, None, EPS, cos, sin)
    ref = reference.rms_norm_rope(x, None, EPS, cos, sin)
    assert_close(got, ref, reference.rms_norm_rope(x.float(), None, EPS, cos, sin))
    kv = make_x((t, 512), seed=t + 1, dtype=torch.bfloat16)
    w = torch.rand(512, device=DEVICE) + 0.5
    got = norm_rope.rms_norm_rope(kv, w, EPS, cos, sin)
    ref = reference.rms_norm_rope(kv, w, EPS, cos, sin)
    assert_close(got, ref, reference.rms_norm_rope(kv.float(), w, EPS, cos, sin))


# kv_insert: the kv row normed + roped straight into its window slot, the compressor's raw
# rows (a column slice of a wider projection output) copied into their state slots
INSERT_CASES = [  # (T, C, rope half, state row width or 0, padded tokens)
    (1, 64, 8, 0, 0),
    (1, 64, 8, 96, 0),
    (5, 320, 32, 640, 2),
    (33, 96, 48, 0, 3),
    (2, 64, 16, 2560, 1),
    (17, 128, 32, 256, 4),
    (8, 64, 8, 40, 0),
    (3, 96, 16, 1030, 1),
    (64, 64, 32, 128, 16),
    (12, 320, 8, 0, 5),
]


@pytest.mark.parametrize("t,c,half,width,padded", INSERT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_insert_matches_reference(norm_rope, t, c, half, width, padded, dtype):
    g = torch.Generator().manual_seed(t * 7 + c + width)
    y = make_x((t, 5 + c + width + 3), seed=t + c, dtype=dtype)  # the fused projection
    kv, rows = y[:, 5 : 5 + c], (y[:, 5 + c : 5 + c + width] if width else None)
    weight = (1 + 0.3 * torch.randn(c, generator=g)).to(DEVICE)
    cos, sin = make_cos_sin(t, half, seed=t, dtype=dtype)
    num = 2 * t + 3
    swa = torch.full((num, c), float("nan"), dtype=dtype, device=DEVICE)
    swa_slots = (1 + torch.randperm(num - 1, generator=g)[:t]).to(DEVICE)
    state = state_slots = None
    if width:
        state = torch.full((num, width), float("nan"), dtype=dtype, device=DEVICE)
        state_slots = (1 + torch.randperm(num - 1, generator=g)[:t]).to(DEVICE)
    if padded:  # padded tokens of a graph step all write the null slot 0
        swa_slots[-padded:] = 0
        if width:
            state_slots[-padded:] = 0
    ref_swa = swa.clone()
    ref_state = state.clone() if width else None
    norm_rope.kv_insert(kv, weight, EPS, cos, sin, swa, swa_slots, rows, state, state_slots)
    reference.kv_insert(kv, weight, EPS, cos, sin, ref_swa, swa_slots, rows, ref_state,
                        state_slots)  # fmt: skip
    real = slice(0, t - padded)
    expected32 = reference.rms_norm_rope(kv.float(), weight, EPS, cos.float(), sin.float())
    assert_close(swa[swa_slots[real]], ref_swa[swa_slots[real]], expected32[real])
    untouched = torch.ones(num, dtype=torch.bool, device=DEVICE)
    untouched[swa_slots] = False
    assert swa[untouched].isnan().all(), "wrote outside the window slots"
    if width:
        got = state[state_slots[real]]
        assert torch.equal(got, rows[real]), "state rows are copied exactly"
        untouched = torch.ones(num, dtype=torch.bool, device=DEVICE)
        untouched[state_slots] = False
        assert state[untouched].isnan().all(), "wrote outside the state slots"


def test_kv_insert_rejects_bad_input(norm_rope):
    kv = make_x((3, 64), seed=0, dtype=torch.float32)
    cos, sin = make_cos_sin(3, 8, seed=0, dtype=torch.float32)
    weight = torch.ones(64, device=DEVICE)
    swa = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        norm_rope.kv_insert(kv, weight, EPS, cos, sin, swa, slots)
    with pytest.raises(ValueError, match="swa_slots"):
        norm_rope.kv_insert(kv, weight, EPS, cos, sin, swa.float(), slots[:2])


@pytest.mark.parametrize("t", [1, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cos_sin_matches_reference(norm_rope, t, dtype):
    """The step's RoPE tables (one launch): positions up to 1M, a yarn-style scale."""
    g = torch.Generator().manual_seed(t)
    positions = torch.randint(0, 2**20, (t,), generator=g).to(DEVICE)
    positions[0] = 0
    inv_freq = (1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)).to(DEVICE)
    cos, sin = norm_rope.rope_cos_sin(positions, inv_freq, 0.75, dtype)
    ref_cos, ref_sin = reference.rope_cos_sin(positions, inv_freq, 0.75, dtype)
    assert cos.dtype == dtype and cos.shape == (t, 32)
    # the same fp32 angle; cos / sin of it within a few ulp (libdevice on a GPU, the
    # interpreter's numpy on the CPU), then one rounding to dtype
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(cos.float(), ref_cos.float(), rtol=0, atol=tol)
    torch.testing.assert_close(sin.float(), ref_sin.float(), rtol=0, atol=tol)
    empty = norm_rope.rope_cos_sin(positions[:0], inv_freq, 1.0, dtype)
    assert empty[0].shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rope_cos_sin_equals_torch_on_gpu(norm_rope):
    """libdevice's cosf / sinf against torch's on the GPU, 4096 positions up to 1M: the
    fast path's tables should be the reference's (fp32 and bf16 both)."""
    positions = torch.randint(0, 2**20, (4096,), device="cuda")
    inv_freq = (1.0 / 160000 ** (torch.arange(0, 64, 2) / 64)).cuda()
    for dtype in (torch.float32, torch.bfloat16):
        got = norm_rope.rope_cos_sin(positions, inv_freq, 1.0, dtype)
        ref = reference.rope_cos_sin(positions, inv_freq, 1.0, dtype)
        for a, b in zip(got, ref, strict=True):
            diff = (a.float() - b.float()).abs().max().item()
            assert diff <= (2e-7 if dtype == torch.float32 else 0.0), (dtype, diff)
