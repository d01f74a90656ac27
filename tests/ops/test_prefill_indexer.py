"""The prefill indexer (``ops/triton/prefill_indexer.py``: query tiles sharing key tiles)
against ``reference.paged_indexer_topk``, under the Triton interpreter on CPU.

Batches are prefill-shaped (requests of consecutive queries reading the same entry rows,
num_visible growing with position; a tile may straddle two requests, which takes the
per-query fallback) or fully random (every query its own rows). Keys live in a column
slice of a wider cache with zero rows (exact 0.0 scores: ties, resolved by entry order).
Unwritten packed keys read as the largest int64 and would be picked first. Top-k rule
(GPU_FASTPATH.md section 5, ``test_indexer.assert_same_topk``): identical ids, except where
the two picks at a rank score within 1e-6 of the row's scale of each other.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from test_indexer import assert_same_topk, reference_scores

from rackserve.ops import reference

from kernel_checks import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")


@pytest.fixture(scope="module")
def indexer():
    return importlib.import_module("rackserve.ops.triton.prefill_indexer")


@pytest.fixture(autouse=True)
def poisoned_outputs(indexer, monkeypatch):
    def empty(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(indexer, "_empty", empty)


def make_case(
    requests: list[tuple[int, int]] | None,
    s: int,
    e: int,
    hi: int,
    di: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    ratio: int = 4,
) -> dict:
    """``requests`` [(cached, new)]: each request's queries share one shuffled row list of E
    entries and see (p + 1) // ratio of them; None: S queries with random rows."""
    g = torch.Generator().manual_seed(seed)
    rows_total = 4 * e + 7
    cache = torch.randn(rows_total, di + 24, generator=g)
    cache[torch.rand(rows_total, generator=g) < 0.1] = 0.0  # exact 0.0 scores: ties
    if requests is None:
        slots = torch.stack([torch.randperm(rows_total, generator=g)[:e] for _ in range(s)])
        num_visible = torch.randint(0, e + 1, (s,), generator=g)
    else:
        slots, num_visible = [], []
        for cached, new in requests:
            row = torch.randperm(rows_total, generator=g)[:e]
            for p in range(cached, cached + new):
                slots.append(row)
                num_visible.append(min(e, (p + 1) // ratio))
        slots, num_visible = torch.stack(slots), torch.tensor(num_visible)
        s = slots.shape[0]
    return {
        "q": torch.randn(s, hi, di, generator=g).to(DEVICE, dtype),
        "key_cache": cache.to(DEVICE, dtype)[:, 8 : 8 + di],
        "slots": slots.to(DEVICE),
        "weights": torch.randn(s, hi, generator=g).to(DEVICE),  # both signs: -0.0 sums
        "scale": di**-0.5,
        "num_visible": num_visible.to(DEVICE),
    }


def check(indexer, case: dict, k: int, tiling=None, rel: float = 1e-6) -> None:
    got = indexer.paged_indexer_topk(**case, k=k, tiling=tiling)
    ref = reference.paged_indexer_topk(**case, k=k)
    assert_same_topk(got, ref, reference_scores(case), rel)


CASES = [  # (requests or None, S, E, Hi, Di, k)
    ([(0, 40)], 0, 16, 4, 32, 8),
    ([(100, 9)], 0, 64, 16, 32, 16),
    ([(0, 7), (20, 13), (3, 1)], 0, 40, 16, 64, 8),  # tiles straddle requests
    ([(0, 33)], 0, 9, 8, 32, 9),  # k = E
    (None, 11, 50, 16, 32, 12),  # every query its own rows
    (None, 3, 20, 4, 64, 1),
    ([(5, 6)], 0, 30, 16, 32, 0),  # k = 0
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(indexer, case, dtype):
    requests, s, e, hi, di, k = CASES[case]
    check(indexer, make_case(requests, s, e, hi, di, seed=case, dtype=dtype), k)


@pytest.mark.parametrize("block_q,block_e,tiles", [(1, 16, 1), (2, 16, 3), (8, 32, 2)])
def test_tilings_match_reference(indexer, block_q, block_e, tiles):
    case = make_case([(0, 19), (50, 6)], 0, 48, 8, 32, seed=9)
    tiling = indexer.PrefillIndexerTiling(block_q, block_e, tiles, 4, 2)
    check(indexer, case, 10, tiling)


def test_logits_equal_the_decode_kernel(indexer):
    """Same packed keys as ``indexer.indexer_logits`` in fp32 (same products and sums)."""
    decode = importlib.import_module("rackserve.ops.triton.indexer")
    case = make_case([(0, 9), (4, 5)], 0, 24, 16, 32, seed=3)
    got = indexer.indexer_logits(**case)
    ref = decode.indexer_logits(**case, packed=True)
    scores = reference_scores(case)
    assert (got == ref).float().mean().item() > 0.9  # same bits but for summation order
    assert torch.equal(got.topk(5).indices, reference.topk_earliest(scores, 5))


def test_bad_input_raises_clear_errors(indexer):
    case = make_case([(0, 4)], 0, 8, 4, 32, seed=0)
    with pytest.raises(ValueError, match="k=9"):
        indexer.paged_indexer_topk(**case, k=9)
    with pytest.raises(ValueError, match="weights must be"):
        indexer.paged_indexer_topk(**(case | {"weights": case["weights"][:, :2]}), k=2)
    with pytest.raises(ValueError, match="slots must be"):
        indexer.paged_indexer_topk(**(case | {"slots": case["slots"].float()}), k=2)
    with pytest.raises(ValueError, match="q must be"):
        indexer.paged_indexer_topk(**(case | {"q": case["q"][0]}), k=2)


@pytest.mark.gpu
@pytest.mark.parametrize("cached,new", [(0, 4096), (16384, 1024)])
def test_v4_flash_sizes_on_gpu(indexer, cached, new):
    """64 heads x 128, top-512 over (cached + new) / 4 entries, bf16, the default tiling.
    Tensor-core dots sum in another order than the reference's fp32 einsum, so near-equal
    scores may swap places (the GPU run of 2026-12-01 swapped two adjacent ranks): the 1e-5
    rule of the decode indexer's GPU test."""
    if DEVICE != "cuda":
        pytest.skip("needs a GPU")
    e = (cached + new) // 4
    case = make_case([(cached, new)], 0, e, 64, 128, seed=5, dtype=torch.bfloat16)
    check(indexer, case, 512, rel=1e-5)
