"""The paged indexer logits + top-k (``ops/triton/indexer.py``, its selection in
``select_topk.py``) against the reference.

CPU runs use the Triton interpreter at small shapes (Hi in {4, 16}, Di in {32, 64}, E up to
300). Keys live in a column slice of a wider cache, reached through shuffled page-like slot
lists; num_visible covers 0, below k, page boundaries and all E. Ties are frequent on
purpose (zero key rows and relu give exact 0.0 scores; negative weights give -0.0): the
selection must equal the reference's earliest-entry rule. Top-k rule (GPU_FASTPATH.md
section 5): identical ids except entries within 1e-6 (relative) of the k-th score.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE

# the interpreter converts the kernel's loaded loop bounds with a numpy call numpy deprecates
pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning"),
    pytest.mark.usefixtures("poisoned_indexer_outputs"),  # conftest.py
]

BLOCK = 16  # entries per page of the fake cache


def make_case(
    s: int, e: int, hi: int, di: int, seed: int, dtype: torch.dtype, zero_frac: float = 0.1
) -> dict:
    """Random q / cache / slots; pages of BLOCK entries scattered over a larger cache."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 2 * triton_cdiv(e, BLOCK) + 3
    width = di + 24  # the key slice is columns [8, 8 + di) of wider rows
    cache = torch.randn(num_pages * BLOCK, width, generator=g)
    zero_rows = torch.rand(num_pages * BLOCK, generator=g) < zero_frac
    cache[zero_rows] = 0.0  # exact 0.0 scores: ties resolved by entry order
    pages = torch.stack([torch.randperm(num_pages, generator=g) for _ in range(s)])
    entry = torch.arange(e)
    slots = pages[:, entry // BLOCK] * BLOCK + entry % BLOCK  # [S, E]
    num_visible = torch.randint(0, e + 1, (s,), generator=g)
    num_visible[0] = e
    if s > 2:
        num_visible[1] = 0
        num_visible[2] = min(e, BLOCK)
    weights = torch.randn(s, hi, generator=g)  # both signs: -0.0 sums occur
    return {
        "q": torch.randn(s, hi, di, generator=g).to(DEVICE, dtype),
        "key_cache": cache.to(DEVICE, dtype)[:, 8 : 8 + di],
        "slots": slots.to(DEVICE),
        "weights": weights.to(DEVICE),
        "scale": di**-0.5,
        "num_visible": num_visible.to(DEVICE),
    }


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reference_scores(case: dict) -> torch.Tensor:
    """The reference's fp32 scores [S, E] (-inf where not visible)."""
    keys = case["key_cache"][case["slots"]].float()
    scores = torch.einsum("shd,sed->she", case["q"].float(), keys).relu() * case["scale"]
    scores = (scores * case["weights"].unsqueeze(-1)).sum(dim=1)
    entry = torch.arange(keys.shape[1], device=keys.device)
    return scores.masked_fill(entry[None, :] >= case["num_visible"][:, None], float("-inf"))


def assert_same_topk(
    got: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, rel: float = 1e-6
) -> None:
    """Equal ids, except where the two picks at a position score within ``rel`` of the
    row's scale (max(|k-th score|, max |score|)) of each other: a swap of near-equal scores,
    or a near-tie at the k-th. Both orders are sorted by scores that differ by at most the
    logits' error, so the i-th picks of the two differ by at most twice that error."""
    assert got.shape == ref.shape and got.dtype == torch.int64
    if got.shape[1] == 0:
        return
    kth = scores.gather(1, ref[:, -1:]).squeeze(1)  # [S]
    finite = scores.masked_fill(~scores.isfinite(), 0.0)
    scale = torch.maximum(kth.abs().nan_to_num(0.0, 0.0, 0.0), finite.abs().amax(dim=1))
    for row in range(got.shape[0]):
        g, r = got[row], ref[row]
        if torch.equal(g, r):
            continue
        assert g.unique().numel() == g.numel(), f"query {row}: repeated ids"
        differ = g != r
        gs, rs = scores[row, g[differ]], scores[row, r[differ]]
        close = ((gs - rs).abs() <= rel * scale[row] + 1e-30) | (gs == rs)  # -inf ties
        assert close.all(), (
            f"query {row}: ids {g[differ][~close].tolist()[:8]} vs reference "
            f"{r[differ][~close].tolist()[:8]}, score gaps "
            f"{(gs - rs)[~close].abs().tolist()[:8]} > {rel} x {scale[row].item():.4g}"
        )


CASES = [  # (S, E, Hi, Di, k)
    (1, 16, 4, 32, 8),
    (1, 300, 16, 64, 64),
    (3, 64, 16, 32, 64),
    (5, 200, 4, 64, 17),
    (7, 130, 16, 32, 1),
    (2, 33, 8, 64, 0),
    (9, 96, 16, 64, 40),
    (4, 257, 16, 32, 128),
    (6, 48, 4, 32, 48),
    (2, 1, 16, 32, 1),
    (12, 80, 16, 64, 20),
]


@pytest.mark.parametrize("s,e,hi,di,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_indexer_topk_matches_reference(indexer, s, e, hi, di, k, dtype):
    case = make_case(s, e, hi, di, seed=s * 1000 + e + di, dtype=dtype)
    got = indexer.paged_indexer_topk(**case, k=k)
    ref = reference.paged_indexer_topk(**case, k=k)
    assert_same_topk(got, ref, reference_scores(case))


@pytest.mark.parametrize("s,e,hi,di", [(3, 150, 16, 64), (1, 40, 4, 32), (6, 77, 8, 32)])
def test_logits_match_reference_scores(indexer, s, e, hi, di):
    case = make_case(s, e, hi, di, seed=e, dtype=torch.float32)
    got = indexer.indexer_logits(**case)
    ref = reference_scores(case)
    assert not got.isnan().any(), "unwritten (NaN) logits"
    assert torch.equal(got.isinf(), ref.isinf())
    finite = ref.isfinite()
    floor = ref[finite].pow(2).mean().sqrt()
    rel = (got[finite] - ref[finite]).abs() / torch.maximum(ref[finite].abs(), floor)
    assert rel.max().item() <= 1e-4, rel.max().item()


def test_packed_keys_equal_topk_earliest_packing(indexer):
    """The kernel's keys order entries exactly as ``topk_earliest`` orders the logits."""
    case = make_case(4, 120, 16, 32, seed=11, dtype=torch.float32, zero_frac=0.3)
    logits = indexer.indexer_logits(**case)
    packed = indexer.indexer_logits(**case, packed=True)
    assert torch.equal(packed.topk(120).indices, reference.topk_earliest(logits, 120))


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Same -inf pattern; finite logits within ``rel`` of the row's largest |logit|."""
    assert not got.isnan().any(), "unwritten (NaN) logits"
    assert torch.equal(got.isinf(), ref.isinf())
    finite = ref.isfinite()
    scale = ref.masked_fill(~finite, 0.0).abs().amax(dim=1, keepdim=True).expand_as(ref)
    err = (got - ref).abs()[finite]
    assert (err <= rel * scale[finite] + 1e-30).all(), (err / scale[finite]).max().item()


@pytest.mark.parametrize("block_e,tiles", [(16, 1), (32, 3), (64, 16)])
def test_tilings_agree(indexer, indexer_tiling, block_e, tiles):
    """GPU-like small programs and long ones give the same logits (to rounding: tensor-core
    tiles of other shapes may sum in another order) and the same selection."""
    case = make_case(5, 210, 16, 64, seed=block_e, dtype=torch.bfloat16)
    tiling = indexer_tiling.IndexerTiling(block_e, tiles, 4, 2, triton_select_max_entries=0)
    got = indexer.indexer_logits(**case, tiling=tiling)
    base = indexer.indexer_logits(**case)
    assert_logits_close(got, base, 1e-5)
    ids = indexer.paged_indexer_topk(**case, k=50, tiling=tiling)
    assert_same_topk(ids, reference.paged_indexer_topk(**case, k=50), reference_scores(case))


@pytest.mark.parametrize(
    "s,e,k,visible",
    [(3, 100, 37, None), (2, 64, 64, None), (4, 1, 1, None), (2, 130, 1, None), (3, 90, 32, 7)],
)
def test_triton_select_matches_reference(indexer, indexer_tiling, s, e, k, visible):
    """The bitonic top-k kernel (the GPU default for E <= 2048): non-power-of-2 k and E,
    k = E, k = 1, fewer visible entries than k; half the keys zero (ties)."""
    case = make_case(s, e, 16, 32, seed=e + k, dtype=torch.bfloat16, zero_frac=0.5)
    if visible is not None:
        case["num_visible"] = torch.full((s,), visible, device=DEVICE)
    tiling = indexer_tiling.IndexerTiling(64, 8, 4, 1, triton_select_max_entries=e)
    got = indexer.paged_indexer_topk(**case, k=k, tiling=tiling)
    assert torch.equal(got, reference.paged_indexer_topk(**case, k=k))


@pytest.mark.parametrize(
    "s,e,k,limit,chunk",
    [(2, 300, 20, 64, 64), (3, 200, 1, 16, 8), (1, 130, 64, 128, 128), (2, 90, 90, 128, 16)],
)
def test_chunked_select_matches_reference(indexer, indexer_tiling, s, e, k, limit, chunk):
    """Rows longer than the one-program limit: levels of chunk-wise top-k (E=300, k=20:
    three levels), k = 1, k = E; half the keys zero (ties across chunk borders)."""
    case = make_case(s, e, 16, 32, seed=e + k, dtype=torch.bfloat16, zero_frac=0.5)
    tiling = indexer_tiling.IndexerTiling(
        64, 8, 4, 1, triton_select_max_entries=limit, select_chunk=chunk
    )
    got = indexer.paged_indexer_topk(**case, k=k, tiling=tiling)
    assert torch.equal(got, reference.paged_indexer_topk(**case, k=k))


@pytest.mark.parametrize(
    "s,e,k,w,levels",
    [
        (3, 100, 37, 8, "one"),  # one program per query, its top-k selecting
        (2, 64, 64, 5, "one"),  # k = E
        (4, 90, 32, 16, "one"),  # fewer visible entries than k (set below)
        (2, 300, 20, 3, "chunked"),  # three levels, the last one selecting
        (3, 130, 16, 8, "torch"),  # torch.topk, then select_entries
        (2, 40, 0, 4, "one"),  # no picks: the window's validity only
    ],
)
def test_indexer_select_matches_reference(
    indexer, select_topk, indexer_tiling, monkeypatch, s, e, k, w, levels
):
    """``paged_indexer_select``: the last top-k level writes the picks' slots and the
    [window | picks] validity itself (one launch fewer than top-k, then select_entries);
    equal to selecting the picks apart (on CPU also to the reference's picks). Outputs are
    poisoned: a slot or validity element left unwritten fails."""
    case = make_case(s, e, 16, 32, seed=e + k + w, dtype=torch.bfloat16, zero_frac=0.5)
    if e == 90:
        case["num_visible"] = torch.tensor([7, 0, 31, 90][:s], device=DEVICE)
    g = torch.Generator().manual_seed(w)
    window = (torch.rand(s, w, generator=g) < 0.7).to(DEVICE)
    limit, chunk = {"one": (e, 2048), "chunked": (64, 64), "torch": (0, 0)}[levels]
    tiling = indexer_tiling.IndexerTiling(
        64, 8, 4, 1, triton_select_max_entries=limit, select_chunk=chunk
    )
    sel = importlib.import_module("rackserve.ops.triton.select")
    outputs = sel.selection_outputs

    def poisoned(*args):  # garbage wherever nothing is written
        out_slots, valid = outputs(*args)
        return out_slots.fill_(1 << 40), valid.view(torch.uint8).fill_(7).view(torch.bool)

    monkeypatch.setattr(select_topk, "selection_outputs", poisoned)
    monkeypatch.setattr(sel, "selection_outputs", poisoned)
    slots, valid = indexer.paged_indexer_select(**case, k=k, window_valid=window, tiling=tiling)
    # the same kernels' picks, selected apart: equal on every device (a GPU's bf16 dots may
    # break near-ties unlike the reference: the picks themselves are checked above)
    ids = indexer.paged_indexer_topk(**case, k=k, tiling=tiling)
    want = reference.select_entries(ids, case["slots"], case["num_visible"], window)
    if DEVICE == "cpu":
        want_ref = reference.paged_indexer_select(**case, k=k, window_valid=window)
        assert all(torch.equal(a, b) for a, b in zip(want, want_ref, strict=True))
    assert torch.equal(slots, want[0])
    assert torch.equal(valid.view(torch.uint8), want[1].view(torch.uint8))


def test_all_ties_pick_earliest(indexer):
    """All-zero keys: every visible score is 0.0; the top-k is the first k entries, then
    the invisible ones in order (the reference's rule when fewer than k are visible)."""
    case = make_case(3, 64, 16, 32, seed=2, dtype=torch.bfloat16, zero_frac=1.0)
    case["num_visible"] = torch.tensor([64, 5, 0], device=DEVICE)
    got = indexer.paged_indexer_topk(**case, k=10)
    expected = torch.arange(10, device=DEVICE).expand(3, -1)
    assert torch.equal(got, expected)
    assert torch.equal(got, reference.paged_indexer_topk(**case, k=10))


def test_int32_slots_and_strided_q(indexer):
    case = make_case(4, 90, 16, 32, seed=4, dtype=torch.float32)
    ref = reference.paged_indexer_topk(**case, k=30)
    wide_q = torch.zeros(4, 16, 48, device=DEVICE)
    wide_q[..., :32] = case["q"]
    got = indexer.paged_indexer_topk(
        **(case | {"q": wide_q[..., :32], "slots": case["slots"].int()}), k=30
    )
    assert_same_topk(got, ref, reference_scores(case))


def test_empty_batch(indexer):
    case = make_case(1, 32, 4, 32, seed=0, dtype=torch.float32)
    empty = {name: (v[:0] if isinstance(v, torch.Tensor) and name != "key_cache" else v)
             for name, v in case.items()}  # fmt: skip
    assert indexer.paged_indexer_topk(**empty, k=4).shape == (0, 4)


def test_bad_input_raises_clear_errors(indexer):
    case = make_case(2, 32, 4, 32, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="k=40"):
        indexer.paged_indexer_topk(**case, k=40)
    with pytest.raises(ValueError, match="q must be"):
        indexer.paged_indexer_topk(**(case | {"q": case["q"][0]}), k=4)
    with pytest.raises(ValueError, match="key_cache must be"):
        indexer.paged_indexer_topk(**(case | {"key_cache": case["key_cache"][:, :16]}), k=4)
    with pytest.raises(ValueError, match="weights must be"):
        indexer.paged_indexer_topk(**(case | {"weights": case["weights"][:, :2]}), k=4)
    with pytest.raises(ValueError, match="slots must be"):
        indexer.paged_indexer_topk(**(case | {"slots": case["slots"].float()}), k=4)
    with pytest.raises(ValueError, match="no common dot type"):
        indexer.paged_indexer_topk(
            **(case | {"q": case["q"].half(), "key_cache": case["key_cache"].bfloat16()}), k=4
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("s,e", [(1, 1024), (64, 4096), (256, 1024)])
def test_v4_flash_sizes_on_gpu(indexer, indexer_tiling, s, e):
    """bf16 tensor-core dots sum in another order than the reference's fp32 einsum: scores
    differ by rounding, so near-equal scores may swap (the 1e-5 rule of assert_same_topk);
    the logits are checked first, so a real error shows there."""
    case = make_case(s, e, 64, 128, seed=s + e, dtype=torch.bfloat16)
    scores = reference_scores(case)
    assert_logits_close(indexer.indexer_logits(**case), scores, 1e-5)
    got = indexer.paged_indexer_topk(**case, k=512)
    ref = reference.paged_indexer_topk(**case, k=512)
    assert_same_topk(got, ref, scores, rel=1e-5)
    torch_topk = dataclasses.replace(
        indexer_tiling.default_tiling(s, e, got.device), select_chunk=0
    )
    assert torch.equal(indexer.paged_indexer_topk(**case, k=512, tiling=torch_topk), got)
