"""The CSA row selection kernel (``ops/triton/select.py``) against
``reference.select_entries``: ragged visibility (fewer visible entries than picks, none
visible), T = 1, K = E, non-contiguous inputs; outputs start poisoned."""

from __future__ import annotations

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE

CASES = [  # (S, E, K, W)
    (1, 8, 4, 16),
    (1, 4, 4, 16),
    (3, 20, 8, 16),
    (5, 64, 16, 128),
    (7, 33, 7, 5),
    (16, 100, 32, 16),
    (2, 2, 2, 1),
    (9, 512, 64, 128),
]


@pytest.mark.parametrize("seed", range(24))
def test_select_entries_matches_reference(seed, monkeypatch):
    from rackserve.ops.triton import select

    s, e, k, w = CASES[seed % len(CASES)]
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(s)])
    if seed % 3 == 1:  # a column slice (strided rows), as the indexer's picks may be
        ids = torch.cat([ids, torch.zeros_like(ids)], 1)[:, :k]
    slots = torch.randint(0, 10_000, (s, e + 3), generator=g)[:, 1 : e + 1]  # strided rows
    num_visible = torch.randint(0, e + 1, (s,), generator=g)
    num_visible[0] = 0  # a query that sees nothing yet
    window_valid = torch.rand(s, w, generator=g) < 0.6
    args = [a.to(DEVICE) for a in (ids, slots, num_visible, window_valid)]
    real_empty = torch.empty

    def poisoned(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(True) if t.dtype == torch.bool else t.fill_(-7)

    monkeypatch.setattr(select.torch, "empty", poisoned)
    got_slots, got_valid = select.select_entries(*args)
    ref_slots, ref_valid = reference.select_entries(*args)
    assert torch.equal(got_slots, ref_slots)
    assert torch.equal(got_valid, ref_valid)


def test_select_entries_rejects_bad_shapes():
    from rackserve.ops.triton import select

    ids = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    slots = torch.zeros(2, 8, dtype=torch.int64, device=DEVICE)
    window = torch.ones(2, 3, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="num_visible"):
        select.select_entries(ids, slots, torch.zeros(3, device=DEVICE), window)
    with pytest.raises(ValueError, match="bool"):
        select.select_entries(ids, slots, torch.zeros(2, device=DEVICE), window.int())
