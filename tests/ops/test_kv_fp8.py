"""``--kv-cache-dtype fp8`` in the Triton kernels: e4m3 cache rows against the reference's
fp8 path (``reference.*`` reads ``cache.to(q.dtype)`` and writes ``row.to(cache.dtype)``).

Readers (decode sparse attention in its head-blocked and wide forms, prefill
attention, the decode and prefill indexers) get e4m3 caches built from the sibling tests'
cases (NaN rows stay NaN in e4m3, so invalid rows still poison a kernel that reads them)
and must meet the section-5 tolerances against the reference on the same fp8 caches.
Writers (kv_insert, the attention prologue, compress_entries) store into NaN-filled e4m3
caches: their codes must be the reference's (one e4m3 step apart at most where the
activation-dtype values themselves differ by an ulp; >= 99% bit-equal) and nothing outside
the written slots may change. The encoding itself is checked bit for bit against torch's
cast over every range, saturation and subnormals included. A few shapes each: interpreter
time stays small.
"""

from __future__ import annotations

import importlib

import pytest
import test_attn_prologue as prologue_cases
import test_compress as compress_cases
import test_indexer as indexer_cases
import test_norm_rope as norm_rope_cases
import test_prefill_indexer as prefill_indexer_cases
import test_sparse_attn as decode_cases
import torch
import triton
import triton.language as tl

from rackserve.ops import reference
from rackserve.ops.triton.fp8 import as_codes, to_cache

import attn_cases as prefill_cases
from kernel_checks import DEVICE, assert_fp32_close

FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")


