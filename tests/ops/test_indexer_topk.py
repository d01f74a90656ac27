"""The radix top-k (``ops/triton/topk.py``) against ``torch.topk`` of the packed keys and
against the bitonic kernel it stands in for (``select_topk.select_topk_kernel``): the same ids
in the same order, the same slots and validity when it selects.

CPU runs use the Triton interpreter on packed rows built in torch
(``reference.packed_earliest``). Each case mixes row kinds, one per query: distinct
logits, heavy ties (three values: the packed keys break them to the earliest entry), half
the entries -inf (masked), fewer finite entries than k (the k-th key is -inf and ties),
all 0.0 / -0.0, all -inf, and logits over the whole fp32 range of both signs. Outputs come
poisoned (the int64 maximum, which would sort first), so any element the kernel leaves
unwritten, or any work slot it reads before writing, shows.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from test_indexer import make_case

from rackserve.ops import reference

from kernel_checks import DEVICE

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning"),
    pytest.mark.usefixtures("poisoned_indexer_outputs"),  # conftest.py
]

ROW_KINDS = ("distinct", "ties", "masked", "few_finite", "zeros", "all_inf", "wide")


def row_scores(kind: str, e: int, k: int, g: torch.Generator) -> torch.Tensor:
    """One row of E fp32 logits of the given kind."""
    if kind == "distinct":
        return torch.randn(e, generator=g)
    if kind == "ties":
        return torch.randint(0, 3, (e,), generator=g).float() * 0.5
    if kind == "masked":
        x = torch.randn(e, generator=g)
        return x.masked_fill(torch.rand(e, generator=g) < 0.5, float("-inf"))
    if kind == "few_finite":
        x = torch.full((e,), float("-inf"))
        finite = torch.randperm(e, generator=g)[: int(torch.randint(0, k, (1,), generator=g))]
        x[finite] = torch.randn(finite.numel(), generator=g)
        return x
    if kind == "zeros":
        return torch.where(torch.rand(e, generator=g) < 0.5, 0.0, -0.0)
    if kind == "all_inf":
        return torch.full((e,), float("-inf"))
    exponent = torch.randint(-40, 38, (e,), generator=g).float()  # "wide"
    return torch.randn(e, generator=g) * 10.0**exponent


def packed_rows(s: int, e: int, k: int, seed: int) -> torch.Tensor:
    """[S, E] packed keys, row r of kind ROW_KINDS[(seed + r) % 7]."""
    g = torch.Generator().manual_seed(seed)
    rows = [row_scores(ROW_KINDS[(seed + r) % len(ROW_KINDS)], e, k, g) for r in range(s)]
    return reference.packed_earliest(torch.stack(rows)).to(DEVICE)


def tiling(indexer_tiling, algorithm: str, limit: int, **radix):
    return indexer_tiling.IndexerTiling(
        64, 8, 4, 1, triton_select_max_entries=limit, select_algorithm=algorithm, **radix
    )


CASES = [  # (S, E, k): non-powers of two, E == k, k = E - 1, tiny rows, prefill-sized k
    (1, 16, 2),
    (7, 100, 37),
    (2, 64, 64),
    (3, 1, 1),
    (5, 3, 3),
    (4, 5, 2),
    (7, 130, 3),
    (3, 300, 64),
    (7, 48, 2),
    (2, 96, 64),
    (4, 257, 64),
    (7, 200, 3),
    (3, 65, 64),
    (2, 40, 39),
    (1, 2048, 512),
    (2, 700, 512),
    (1, 513, 512),
    (2, 1024, 512),
    (7, 33, 2),
    (3, 512, 512),
    (2, 1000, 3),
]


@pytest.mark.parametrize("s,e,k", CASES)
def test_radix_equals_torch_topk_and_bitonic(select_topk, indexer_tiling, s, e, k):
    packed = packed_rows(s, e, k, seed=s * 7919 + e + k)
    radix = select_topk.topk_packed(packed, k, tiling(indexer_tiling, "radix", e))
    expected = packed.topk(k, dim=-1).indices
    assert torch.equal(radix, expected)
    assert torch.equal(
        radix, select_topk.topk_packed(packed, k, tiling(indexer_tiling, "bitonic", e))
    )


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("s,e,k", [(7, 300, 64), (3, 90, 2), (7, 64, 64)])
def test_histogram_digits_equal_counted_bits(select_topk, indexer_tiling, bits, s, e, k):
    """tl.histogram passes of 4 to 8 bits (the last overlapping the one before) give the
    answer of one counted bit a pass."""
    packed = packed_rows(s, e, k, seed=bits + e)
    got = select_topk.topk_packed(packed, k, tiling(indexer_tiling, "radix", e, radix_bits=bits))
    assert torch.equal(got, packed.topk(k, dim=-1).indices)


def test_all_ties_and_fewer_finite_than_k_pick_the_earliest(select_topk, indexer_tiling):
    """Rows of one value, and rows whose k-th key is -inf: the picks are the finite ones,
    best first, then the earliest -inf entries in entry order."""
    scores = torch.full((3, 40), float("-inf"))
    scores[0] = 1.5
    scores[1, [3, 17, 30]] = torch.tensor([0.5, 2.0, 0.5])
    packed = reference.packed_earliest(scores).to(DEVICE)
    got = select_topk.topk_packed(packed, 6, tiling(indexer_tiling, "radix", 40)).cpu()
    assert got[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert got[1].tolist() == [17, 3, 30, 0, 1, 2]
    assert got[2].tolist() == [0, 1, 2, 3, 4, 5]


def poison_selection(select_topk, monkeypatch) -> None:
    """Selection outputs filled with garbage (the slots' dtype maximum, validity bytes 7)."""
    sel = importlib.import_module("rackserve.ops.triton.select")
    outputs = sel.selection_outputs

    def poisoned(*args):
        out_slots, valid = outputs(*args)
        out_slots.fill_(torch.iinfo(out_slots.dtype).max)
        return out_slots, valid.view(torch.uint8).fill_(7).view(torch.bool)

    monkeypatch.setattr(select_topk, "selection_outputs", poisoned)
    monkeypatch.setattr(sel, "selection_outputs", poisoned)


@pytest.mark.parametrize("slots_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("s,e,k,w", [(7, 90, 32, 8), (3, 64, 64, 5), (4, 130, 2, 16)])
def test_radix_select_mode(select_topk, indexer_tiling, monkeypatch, slots_dtype, s, e, k, w):
    """SELECT: the picks' slots and the [window | picks] validity, equal to selecting the
    torch.topk picks apart and to the bitonic kernel's. int64 slots: the picks' keys wait
    in the slots output; int32: in a workspace (poisoned too)."""
    poison_selection(select_topk, monkeypatch)
    packed = packed_rows(s, e, k, seed=e + k + w)
    g = torch.Generator().manual_seed(w)
    slots = torch.stack([torch.randperm(4 * e, generator=g)[:e] for _ in range(s)])
    slots = slots.to(DEVICE, slots_dtype)
    num_visible = torch.randint(0, e + 1, (s,), generator=g).to(DEVICE)
    window = (torch.rand(s, w, generator=g) < 0.7).to(DEVICE)
    args = (packed, k, slots, num_visible, window)
    got = select_topk.select_packed(*args, tiling(indexer_tiling, "radix", e))
    want = reference.select_entries(packed.topk(k, dim=-1).indices, slots, num_visible, window)
    bitonic = select_topk.select_packed(*args, tiling(indexer_tiling, "bitonic", e))
    for a, b, c in zip(got, want, bitonic, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))


def test_paged_indexer_with_radix_tiling_matches_reference(
    indexer, select_topk, indexer_tiling, monkeypatch
):
    """The whole op (logits, then the radix level selecting) on the indexer tests' paged
    cases, zero keys (ties) and fewer visible entries than k included."""
    poison_selection(select_topk, monkeypatch)
    case = make_case(4, 90, 16, 32, seed=5, dtype=torch.bfloat16, zero_frac=0.5)
    case["num_visible"] = torch.tensor([90, 7, 0, 31], device=DEVICE)
    t = tiling(indexer_tiling, "radix", 90)
    got = indexer.paged_indexer_topk(**case, k=32, tiling=t)
    assert torch.equal(got, reference.paged_indexer_topk(**case, k=32))
    window = torch.rand(4, 6, generator=torch.Generator().manual_seed(1)) < 0.5
    window = window.to(DEVICE)
    got = indexer.paged_indexer_select(**case, k=32, window_valid=window, tiling=t)
    want = reference.paged_indexer_select(**case, k=32, window_valid=window)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_rows_over_the_limit_and_more_picks_than_entries_stay_bitonic(select_topk, indexer_tiling):
    """With the radix algorithm chosen, rows over the one-program limit still go through
    the chunk-wise (bitonic) levels, and k > E (padding picked) keeps the bitonic answer."""
    packed = packed_rows(4, 300, 20, seed=0)
    radix = dataclasses.replace(tiling(indexer_tiling, "radix", 64), select_chunk=64)
    assert torch.equal(select_topk.topk_packed(packed, 20, radix), packed.topk(20).indices)
    short = packed[:, :5]
    got = select_topk.topk_packed(short, 6, tiling(indexer_tiling, "radix", 64))
    assert torch.equal(
        got, select_topk.topk_packed(short, 6, tiling(indexer_tiling, "bitonic", 64))
    )
    assert got[:, 5].tolist() == [0x7FFFFFFF] * 4  # the padding's id, as before


def test_default_tiling_takes_radix_for_prefill_rows_only(indexer_tiling, monkeypatch):
    """GPU defaults: radix for >= 512 queries of 1024..8192 entries (every such row in one
    program); decode batches, short and long rows keep the bitonic defaults; CPU keeps
    torch.topk."""
    monkeypatch.setattr(indexer_tiling, "_num_sms", lambda device: 132)
    gpu = torch.device("cuda")
    for s, e in ((8192, 2048), (512, 1024), (2048, 8192)):
        t = indexer_tiling.default_tiling(s, e, gpu)
        assert (t.select_algorithm, t.triton_select_max_entries) == ("radix", 8192), (s, e)
    for s, e in ((256, 2048), (1, 1024), (8192, 512), (8192, 16384)):
        t = indexer_tiling.default_tiling(s, e, gpu)
        assert t.select_algorithm == "bitonic" and t.triton_select_max_entries == 2048, (s, e)
        assert (t.radix_bits, t.radix_warps, t.select_chunk) == (1, 0, 2048)
    cpu = indexer_tiling.default_tiling(8192, 2048, torch.device("cpu"))
    assert (cpu.select_algorithm, cpu.triton_select_max_entries) == ("bitonic", 0)


def test_bad_tilings_and_shapes_raise(indexer_tiling):
    topk = importlib.import_module("rackserve.ops.triton.topk")
    with pytest.raises(ValueError, match="select_algorithm='heap'"):
        tiling(indexer_tiling, "heap", 64)
    with pytest.raises(ValueError, match="radix_bits=3"):
        tiling(indexer_tiling, "radix", 64, radix_bits=3)
    with pytest.raises(ValueError, match="radix_warps=3"):
        tiling(indexer_tiling, "radix", 64, radix_warps=3)
    packed = packed_rows(1, 8, 4, seed=0)
    ids = torch.empty(1, 9, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="k=9 <= E=8"):
        topk.radix_topk(packed, ids, ids, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "s,e,k", [(8192, 2048, 512), (2048, 4096, 512), (512, 8192, 512), (600, 8000, 2048)]
)
def test_prefill_sizes_on_gpu(select_topk, indexer_tiling, s, e, k):
    """The GPU's defaults at prefill sizes (radix, 8 to 16 warps) and the other digit
    widths: ids equal to torch.topk's and the bitonic levels', selections equal too."""
    packed = packed_rows(s, e, k, seed=s + e)
    default = indexer_tiling.default_tiling(s, e, packed.device)
    assert default.select_algorithm == "radix"
    expected = packed.topk(k, dim=-1).indices
    for bits in (1, 5, 8):
        t = dataclasses.replace(default, radix_bits=bits)
        assert torch.equal(select_topk.topk_packed(packed, k, t), expected), bits
    bitonic = dataclasses.replace(
        default, select_algorithm="bitonic", triton_select_max_entries=2048
    )
    assert torch.equal(select_topk.topk_packed(packed, k, bitonic), expected)
    slots = torch.randperm(s * e, device=packed.device).view(s, e)
    num_visible = torch.randint(0, e + 1, (s,), device=packed.device)
    window = torch.rand(s, 128, device=packed.device) < 0.5
    got = select_topk.select_packed(packed, k, slots, num_visible, window, default)
    want = reference.select_entries(expected, slots, num_visible, window)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
