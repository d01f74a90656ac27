"""The step's embedding into the mHC streams (``ops/triton/embed.py``) against
``reference.embed_streams``: a copy, so bit for bit; ragged widths, repeated ids, no tokens."""

from __future__ import annotations

import pytest
import torch

from rackserve import ops
from rackserve.ops import reference

from kernel_checks import DEVICE


@pytest.mark.parametrize("t,d,n", [(1, 64, 4), (5, 100, 4), (3, 2048 + 7, 2), (0, 32, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_streams_matches_reference(t, d, n, dtype):
    from rackserve.ops.triton.embed import embed_streams

    g = torch.Generator().manual_seed(t + d)
    weight = torch.randn(50, d + 3, generator=g)[:, :d].to(DEVICE, dtype)  # row stride > D
    ids = torch.randint(0, 50, (t,), generator=g).to(DEVICE)
    if t > 2:
        ids[2] = ids[0]  # a repeated token
    got = embed_streams(ids, weight, n)
    want = reference.embed_streams(ids, weight, n)
    assert got.shape == (t, n, d) and got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(want[:, 0], torch.nn.functional.embedding(ids, weight))


def test_embed_streams_rejects_bad_inputs():
    from rackserve.ops.triton.embed import embed_streams

    with pytest.raises(ValueError, match="ids"):
        embed_streams(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(4, 8), 4)


def test_the_tables_embed_streams():
    ids, weight = torch.tensor([3, 1], device=DEVICE), torch.randn(5, 16, device=DEVICE)
    want = reference.embed_streams(ids, weight, 4)
    for name in ("reference", "triton"):
        assert torch.equal(ops.kernels(name).embed_streams(ids, weight, 4), want)