def _nan_empty(shape, dtype, device):
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
    return torch.full(shape, fill, dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every kernel wrapper's outputs and workspaces start as NaN (int: the largest value)."""
    for name in ("sparse_attn", "prefill_attn", "indexer", "prefill_indexer"):
        module = importlib.import_module(f"rackserve.ops.triton.{name}")
        monkeypatch.setattr(module, "_empty", _nan_empty)


def fp8_caches(args: tuple, cache_positions: tuple[int, ...]) -> tuple:
    """``args`` with the caches at ``cache_positions`` stored in e4m3 (the reference's cast)."""
    return tuple(a.to(FP8) if i in cache_positions else a for i, a in enumerate(args))


# ---- e4m3 encoding: the reference's cast, bit for bit ------------------------------------


@triton.jit
def _encode(x_ptr, out_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, to_cache(x, out_ptr, ACT), mask=i < n)


def test_e4m3_encoding_equals_torch_cast():
    g = torch.Generator().manual_seed(0)
    spans = [torch.randn(2048, generator=g) * s for s in (1e-3, 3e-2, 0.5, 4, 60, 400, 5e3)]
    edges = [0.0, -0.0, 448.0, -448.0, 464.0, 464.1, 480.0, 1e9, -1e9, 2**-6, 2**-6 * 0.99,
             2**-9, 2**-10, 3 * 2**-11, 2**-11, 1.0625, 1.1875, 240.0, 232.0]  # fmt: skip
    x = torch.cat([*spans, torch.tensor(edges)]).to(DEVICE)
    for act, tl_act in ((torch.float32, tl.float32), (torch.bfloat16, tl.bfloat16)):
        out = torch.full_like(x, float("nan")).to(FP8)
        _encode[(triton.cdiv(x.numel(), 1024),)](x, as_codes(out), x.numel(), tl_act, 1024)
        expected = reference.as_stored(x.to(act), FP8)  # CUDA's plain cast: NaN past 448
        got, want = out.view(torch.uint8), expected.view(torch.uint8)
        bad = (got != want).nonzero().flatten()[:8].tolist()
        assert not bad, (act, [(x[i].item(), got[i].item(), want[i].item()) for i in bad])


# ---- readers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "s,h,wb,tiling",
    [
        (1, 4, 8, None),
        (9, 16, 24, "split3"),
        (9, 16, 24, "dv2_split2"),
        (3, 16, 8, "wide_dv2_split3"),
        (3, 16, 8, "wide_split_every_tile"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_fp8_rows(s, h, wb, tiling, dtype):
    attn = importlib.import_module("rackserve.ops.triton.sparse_attn")
    rope = 16 if tiling in ("dv2_split2", "wide_split_every_tile") else 0
    args = decode_cases.make_case(s, h, wb, dtype, seed=s + h + wb, rope_dim=rope)
    args = fp8_caches(args, (1, 3))
    decode_cases.check(attn, args, decode_cases.tilings(attn)[tiling] if tiling else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_fp8_rows(dtype):
    attn = importlib.import_module("rackserve.ops.triton.prefill_attn")
    valid = prefill_cases.prefill_mask([(100, 1), (0, 13), (7, 1)], prefill_cases.WA, 8, 4)
    args = fp8_caches(prefill_cases.make_case(valid, 8, dtype, seed=5, rope_dim=16), (1, 3))
    decode_cases.check(attn, args)  # the same check: any module's paged_sparse_attention


def fp8_keys(case: dict) -> dict:
    """The case with its keys as a column slice of an e4m3 cache (the csa_kv entry rows)."""
    keys = case["key_cache"]
    wide = torch.zeros(keys.shape[0], keys.shape[1] + 24, dtype=FP8, device=keys.device)
    wide[:, 8 : 8 + keys.shape[1]] = keys.to(FP8)
    return {**case, "key_cache": wide[:, 8 : 8 + keys.shape[1]]}


@pytest.mark.parametrize("s,e,hi,di,k", [(1, 300, 16, 64, 64), (9, 96, 16, 64, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_indexer_reads_fp8_keys(s, e, hi, di, k, dtype):
    indexer = importlib.import_module("rackserve.ops.triton.indexer")
    case = fp8_keys(indexer_cases.make_case(s, e, hi, di, seed=e + di, dtype=dtype))
    got = indexer.paged_indexer_topk(**case, k=k)
    ref = reference.paged_indexer_topk(**case, k=k)
    rel = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 q: the bf16 dot's own error
    indexer_cases.assert_same_topk(got, ref, indexer_cases.reference_scores(case), rel)
    if dtype == torch.float32:  # the logits themselves, fp32 rule
        logits = indexer.indexer_logits(**case)
        scores = indexer_cases.reference_scores(case)
        finite = scores.isfinite()
        assert torch.equal(logits.isinf(), scores.isinf())
        assert_fp32_close(logits[finite], scores[finite])


@pytest.mark.parametrize("case", [1, 2])
def test_prefill_indexer_reads_fp8_keys(case):
    indexer = importlib.import_module("rackserve.ops.triton.prefill_indexer")
    requests, s, e, hi, di, k = prefill_indexer_cases.CASES[case]
    raw = prefill_indexer_cases.make_case(requests, s, e, hi, di, seed=case)
    prefill_indexer_cases.check(indexer, fp8_keys(raw), k)


# ---- writers ------------------------------------------------------------------------------


def nan_fp8(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEVICE).to(FP8)


def assert_codes(got: torch.Tensor, own: torch.Tensor, ref: torch.Tensor) -> None:
    """e4m3 rows a kernel wrote (``got``) are the reference's cast of the rows the same kernel
    writes into a cache of the activation dtype (``own``), bit for bit; with fp32
    activations they are also the reference's rows (``ref``), at most one e4m3 step apart
    where the fp32 values straddle a rounding boundary. (bf16: the kernels' bf16 values are
    checked against the fp32 reference by their own tests.)"""
    assert not got.float().isnan().any(), "unwritten (NaN) rows"
    assert torch.equal(got.view(torch.uint8), own.to(FP8).view(torch.uint8))
    if own.dtype != torch.float32:
        return
    g, r = got.float(), ref.float()
    # the e4m3 step at the larger magnitude: 2^(exponent - 3), 2^-9 below 2^-6
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(g.abs(), r.abs()).clamp_min(2**-6))) - 3)
    far = (g - r).abs() > step
    assert not far.any(), (g[far][:8].tolist(), r[far][:8].tolist())
    assert (got.view(torch.uint8) == ref.view(torch.uint8)).float().mean().item() >= 0.99


@pytest.mark.parametrize("t,c,half,width,padded", [(1, 64, 8, 96, 0), (17, 128, 32, 256, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_insert_writes_fp8_rows(t, c, half, width, padded, dtype):
    norm_rope = importlib.import_module("rackserve.ops.triton.norm_rope")
    g = torch.Generator().manual_seed(t + c)
    y = norm_rope_cases.make_x((t, 5 + c + width + 3), seed=t + c, dtype=dtype)
    kv, rows = y[:, 5 : 5 + c], y[:, 5 + c : 5 + c + width]
    weight = (1 + 0.3 * torch.randn(c, generator=g)).to(DEVICE)
    cos, sin = norm_rope_cases.make_cos_sin(t, half, seed=t, dtype=dtype)
    num = 2 * t + 3
    swa_slots = (1 + torch.randperm(num - 1, generator=g)[:t]).to(DEVICE)
    state_slots = (1 + torch.randperm(num - 1, generator=g)[:t]).to(DEVICE)
    if padded:
        swa_slots[-padded:] = 0
        state_slots[-padded:] = 0
    swa, ref_swa = nan_fp8((num, c)), nan_fp8((num, c))
    own = torch.full((num, c), float("nan"), dtype=dtype, device=DEVICE)
    state = torch.full((num, width), float("nan"), dtype=dtype, device=DEVICE)
    eps = norm_rope_cases.EPS
    for op, cache in ((norm_rope.kv_insert, swa), (norm_rope.kv_insert, own),
                      (reference.kv_insert, ref_swa)):  # fmt: skip
        op(kv, weight, eps, cos, sin, cache, swa_slots, rows, state, state_slots)
    real = swa_slots[: t - padded]
    assert_codes(swa[real], own[real], ref_swa[real])
    untouched = torch.ones(num, dtype=torch.bool, device=DEVICE)
    untouched[swa_slots] = False
    assert swa[untouched].float().isnan().all(), "wrote outside the window slots"
    assert torch.equal(state[state_slots[: t - padded]], rows[: t - padded])


@pytest.mark.parametrize("case", [2, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_prologue_writes_fp8_rows(case, dtype):
    from rackserve.ops.triton.attn_prologue import attention_prologue

    t, h, dh, half, width, index, padded = prologue_cases.CASES[case]
    args = prologue_cases._case(case, t, h, dh, half, width, index, padded, dtype)
    own_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    args[6] = nan_fp8(tuple(args[6].shape))
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = attention_prologue(*args)
    own = attention_prologue(*own_args)
    reference.attention_prologue(*ref_args)
    real = args[7][: t - padded]
    assert_codes(args[6][real], own_args[6][real], ref_args[6][real])
    written = torch.zeros(args[6].shape[0], dtype=torch.bool, device=DEVICE)
    written[args[7]] = True
    assert args[6][~written].float().isnan().all(), "wrote outside the window slots"
    assert torch.equal(got[0], own[0])  # q does not depend on the cache's dtype


@pytest.mark.parametrize("case", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_entries_writes_fp8_entries(case, dtype):
    from rackserve.ops.triton import compress

    seed, ratio, overlap, widths, n = compress_cases.ENTRY_CASES[case]
    args = compress_cases._entries_case(seed, ratio, overlap, widths, n, dtype)
    own = args[4]
    args[4] = nan_fp8(tuple(own.shape))
    ref_args = list(args)
    ref_args[4] = args[4].clone()
    compress.compress_entries(*args)
    compress.compress_entries(*args[:4], own, *args[5:])
    reference.compress_entries(*ref_args)
    dst = args[3][args[3] != 0]  # the null slot's content is unspecified (several writers)
    assert_codes(args[4][dst], own[dst], ref_args[4][dst])
    untouched = torch.ones(args[4].shape[0], dtype=torch.bool, device=DEVICE)
    untouched[args[3]] = False
    assert args[4][untouched].float().isnan().all(), "wrote outside the dst slots"


def test_mixed_cache_dtypes_are_refused():
    attn = importlib.import_module("rackserve.ops.triton.sparse_attn")
    args = list(decode_cases.make_case(1, 4, 8, torch.bfloat16, seed=0))
    args[1] = args[1].to(FP8)  # window rows e4m3, compressed rows bf16
    with pytest.raises(ValueError, match="kv_b"):
        attn.paged_sparse_attention(*args)


# ---- the model: every kernel on fp8 caches ----------------------------------------------


@pytest.mark.parametrize("long", [False, pytest.param(True, marks=pytest.mark.slow)])
@torch.inference_mode()
def test_fast_path_on_fp8_caches_matches_the_reference_path(long):
    """The tiny model (fp32) with every Triton kernel (the interpreter on CPU) against the
    reference ops, both on e4m3 caches: a ragged prefill, then two decode steps (short: one
    request's 12-token prefill and one decode step). The
    kernels' fp32 values differ from the reference's by ~1e-6, so a few cached codes land
    one e4m3 step apart (and may flip an indexer pick): caches >= 99% bit-equal, logits
    within 2e-2 of the logit scale (the fp8 cache's own effect is ~0.2: docs/serving.md)."""
    from rackserve.model.batch import KVCacheTensors
    from rackserve.model.create import init_model_
    from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
    from rackserve.model.generate import ContiguousCache
    from rackserve.model.presets import tiny_config

    cfg = tiny_config(num_layers=3, num_experts=8)
    with torch.device(DEVICE):
        fast = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="triton").eval()
        ref = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="reference").eval()
    init_model_(fast, seed=0)
    ref.load_state_dict(fast.state_dict())
    caches = {}
    for name, model in (("fast", fast), ("ref", ref)):
        cache = ContiguousCache(model, 2, 64)
        blocks = {n: t.numel() + 1 for n, t in cache.block_tables.items()}
        cache.tensors = KVCacheTensors(cache.groups, blocks, torch.float32, DEVICE, FP8)
        caches[name] = cache
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 4096, (n,), generator=gen) for n in (37, 20)]
    steps = [
        ([0, 0], [37, 20], torch.cat(prompts)),
        ([37, 20], [1, 1], torch.tensor([9, 11])),
        ([38, 21], [1, 1], torch.tensor([3, 4])),
    ]
    reqs = [0, 1]
    if not long:
        steps, reqs = [([0], [12], prompts[0][:12]), ([12], [1], torch.tensor([9]))], [0]
    for computed, new, ids in steps:
        logits = {}
        for name, model in (("fast", fast), ("ref", ref)):
            meta = caches[name].batch(computed, new, reqs)
            hidden, _ = model(ids.to(DEVICE), meta, caches[name].tensors)
            logits[name] = model.compute_logits(hidden)
        scale = logits["ref"].abs().max()
        assert ((logits["fast"] - logits["ref"]).abs().max() / scale).item() <= 2e-2
    checked = set()
    for group, per_layer in caches["ref"].tensors.tensors.items():
        for layer, expected in per_layer.items():
            got = caches["fast"].tensors.tensors[group][layer]
            assert got.dtype == expected.dtype
            g, e = got.view(torch.uint8), expected.view(torch.uint8)
            written = (g != 0) | (e != 0)  # both caches start as zeros
            if got.dtype == FP8 and written.any():  # (HCA: no entry closed in the short run)
                same = (g == e)[written].float().mean().item()
                assert same >= 0.99, (group, layer, same)
                checked.add(group)
    assert {"swa", "csa_kv"} <= checked, checked


def test_engine_takes_fp8_caches_on_every_device():
    from rackserve.engine.kv_budget import kv_cache_dtype

    for device in ("cpu", "cuda"):  # the GPU kernels read and write e4m3 rows now
        assert kv_cache_dtype("fp8", torch.device(device)) == FP8
        assert kv_cache_dtype("auto", torch.device(device)) is None
