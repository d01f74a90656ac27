"""The fused MoE router (``ops/triton/route.py``) against ``reference.route``: learned
(sqrt-softplus / sigmoid / softmax + correction bias) and hash routing, fp32 and bf16.
Experts are compared as sets per token (the order of the k picks is free) and weights by
expert."""

from __future__ import annotations

import itertools

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE

CASES = list(
    itertools.product(
        (1, 40),  # T
        ((8, 2), (64, 6), (72, 6)),  # (E, k): 72 is not a power of two
        ("sqrtsoftplus", "sigmoid", "softmax"),
        (False, True),  # hashed
    )
)


def _case(seed, t, e, k, hashed, dtype, d=96):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=g) * 2).to(dtype)
    weight = (torch.randn(e, d, generator=g) / d**0.5).to(dtype)
    bias = None if hashed else 0.3 * torch.randn(e, generator=g)
    vocab = 50
    table = torch.rand(vocab, e, generator=g).argsort(-1)[:, :k] if hashed else None
    ids = torch.randint(0, vocab, (t,), generator=g)
    move = lambda a: a.to(DEVICE) if a is not None else None  # noqa: E731
    return move(x), move(weight), move(bias), move(table), move(ids)


def _by_expert(ids: torch.Tensor, weights: torch.Tensor, e: int) -> torch.Tensor:
    """[T, k] picks -> [T, E] weight per expert (0 where not picked)."""
    return torch.zeros(ids.shape[0], e, device=ids.device).scatter_(1, ids, weights)


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_route_fp32_matches_reference(seed):
    from rackserve.ops.triton.route import route

    t, (e, k), scoring, hashed = CASES[seed]
    args = _case(seed, t, e, k, hashed, torch.float32)
    got_ids, got_w = route(*args, k, scoring, 1.5)
    ref_ids, ref_w = reference.route(*args, k, scoring, 1.5)
    assert torch.equal(got_ids.sort(1).values, ref_ids.sort(1).values)
    torch.testing.assert_close(_by_expert(got_ids, got_w, e), _by_expert(ref_ids, ref_w, e))


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax"])
def test_route_bf16_picks_and_weights(scoring):
    from rackserve.ops.triton.route import route

    t, e, k = 64, 64, 6
    args = _case(7, t, e, k, False, torch.bfloat16, d=256)
    got_ids, got_w = route(*args, k, scoring, 1.0)
    ref_ids, ref_w = reference.route(*args, k, scoring, 1.0)
    same = (got_ids.sort(1).values == ref_ids.sort(1).values).all(1)
    assert same.float().mean() >= 0.95  # bf16 near-ties may swap a pick
    got, ref = _by_expert(got_ids, got_w, e)[same], _by_expert(ref_ids, ref_w, e)[same]
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_route_fused_matches_reference(seed):
    """The shared expert's pick and the (masked) expert counts ride along in the kernel."""
    from rackserve.ops.triton.route import route_fused

    t, (e, k), scoring, hashed = CASES[seed]
    args = _case(seed, t, e, k, hashed, torch.float32)
    g = torch.Generator().manual_seed(100 + seed)
    mask = None if seed % 3 == 0 else (torch.rand(t, generator=g) < 0.7).to(DEVICE)
    if mask is not None:
        mask[0] = False  # a padded row at T = 1 too
    shared = None if seed % 4 == 1 else e
    start = torch.randint(0, 5, (e,), generator=g).to(DEVICE)
    got_counts, ref_counts = start.clone(), start.clone()
    got_ids, got_w = route_fused(*args, k, scoring, 1.5, shared, got_counts, mask)
    ref_ids, ref_w = reference.route_fused(*args, k, scoring, 1.5, shared, ref_counts, mask)
    assert torch.equal(got_counts, ref_counts)
    assert got_ids.shape == ref_ids.shape == (t, k + (shared is not None))
    if shared is not None:
        assert (got_ids[:, -1] == e).all() and (got_w[:, -1] == 1.0).all()
        got_ids, got_w, ref_ids, ref_w = (
            got_ids[:, :-1],
            got_w[:, :-1],
            ref_ids[:, :-1],
            ref_w[:, :-1],
        )
    assert torch.equal(got_ids.sort(1).values, ref_ids.sort(1).values)
    torch.testing.assert_close(_by_expert(got_ids, got_w, e), _by_expert(ref_ids, ref_w, e))


def test_route_fused_rejects_bad_counts():
    from rackserve.ops.triton.route import route_fused

    args = _case(0, 4, 8, 2, False, torch.float32)
    bad = torch.zeros(7, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="expert_counts"):
        route_fused(*args, 2, "sigmoid", 1.0, None, bad)
