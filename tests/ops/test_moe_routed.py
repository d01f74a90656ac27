"""The routed MoE in 4 launches (``ops/triton/moe_routed.py``: router + align in one
program, then the fused MoE) against ``reference.moe_routed``: learned and hash routing,
with and without the shared expert stacked as the last expert, expert counts with and
without a token mask (padded tokens), T = 1 and ragged sizes, fp32 (1e-4) and bf16
(section 5 rule). Counts must be exact."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from rackserve.ops import reference

from kernel_checks import DEVICE, as_fp32, assert_bf16_close, assert_fp32_close

CASES = list(
    itertools.product(
        (1, 13, 40),  # T
        ((8, 2), (16, 6)),  # (routed E, k)
        (False, True),  # hashed
        (False, True),  # shared expert
    )
)  # 24 cases


def _case(seed, t, e, k, hashed, shared, dtype, d=64, inter=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    gate = (torch.randn(e, d, generator=g) / d**0.5).to(dtype)
    bias = None if hashed else 0.3 * torch.randn(e, generator=g)
    vocab = 50
    table = torch.rand(vocab, e, generator=g).argsort(-1)[:, :k] if hashed else None
    input_ids = torch.randint(0, vocab, (t,), generator=g)
    n = e + int(shared)
    w13 = (torch.randn(n, 2 * inter, d, generator=g) / d**0.5).to(dtype)
    w2 = (torch.randn(n, d, inter, generator=g) / inter**0.5).to(dtype)
    mask = None if seed % 3 == 0 else torch.rand(t, generator=g) < 0.7
    move = lambda a: a.to(DEVICE) if isinstance(a, torch.Tensor) else a  # noqa: E731
    router = [x, gate, bias, table, input_ids, k, "sqrtsoftplus", 1.5, e if shared else None]
    return [move(a) for a in router], move(mask), move(w13), move(w2)


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_moe_routed_fp32_matches_reference(seed):
    from rackserve.ops.triton.moe_routed import moe_routed

    t, (e, k), hashed, shared = CASES[seed]
    router, mask, w13, w2 = _case(seed, t, e, k, hashed, shared, torch.float32)
    start = torch.arange(e, device=DEVICE)
    got_counts, ref_counts = start.clone(), start.clone()
    got = moe_routed(*router, got_counts, mask, w13, w2, 7.0)
    ref = reference.moe_routed(*router, ref_counts, mask, w13, w2, 7.0)
    assert torch.equal(got_counts, ref_counts)
    assert_fp32_close(got, ref)


@pytest.mark.parametrize("seed", [1, 6, 22])
def test_moe_routed_bf16(seed):
    from rackserve.ops.triton.moe_routed import moe_routed

    t, (e, k), hashed, _ = CASES[seed]
    router, mask, w13, w2 = _case(seed, t, e, k, hashed, True, torch.bfloat16)
    got = moe_routed(*router, None, mask, w13, w2, 7.0)
    # the references route as the bf16 reference does (same bf16-rounded router logits);
    # the bf16 one rounds h once, as the fused experts do
    ids, weights = reference.route_fused(*router, None, mask)
    ref16 = reference.moe_experts(router[0], ids, weights, w13, w2, 7.0, h_dtype=torch.bfloat16)
    x32, w13_32, w2_32 = as_fp32((router[0], w13, w2))
    ref32 = reference.moe_experts(x32, ids, weights, w13_32, w2_32, 7.0)
    assert_bf16_close(got, ref16, ref32)


@pytest.mark.parametrize("seed", [1, 6, 11, 22])
def test_deferred_sum_is_the_sum(seed):
    """``defer_sum``: the unsummed ``ExpertSlots`` (an mHC post sums them) sum to the
    4-launch output bitwise, bf16 (one rounding) and fp32; the counts are the same."""
    from rackserve.ops.triton.moe_routed import moe_routed

    t, (e, k), hashed, shared = CASES[seed]
    for dtype in (torch.bfloat16, torch.float32):
        router, mask, w13, w2 = _case(seed, t, e, k, hashed, shared, dtype)
        counts = [torch.zeros(e, dtype=torch.int64, device=DEVICE) for _ in range(2)]
        out = moe_routed(*router, counts[0], mask, w13, w2, 7.0)
        slots = moe_routed(*router, counts[1], mask, w13, w2, 7.0, defer_sum=True)
        assert isinstance(slots, reference.ExpertSlots) and slots.dtype == dtype
        assert torch.equal(slots.sum(), out) and torch.equal(*counts)


@pytest.mark.parametrize("late", [True, False])
@pytest.mark.parametrize("seed", [1, 7, 9, 15, 19, 23])
def test_shared_beside_is_bitwise_the_same(seed, late, monkeypatch):
    """``shared_beside``: the shared expert's slot from its own launches (no align), issued
    between the router's and the routed experts' or before them (``SHARED_ISSUED_LATE``),
    the routed experts aligned without it. Outputs, slots
    and counts are bitwise those of the one-align path, at T = 1 (one program routes and
    aligns) and 13 / 40 (the router kernel, then the align kernel), summed and deferred;
    the shared layout is made once per shape."""
    from rackserve.ops.triton import fused_moe
    from rackserve.ops.triton import moe_routed as module
    from rackserve.ops.triton.moe_routed import moe_routed

    monkeypatch.setattr(module, "SHARED_ISSUED_LATE", late)
    monkeypatch.setattr(fused_moe, "_SHARED_LAYOUTS", {})

    t, (e, k), hashed, shared = CASES[seed]
    assert shared
    calls = []
    shared_down = fused_moe.shared_down
    monkeypatch.setattr(fused_moe, "shared_down", lambda *a: calls.append(1) or shared_down(*a))
    for dtype in (torch.bfloat16, torch.float32):
        router, mask, w13, w2 = _case(seed, t, e, k, hashed, True, dtype)
        for defer in (False, True):
            counts = [torch.zeros(e, dtype=torch.int64, device=DEVICE) for _ in range(2)]
            want = moe_routed(*router, counts[0], mask, w13, w2, 7.0, defer_sum=defer)
            got = moe_routed(
                *router, counts[1], mask, w13, w2, 7.0, defer_sum=defer, shared_beside=True
            )
            assert torch.equal(*counts) and len(calls) == 1
            calls.clear()
            assert len(fused_moe._SHARED_LAYOUTS) == 1  # one shape: made once, reused
            if defer:
                assert torch.equal(got.ids, want.ids) and got.num_experts == want.num_experts
                assert torch.equal(got.slots, want.slots)
            else:
                assert torch.equal(got, want)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5, 6, 7])
def test_one_token_align_is_the_scans_layout(seed, monkeypatch):
    """One token's pairs (``align_one_token``: a block per pair at its rank, no scans) get
    ``align_pairs``' layout bit for bit, learned and hash routing, with the shared expert
    aligned or apart (``aligned`` = the routed experts), and the same MoE output."""
    from rackserve.ops.triton import fused_moe
    from rackserve.ops.triton import moe_routed as module

    t, (e, k), hashed, shared = CASES[seed]
    assert t == 1
    router, mask, w13, w2 = _case(seed, t, e, k, hashed, shared, torch.float32)
    cols = k + int(shared)
    for aligned in {w13.shape[0], e}:
        dev = router[0].device
        tiling = fused_moe.default_tiling(t, cols, w13.shape[0], w13.shape[1] // 2, dev)
        layouts = []
        for one in (False, True):
            monkeypatch.setattr(module, "ALIGN_ONE_TOKEN", one)
            layouts.append(module._route_align(router, None, mask, aligned, tiling, F.linear))
        (ids, weights, sorted_a, blocks_a), (ids_b, weights_b, sorted_b, blocks_b) = layouts
        assert torch.equal(ids, ids_b) and torch.equal(weights, weights_b)
        assert torch.equal(blocks_a, blocks_b)
        used = int((blocks_a < aligned).sum()) * tiling.block_m  # rows past them: unwritten
        assert used and torch.equal(sorted_a[:used], sorted_b[:used])
    out = module.moe_routed(*router, None, mask, w13, w2, 7.0)
    assert_fp32_close(out, reference.moe_routed(*router, None, mask, w13, w2, 7.0))


def test_one_token_align_with_a_repeated_expert():
    """A hash table whose row repeats an expert (the scans would put both pairs in one
    block): a block each, the same output as the reference."""
    t, (e, k), _, _ = CASES[4]
    router, _, w13, w2 = _case(4, t, e, k, True, True, torch.float32)
    router[3] = torch.zeros_like(router[3])  # every pick is expert 0
    router[3][:, 1] = 3
    from rackserve.ops.triton.moe_routed import moe_routed

    got = moe_routed(*router, None, None, w13, w2, 7.0)
    assert_fp32_close(got, reference.moe_routed(*router, None, None, w13, w2, 7.0))


def test_shared_beside_needs_the_shared_expert_last():
    from rackserve.ops.triton.moe_routed import moe_routed

    router, mask, w13, w2 = _case(0, 4, 8, 2, False, True, torch.float32)
    router[-1] = 3  # a routed expert's id as the shared one
    with pytest.raises(ValueError, match="stacked last"):
        moe_routed(*router, None, mask, w13, w2, 7.0, shared_beside=True)


def test_moe_routed_rejects_bad_counts():
    from rackserve.ops.triton.moe_routed import moe_routed

    router, mask, w13, w2 = _case(0, 4, 8, 2, False, False, torch.float32)
    bad = torch.zeros(5, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="expert_counts"):
        moe_routed(*router, bad, mask, w13, w2, 7.0)
