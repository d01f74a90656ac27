"""The fused window-compression kernel (``ops/triton/compress.py``) against
``reference.compress_pool``: HCA (non-overlapping) and CSA (overlapping, with window -1 of
entry 0 missing) windows read through paged state slots, fp32 and bf16, outputs poisoned.
Tolerances as GPU_FASTPATH.md section 5 (bf16: plus one ulp, see below)."""

from __future__ import annotations

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE


def _case(seed: int, ratio: int, overlap: bool, width: int, n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    row = 2 * width if overlap else width
    span = 2 * ratio if overlap else ratio
    extra = 64  # other columns of the state rows (another compressor's), must be skipped
    col = extra if seed % 2 else 0
    num_slots = 3 * n * span + 7
    state = torch.randn(num_slots, col + 2 * row + extra, generator=g) * 2
    src = torch.randperm(num_slots, generator=g)[: n * span].view(n, span)
    missing = None
    if overlap:  # entry 0 of a request: window -1 does not exist
        missing = torch.zeros(n, span, dtype=torch.bool)
        missing[::3, :ratio] = True
        state[src[::3, :ratio]] = float("nan")  # garbage there must not leak
    ape = torch.randn(ratio, row, generator=g)
    norm_weight = 1 + 0.2 * torch.randn(width, generator=g)
    positions = torch.randint(0, 5000, (n,), generator=g) * ratio
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    args = [state.to(dtype), src, missing, col, ape, norm_weight, 1e-6, positions, inv_freq, 0.9]
    return [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]


CASES = [
    (seed, ratio, overlap, width, n)
    for seed, (ratio, overlap, width, n) in enumerate(
        [
            (4, True, 64, 1),
            (4, True, 64, 9),
            (4, True, 32, 5),
            (16, False, 64, 1),
            (16, False, 64, 6),
            (4, False, 32, 3),
            (8, True, 48, 4),
            (128, False, 64, 2),
            (2, True, 16, 7),
            (16, False, 128, 2),
        ]
    )
]


@pytest.mark.parametrize("seed,ratio,overlap,width,n", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_pool_matches_reference(seed, ratio, overlap, width, n, dtype, monkeypatch):
    from rackserve.ops.triton import compress

    args = _case(seed, ratio, overlap, width, n, dtype)
    real_empty = torch.empty
    monkeypatch.setattr(
        compress.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
    )
    got = compress.compress_pool(*args)
    assert not got.isnan().any(), "unwritten or leaked NaN"
    fp32 = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref32 = reference.compress_pool(*fp32).float()
    if dtype == torch.float32:
        rel = (got - ref32).abs().max() / ref32.abs().max()
        assert rel.item() <= 1e-4, rel.item()
    else:
        ref16 = reference.compress_pool(*args).float()
        err = (got.float() - ref32).abs()
        # the section-5 rule, plus one bf16 ulp: the kernel pools in fp32 where the
        # reference multiplies in bf16, so where the reference's rounding errors cancel by
        # chance the kernel's own final rounding (half an ulp) is not within 2x of it
        ulp = 2.0**-7 * ref32.abs()
        allowed = 2 * (ref16 - ref32).abs() + ulp + 1e-3 * ref32.abs().max()
        assert (err > allowed).float().mean().item() <= 1e-3


def test_no_windows_is_empty():
    from rackserve.ops.triton import compress

    args = _case(0, 4, True, 32, 1, torch.float32)
    args[1], args[2], args[7] = args[1][:0], args[2][:0], args[7][:0]
    assert compress.compress_pool(*args).shape == (0, 32)


# compress_entries: both compressors of a CSA layer (kv width W at state column 0, the
# indexer's width Wi after its rows) or one (HCA) in one launch, into the entry cache at
# dst slots (the null slot 0 shared by the padded candidates of a graph step)
ENTRY_CASES = [
    (seed, ratio, overlap, widths, n)
    for seed, (ratio, overlap, widths, n) in enumerate(
        [
            (4, True, (64, 32), 1),
            (4, True, (64, 32), 9),
            (4, True, (32, 16), 5),
            (2, True, (48, 32), 7),
            (8, True, (64, 64), 3),
            (4, True, (128, 32), 2),
            (4, True, (64,), 4),
            (16, False, (64,), 1),
            (16, False, (64,), 6),
            (4, False, (32,), 3),
            (128, False, (64,), 2),
            (16, False, (128,), 5),
        ]
    )
]


def _entries_case(seed, ratio, overlap, widths, n, dtype):
    g = torch.Generator().manual_seed(1000 + seed)
    span = 2 * ratio if overlap else ratio
    rows = [2 * w if overlap else w for w in widths]
    num_slots = 3 * n * span + 7
    state = torch.randn(num_slots, sum(2 * r for r in rows), generator=g) * 2
    src = torch.randperm(num_slots, generator=g)[: n * span].view(n, span)
    missing = None
    if overlap:
        missing = torch.zeros(n, span, dtype=torch.bool)
        missing[::3, :ratio] = True
        state[src[::3, :ratio]] = float("nan")
    parts, col, out_col = [], 0, 0
    for w, r in zip(widths, rows, strict=True):
        ape = torch.randn(ratio, r, generator=g)
        norm_weight = 1 + 0.2 * torch.randn(w, generator=g)
        parts.append((col, ape.to(DEVICE), norm_weight.to(DEVICE), out_col))
        col, out_col = col + 2 * r, out_col + w
    num_entries = 2 * n + 5
    dst = 1 + torch.randperm(num_entries - 1, generator=g)[:n]
    if n > 2:
        dst[-2:] = 0  # padded candidates: both into the null slot
    positions = torch.randint(0, 5000, (n,), generator=g) * ratio
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    entries = torch.full((num_entries, out_col), float("nan"), dtype=dtype)
    move = lambda a: a.to(DEVICE) if isinstance(a, torch.Tensor) else a  # noqa: E731
    return [
        move(a)
        for a in (state.to(dtype), src, missing, dst, entries, parts, 1e-6, positions,
                  inv_freq, 0.9)
    ]  # fmt: skip


@pytest.mark.parametrize("seed,ratio,overlap,widths,n", ENTRY_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_entries_matches_reference(seed, ratio, overlap, widths, n, dtype):
    from rackserve.ops.triton import compress

    args = _entries_case(seed, ratio, overlap, widths, n, dtype)
    ref_args = list(args)
    ref_args[4] = args[4].clone()
    compress.compress_entries(*args)
    reference.compress_entries(*ref_args)
    got, ref = args[4], ref_args[4]
    real = args[3] != 0  # the null slot's content is unspecified (several writers)
    dst = args[3][real]
    assert not got[dst].isnan().any(), "unwritten entries"
    untouched = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    untouched[dst] = False
    # the null slot is skipped (no reads for the padded candidates of a graph step)
    assert got[untouched].isnan().all(), "wrote outside the dst slots"
    if dtype == torch.float32:
        rel = (got[dst] - ref[dst]).abs().max() / ref[dst].abs().max()
        assert rel.item() <= 1e-4, rel.item()
    else:  # the kernel is compress_pool's: its bf16 check runs above; here bit-equal
        # against compress_pool of the same kernel (parts written where they belong)
        for col, ape, norm_weight, out_col in args[5]:
            one = compress.compress_pool(
                args[0], args[1], args[2], col, ape, norm_weight, *args[6:]
            )[real]
            assert torch.equal(got[dst, out_col : out_col + norm_weight.shape[0]], one)


def test_compress_entries_rejects_bad_input():
    from rackserve.ops.triton import compress

    args = _entries_case(0, 4, True, (64, 32), 3, torch.float32)
    bad = list(args)
    bad[4] = args[4][:, :70]  # too narrow for both parts
    with pytest.raises(ValueError, match="entry width"):
        compress.compress_entries(*bad)
    bad = list(args)
    bad[3] = args[3][:2]
    with pytest.raises(ValueError, match="dst"):
        compress.compress_entries(*bad)
