"""The sparse prefill attention kernel (``ops/triton/prefill_attn.py``) against its reference
(``reference.paged_sparse_attention``, the same contract as the decode kernel).

CPU runs use the Triton interpreter at small shapes (Dh 64, Wa 16, Wb in {0, 8, 40},
S up to 40, H in {4, 16}). Masks: prefill-shaped (a request's queries at consecutive
positions: the window valid from position 0 on, the compressed rows a growing prefix), and
any mask (window only, none, all, random). Invalid rows point at NaN rows or slot -1, so a
kernel that lets garbage reach a dot fails; the output starts as NaN, so an element the
kernel does not write fails. Tolerances (GPU_FASTPATH.md section 5): fp32 within 1e-4
relative; bf16 |kernel - ref_fp32| <= 2 |ref_bf16 - ref_fp32| + 1e-3 for >= 99.9%.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from rackserve.ops import reference

from attn_cases import WA, any_mask, make_case, prefill_mask
from kernel_checks import DEVICE, as_fp32, assert_bf16_close, assert_fp32_close, check_raw_q


@pytest.fixture(scope="module")
def attn():
    return importlib.import_module("rackserve.ops.triton.prefill_attn")


@pytest.fixture(autouse=True)
def nan_outputs(attn, monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(attn, "_empty", empty)


def check(attn, args: tuple, tiling=None) -> torch.Tensor:
    got = attn.paged_sparse_attention(*args, tiling=tiling)
    q = args[0]
    assert got.shape == q.shape and got.dtype == q.dtype
    if q.dtype == torch.float32:
        assert_fp32_close(got, reference.paged_sparse_attention(*args))
    else:
        ref32 = reference.paged_sparse_attention(*as_fp32(args))
        assert_bf16_close(got, reference.paged_sparse_attention(*args), ref32)
    return got


# (requests as (cached, new), Wb, ratio): a cold prompt, a prompt after a cached prefix,
# a mixed step (two decodes and a prefill chunk), a prompt whose early queries see nothing
# compressed, and T = 1
PREFILLS = [
    ([(0, 40)], 8, 4),
    ([(29, 11)], 40, 1),
    ([(100, 1), (0, 13), (7, 1)], 8, 4),
    ([(0, 21)], 8, 16),
    ([(5, 1)], 0, 4),
]


@pytest.mark.parametrize("case", range(len(PREFILLS)))
@pytest.mark.parametrize("h", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_masks_match_reference(attn, case, h, dtype):
    lengths, wb, ratio = PREFILLS[case]
    valid = prefill_mask(lengths, WA, wb, ratio)
    check(attn, make_case(valid, h, dtype, seed=10 * case + h, rope_dim=16 if case % 2 else 0))


@pytest.mark.parametrize("s,wb", list(itertools.product((1, 9), (0, 8, 24))))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_mask_matches_reference(attn, s, wb, dtype):
    g = torch.Generator().manual_seed(s + wb)
    check(attn, make_case(any_mask(s, WA, wb, g), 16, dtype, seed=s * wb + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_q_is_normed_and_rotated_first(attn, dtype):
    """q_norm_eps: the op takes wq_b's raw q and applies the prologue's unweighted norm +
    RoPE before attending (the model's prefill path); a raw q without RoPE is refused."""
    valid = prefill_mask([(29, 11)], WA, 40, 1)
    args = make_case(valid, 16, dtype, seed=3, rope_dim=16)
    check_raw_q(attn, args, check)


def tilings(attn) -> dict[str, object]:
    """GPU-like shapes: small tiles, deeper pipelines, a dv split, 32 heads, the PV modes."""
    t = attn.PrefillTiling
    return {
        "bn16_stages3": t(16, 16, 1, 4, 3),
        "dv2": t(16, 16, 2, 4, 2),
        "dv4": t(16, 32, 4, 4, 2),
        "heads32": t(32, 16, 1, 8, 2),
        "split_p": t(16, 16, 1, 4, 2, pv="split"),
        "bf16_p": t(16, 16, 1, 4, 2, pv="rows"),
    }


@pytest.mark.parametrize("name", ["bn16_stages3", "dv2", "dv4", "heads32", "split_p", "bf16_p"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tilings_match_reference(attn, name, dtype):
    valid = prefill_mask([(3, 9), (0, 6)], WA, 24, 2)
    args = make_case(valid, 16, dtype, seed=7, rope_dim=16)
    if name == "bf16_p" and dtype == torch.bfloat16:  # a bf16 p is only bf16-accurate
        got = attn.paged_sparse_attention(*args, tiling=tilings(attn)[name])
        ref = reference.paged_sparse_attention(*as_fp32(args))
        assert (got.float() - ref).abs().max().item() < 3e-2
        return
    check(attn, args, tilings(attn)[name])


def test_agrees_with_the_decode_kernel(attn):
    """Same contract as ``sparse_attn.paged_sparse_attention``: fp32 outputs agree."""
    decode = importlib.import_module("rackserve.ops.triton.sparse_attn")
    valid = prefill_mask([(0, 12), (40, 3)], WA, 8, 4)
    args = make_case(valid, 16, torch.float32, seed=4, rope_dim=16)
    torch.testing.assert_close(
        attn.paged_sparse_attention(*args),
        decode.paged_sparse_attention(*args),
        rtol=1e-5,
        atol=1e-5,
    )


def test_odd_head_dim_many_rows_and_int32_slots(attn):
    """Dh not a power of two (masked columns), more rows than one scan of ``valid``."""
    valid = prefill_mask([(0, 5)], WA, 1100, 1)
    args = list(make_case(valid, 4, torch.float32, seed=3, dh=48, rope_dim=16))
    check(attn, tuple(args))
    args[2], args[4] = args[2].int(), args[4].int()
    check(attn, tuple(args))


def test_deterministic(attn):
    args = make_case(prefill_mask([(0, 20)], WA, 8, 4), 16, torch.bfloat16, seed=2)
    assert torch.equal(attn.paged_sparse_attention(*args), attn.paged_sparse_attention(*args))


def test_empty_batch_and_no_rows(attn):
    args = make_case(torch.zeros(0, WA + 8, dtype=torch.bool), 4, torch.float32, seed=0)
    assert attn.paged_sparse_attention(*args).shape == (0, 4, 64)
    q, kv_a, _, kv_b, _, _, sinks, scale = make_case(
        torch.zeros(2, WA, dtype=torch.bool), 4, torch.float32, seed=0
    )
    none = torch.zeros(2, 0, dtype=torch.long, device=DEVICE)
    no_rows = torch.zeros(2, 0, dtype=torch.bool, device=DEVICE)
    out = attn.paged_sparse_attention(q, kv_a, none, kv_b, none, no_rows, sinks, scale)
    assert torch.equal(out, torch.zeros_like(q))  # the sink alone: zero output


def test_bad_input_raises_clear_errors(attn):
    args = make_case(prefill_mask([(0, 3)], WA, 8, 4), 4, torch.float32, 0)
    q, kv_a, slots_a, kv_b, slots_b, valid, sinks, scale = args
    rest = (valid, sinks, scale)
    with pytest.raises(ValueError, match="kv_a must be"):
        attn.paged_sparse_attention(q, kv_a[:, :32], slots_a, kv_b, slots_b, *rest)
    with pytest.raises(ValueError, match="kv_b must be"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b.bfloat16(), slots_b, *rest)
    with pytest.raises(ValueError, match="slots_b must be"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b.float(), *rest)
    with pytest.raises(ValueError, match="valid must be"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b, valid[:, 1:], sinks, scale)
    with pytest.raises(ValueError, match="sinks must be"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b, valid, sinks[:2], scale)
    with pytest.raises(ValueError, match="q must be"):
        attn.paged_sparse_attention(q[0], kv_a, slots_a, kv_b, slots_b, *rest)
    cos = torch.ones(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="together"):
        attn.paged_sparse_attention(q, kv_a, slots_a, kv_b, slots_b, *rest, cos)


@pytest.mark.gpu
@pytest.mark.parametrize("wb", [64, 512])
def test_v4_flash_sizes_on_gpu(attn, wb):
    """H 64, Dh 512 (64 rope), Wa 128, a 2048-token prompt after 1024 cached, bf16."""
    if DEVICE != "cuda":
        pytest.skip("needs a GPU")
    valid = prefill_mask([(1024, 2048)], 128, wb, 4 if wb == 512 else 128)
    tiling = attn.default_tiling(64, 512, torch.bfloat16, torch.device("cuda"))  # not wgmma
    args = make_case(valid, 64, torch.bfloat16, seed=1, dh=512, rope_dim=64, wa=128)
    check(attn, args, tiling)


def test_dispatch_by_number_of_queries():
    """The op table sends batches of >= PREFILL_ATTN_MIN_TOKENS queries to the prefill
    kernel and smaller ones to the decode kernel."""
    from rackserve import ops

    calls = []
    pick = ops._by_num_tokens(
        lambda x: calls.append("decode"), lambda x: calls.append("prefill"), 4
    )
    pick(torch.zeros(3, 1))
    pick(torch.zeros(4, 1))
    assert calls == ["decode", "prefill"]
    assert ops.PREFILL_ATTN_MIN_TOKENS > ops.FUSED_MOE_MAX_TOKENS  # decode batches unchanged
