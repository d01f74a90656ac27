"""Inputs of ``paged_sparse_attention`` for the attention kernel tests: prefill-shaped masks,
masks of any shape, and the cases built on them (strided caches with NaN rows, invalid slots
at -1 or the NaN row, so a kernel that lets garbage reach a dot fails)."""

from __future__ import annotations

import torch

from kernel_checks import DEVICE

WA = 16


def prefill_mask(lengths: list[tuple[int, int]], wa: int, wb: int, ratio: int) -> torch.Tensor:
    """[S, Wa + Wb] for requests (cached, new): query at position p sees window positions
    max(0, p-Wa+1)..p and compressed entries 0..(p+1)//ratio - 1 (at most Wb)."""
    rows = []
    for cached, new in lengths:
        for p in range(cached, cached + new):
            window = torch.arange(wa) >= wa - 1 - p
            entries = torch.arange(wb) < min(wb, (p + 1) // ratio)
            rows.append(torch.cat([window, entries]))
    return torch.stack(rows)


def any_mask(s: int, wa: int, wb: int, g: torch.Generator) -> torch.Tensor:
    """[S, Wa + Wb]: query i follows pattern (i + random) % 4: window only, none, all, random."""
    valid = torch.zeros(s, wa + wb, dtype=torch.bool)
    for i in range(s):
        pattern = (i + int(torch.randint(0, 4, (1,), generator=g))) % 4
        if pattern == 0:
            valid[i, int(torch.randint(0, wa, (1,), generator=g)) : wa] = True
        elif pattern == 2:
            valid[i] = True
        elif pattern == 3:
            valid[i] = torch.rand(wa + wb, generator=g) < 0.5
    return valid


def make_case(
    valid: torch.Tensor,
    h: int,
    dtype: torch.dtype,
    seed: int,
    dh: int = 64,
    rope_dim: int = 0,
    wa: int = WA,
) -> tuple:
    """Arguments of ``paged_sparse_attention`` for ``valid`` [S, Wa + Wb]: strided caches
    with a NaN row each, invalid slots at -1 or the NaN row."""
    g = torch.Generator().manual_seed(seed)
    s, wb = valid.shape[0], valid.shape[1] - wa
    na, nb = s * wa + 5, s * wb + 3
    kv_a = torch.randn(na, dh + 8, generator=g)[:, :dh]  # row stride > Dh
    kv_b = torch.randn(nb, dh + 16, generator=g)  # [kv | indexer key]
    kv_a[na - 1] = float("nan")
    kv_b[nb - 1] = float("nan")
    slots_a = torch.randint(0, na - 1, (s, wa), generator=g)
    slots_b = torch.randint(0, nb - 1, (s, wb), generator=g)
    minus_one = torch.rand(s, wa + wb, generator=g) < 0.5
    slots_a = torch.where(valid[:, :wa], slots_a, torch.where(minus_one[:, :wa], -1, na - 1))
    slots_b = torch.where(valid[:, wa:], slots_b, torch.where(minus_one[:, wa:], -1, nb - 1))
    q = 2 * torch.randn(s, h, dh, generator=g)  # peaky softmaxes
    sinks = torch.randn(h, generator=g)
    args = [q.to(dtype), kv_a.to(dtype), slots_a, kv_b.to(dtype), slots_b, valid, sinks, dh**-0.5]
    if rope_dim:
        angle = torch.rand(s, rope_dim // 2, generator=g) * 6.3
        args += [angle.cos().to(dtype), angle.sin().to(dtype)]
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
