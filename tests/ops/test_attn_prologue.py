"""The fused attention prologue (``ops/triton/attn_prologue.py``) against
``reference.attention_prologue``: q norm + RoPE, kv norm + RoPE into the window cache, the
compressor's rows into the state cache, the indexer's q RoPE and head weights. Inputs are
column views of wider projection outputs (as the model passes them), padded tokens share
the null slot, outputs and caches start as NaN. fp32: relative error <= 1e-4; bf16: the
section-5 rule against the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE, assert_bf16_close, assert_fp32_close

EPS = 1e-6
CASES = [  # (T, H, Dh, rope half, state width, index (Hi, Di) or None, padded)
    (1, 4, 64, 8, 0, None, 0),
    (1, 4, 64, 8, 128, None, 0),
    (1, 2, 64, 16, 320, (4, 32), 0),
    (3, 4, 96, 8, 64, (8, 32), 1),
    (17, 2, 64, 32, 256, None, 5),
    (5, 8, 128, 16, 0, None, 2),
    (9, 4, 64, 8, 160, (16, 32), 3),
    (33, 1, 64, 8, 96, (2, 16), 0),
    (2, 16, 64, 32, 512, (4, 64), 1),
    (12, 4, 320, 32, 640, None, 4),
]


def _case(seed, t, h, dh, half, width, index, padded, dtype):
    g = torch.Generator().manual_seed(seed)
    hi, di = index or (0, 0)
    x_proj = torch.randn(t, 3 + dh + width + hi + 2, generator=g) * 2  # [pad | kv | rows | w]
    kv = x_proj[:, 3 : 3 + dh]
    rows = x_proj[:, 3 + dh : 3 + dh + width] if width else None
    head_logits = x_proj[:, 3 + dh + width : 3 + dh + width + hi] if index else None
    q_proj = torch.randn(t, h * dh + hi * di, generator=g) * 3
    q = q_proj[:, : h * dh].view(t, h, dh)
    index_q = q_proj[:, h * dh :].view(t, hi, di) if index else None
    kv_weight = 1 + 0.3 * torch.randn(dh, generator=g)
    positions = torch.randint(0, 50_000, (t,), generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half) / half))
    cos, sin = reference.rope_cos_sin(positions, inv_freq, 1.1, torch.float32)
    num = 2 * t + 5
    swa = torch.full((num, dh), float("nan"))
    swa_slots = 1 + torch.randperm(num - 1, generator=g)[:t]
    state = torch.full((num, width), float("nan")) if width else None
    state_slots = 1 + torch.randperm(num - 1, generator=g)[:t] if width else None
    if padded:
        swa_slots[t - padded :] = 0
        if width:
            state_slots[t - padded :] = 0

    def cast(a):
        if not isinstance(a, torch.Tensor):
            return a
        if a.is_floating_point() and a is not kv_weight:
            a = a.to(dtype)
        return a.to(DEVICE)

    args = [q, kv, kv_weight, EPS, cos, sin, swa, swa_slots, rows, state, state_slots,
            index_q, head_logits, (hi or 1) ** -0.5]  # fmt: skip
    return [cast(a) for a in args]


def _fp32(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.float().clone()
        out.append(a)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_attention_prologue_matches_reference(case, dtype):
    from rackserve.ops.triton.attn_prologue import attention_prologue

    t, h, dh, half, width, index, padded = CASES[case]
    args = _case(case, t, h, dh, half, width, index, padded, dtype)
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = attention_prologue(*args)
    ref = reference.attention_prologue(*ref_args)
    ref32_args = _fp32(args)
    ref32_args[6] = ref32_args[6].fill_(float("nan"))
    ref32 = reference.attention_prologue(*ref32_args)
    real = args[7][: t - padded]
    pairs = [(got[0], ref[0], ref32[0]), (args[6][real], ref_args[6][real], ref32_args[6][real])]
    if index:
        pairs += [(got[1], ref[1], ref32[1]), (got[2], ref[2], ref32[2])]
    else:
        assert got[1] is None and got[2] is None
    for g, r, r32 in pairs:
        if dtype == torch.float32:
            assert_fp32_close(g, r)
        else:
            assert_bf16_close(g, r, r32)
    written = torch.zeros(args[6].shape[0], dtype=torch.bool, device=DEVICE)
    written[args[7]] = True
    assert args[6][~written].isnan().all(), "wrote outside the window slots"
    if width:
        state_real = args[10][: t - padded]
        assert torch.equal(args[9][state_real], args[8][: t - padded])
        written = torch.zeros(args[9].shape[0], dtype=torch.bool, device=DEVICE)
        written[args[10]] = True
        assert args[9][~written].isnan().all(), "wrote outside the state slots"


@pytest.mark.parametrize("case", [2, 3, 6])
def test_prologue_without_q_leaves_it_raw(case):
    """norm_q=False (an attention kernel norms q on its load): q comes back as it came, and
    everything else the prologue writes is what the full prologue writes (the real tokens'
    slots: padded ones share the null slot, in no fixed order on a GPU)."""
    from rackserve.ops.triton.attn_prologue import attention_prologue

    t, h, dh, half, width, index, padded = CASES[case]
    args = _case(case, t, h, dh, half, width, index, padded, torch.bfloat16)
    for fn in (attention_prologue, reference.attention_prologue):
        full, part = ([a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                      for _ in range(2))  # fmt: skip
        want = fn(*full)
        got = fn(*part, norm_q=False)
        assert got[0] is part[0]
        assert torch.equal(part[6][args[7][: t - padded]], full[6][args[7][: t - padded]])
        if width:
            real = args[10][: t - padded]
            assert torch.equal(part[9][real], full[9][real])
        if index:
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_attention_prologue_rejects_bad_input():
    from rackserve.ops.triton.attn_prologue import attention_prologue

    args = _case(0, 3, 4, 64, 8, 64, (4, 32), 0, torch.float32)
    bad = list(args)
    bad[1] = args[1][:2]
    with pytest.raises(ValueError, match="kv"):
        attention_prologue(*bad)
    bad = list(args)
    bad[12] = None
    with pytest.raises(ValueError, match="head_logits"):
        attention_prologue(*bad)
