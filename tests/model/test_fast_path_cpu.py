"""The whole fast path (every Triton kernel, the fused projections and mHC, the shared
expert folded into the MoE) on CPU under Triton's interpreter (or on the GPU): it matches
the reference kernels in fp32 (1e-4), and a decode layer dispatches at most
``MAX_LAUNCHES_PER_LAYER`` kernels (the M2 gate; counted by ``ops.launches``)."""

from __future__ import annotations

import os

import pytest
import torch

from rackserve import ops
from rackserve.model.attention import Attention
from rackserve.model.batch import StepMetadata
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.generate import ContiguousCache
from rackserve.model.presets import tiny_config
from rackserve.ops.launches import count_layer_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
# fp32 logits, fast vs reference: the interpreter runs every kernel in exact IEEE fp32 (1e-4,
# the kernels' own rule); on a GPU the whole model answers to the M1 gate (1e-3 of the logit
# scale, as tests/model/test_gpu_fastpath.py): exp / sin / cos run as approximations there,
# FMA contraction and cuBLAS algorithm choice reorder sums, through 3 layers and 4 steps
LOGIT_TOL = 1e-4 if DEVICE == "cpu" else 1e-3
CACHE_TOL = 1e-4
MAX_LAUNCHES_PER_LAYER = 20
# per layer kind, where the count is lower (a regression there fails before the gate)
MAX_LAUNCHES = {"sliding_attention": 18, "heavily_compressed_attention": 17}


def _models(num_layers: int = 3, num_experts: int = 8):
    cfg = tiny_config(num_layers, num_experts)
    with torch.device(DEVICE):
        fast = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="triton")
        ref = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="reference")
    init_model_(fast, seed=0)
    ref.load_state_dict(fast.state_dict())
    return fast.eval(), ref.eval()


def _graph_step(cache: ContiguousCache, positions: list[int], max_len: int) -> StepMetadata:
    """Decode metadata as a CUDA graph builds it: every token a closing candidate, the last
    row a padded one (null block tables, masked)."""
    n = len(positions)
    req = torch.arange(n, device=DEVICE)
    tables = {name: t[:n].clone() for name, t in cache.block_tables.items()}
    for t in tables.values():
        t[-1] = 0
    mask = torch.ones(n, dtype=torch.bool, device=DEVICE)
    mask[-1] = False
    ratios = sorted({g.ratio for g in cache.groups if g.ratio > 1})
    return StepMetadata.build(
        cache.groups, torch.tensor(positions, device=DEVICE), req, tables, max_len,
        {r: req for r in ratios},
        token_mask=mask,
    )  # fmt: skip


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="counts interpreted Triton launches"
)
@torch.inference_mode()
def test_decode_layer_launch_count():
    fast, _ = _models()
    fast.cast(torch.bfloat16)  # as the GPU runs it (fp32 would hide the dtype casts)
    cache = ContiguousCache(fast, 3, 128)
    meta = _graph_step(cache, [63, 40, 0], 128)
    ids = torch.tensor([5, 7, 0], device=DEVICE)
    counts = torch.zeros(3, 8, dtype=torch.int64, device=DEVICE)
    fast(ids, meta, cache.tensors, counts)  # the first step fuses the weights
    counter, names = count_layer_launches(fast, lambda: fast(ids, meta, cache.tensors, counts))
    assert counter.host_syncs == 0
    per_layer = {name: counter.total(name) for name in names}
    print(per_layer, "outside:", counter.total("outside"))
    for name in names:
        limit = MAX_LAUNCHES.get(name.split(":")[1], MAX_LAUNCHES_PER_LAYER)
        assert per_layer[name] <= limit, (name, counter.by_scope[name])


@pytest.fixture
def ieee_fp32_matmul():
    """Plain fp32 GEMMs (no TF32) while the test runs, whatever a previous import set."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32 = saved[1]


@torch.inference_mode()
@pytest.mark.parametrize("switches", ["decode_kernels", "prefill", "wide", "indexer_beside_q"])
def test_fp32_fast_path_matches_reference(ieee_fp32_matmul, monkeypatch, switches):
    """Prefill, two eager decode steps, then a graph-style step. On a GPU this failed in
    session 3 with the text lost: every comparison now prints its error (run with -s), and
    caches skip block 0 (the null block: a graph-style step's non-closing candidates all
    write their garbage entry to slot 0, in an order a GPU does not fix). ``prefill``: the
    57-token prefill takes the prefill kernels, the attention getting the raw q
    (``Kernels.attention_norms_q``: the prologue leaves q alone). ``wide``: every step takes
    what the switches otherwise keep for large batches (the prefill attention and indexer,
    hc_post_pre's expand apart, K2 as mixes + collapse), as a decode batch does when the
    thresholds are lowered for it (benchmarks/sessions/gpu_s26a.sh). ``indexer_beside_q``: the CSA
    layer's indexer issued for a side stream beside the q projection (on CPU in issue order),
    the attention norming q."""
    print(f"device {DEVICE}", torch.cuda.get_device_name() if DEVICE == "cuda" else "")
    min_tokens = {"prefill": 24, "wide": 1}.get(switches)
    if min_tokens is not None:
        monkeypatch.setattr(ops, "PREFILL_ATTENTION_MIN_TOKENS", min_tokens)
        monkeypatch.setattr(ops, "PREFILL_ATTN_MIN_TOKENS", min_tokens)
    if switches == "wide":
        from rackserve.ops.triton import mhc

        monkeypatch.setattr(mhc, "POST_APART_MIN_TOKENS", 1)
        monkeypatch.setattr(mhc, "MIXES_APART_MIN_TOKENS", 1)
    beside = []  # the CSA layer's steps through Attention._indexer_beside_q
    if switches == "indexer_beside_q":
        monkeypatch.setattr(ops, "INDEXER_BESIDE_Q_MAX_TOKENS", 64)
        original = Attention._indexer_beside_q
        monkeypatch.setattr(
            Attention, "_indexer_beside_q", lambda *a: beside.append(1) or original(*a)
        )
    fast, ref = _models()
    models = {"fast": fast, "ref": ref}
    norms_q = fast.kernels.attention_norms_q
    assert norms_q(torch.zeros(57, 1, device=DEVICE)) == (min_tokens is not None)
    assert norms_q(torch.zeros(2, 1, device=DEVICE)) == (switches == "wide")
    caches = {m: ContiguousCache(model, 3, 96) for m, model in models.items()}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 4096, (n,), generator=gen) for n in (37, 20)]
    steps = [
        ([0, 0], [37, 20], torch.cat(prompts)),  # ragged prefill
        ([37, 20], [1, 1], torch.tensor([9, 11])),  # eager decode
        ([38, 21], [1, 1], torch.tensor([3, 4])),
    ]
    steps = [(c, n, ids.to(DEVICE)) for c, n, ids in steps]
    for i, (computed, new, ids) in enumerate(steps):
        logits = {}
        for m, model in models.items():
            meta = caches[m].batch(computed, new, [0, 1])
            hidden, _ = model(ids, meta, caches[m].tensors)
            logits[m] = model.compute_logits(hidden)
        _assert_close(logits["fast"], logits["ref"], ("step", i, "logits"), LOGIT_TOL)
    # a graph-style decode step (padded row, every token a closing candidate)
    logits = {}
    for m, model in models.items():
        meta = _graph_step(caches[m], [39, 22, 0], 96)
        counts = torch.zeros(3, 8, dtype=torch.int64, device=DEVICE)
        ids = torch.tensor([6, 8, 0], device=DEVICE)
        hidden, _ = model(ids, meta, caches[m].tensors, counts)
        logits[m] = (model.compute_logits(hidden)[:2], counts)
    _assert_close(logits["fast"][0], logits["ref"][0], ("graph step", "logits"), LOGIT_TOL)
    assert torch.equal(logits["fast"][1], logits["ref"][1]), (logits["fast"][1], logits["ref"][1])
    for group, per_layer in caches["ref"].tensors.tensors.items():
        for layer, expected in per_layer.items():
            got = caches["fast"].tensors.tensors[group][layer]
            _assert_close(got[1:], expected[1:], (group, layer), CACHE_TOL)
    assert len(beside) == (4 if switches == "indexer_beside_q" else 0)  # one CSA layer


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what=None, tol: float = 1e-4) -> None:
    """max |got - ref| <= tol * max |ref|; prints the error and, past it, where it is."""
    scale = ref.abs().max().clamp_min(1e-6)
    err = (got - ref).abs()
    rel = (err.max() / scale).item()
    print(f"{what}: max |fast - ref| / scale = {rel:.2e} (tol {tol:.0e})")
    if not rel <= tol:
        flat = int(err.flatten().argmax())
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
        bad = (err > tol * scale).nonzero()
        raise AssertionError(
            f"{what}: rel {rel:.3e} > {tol:.0e}; worst at {at}: fast "
            f"{got.flatten()[flat].item():.6g} ref {ref.flatten()[flat].item():.6g}; "
            f"{len(bad)} of {err.numel()} elements out, first {bad[:8].tolist()}; "
            f"nan fast {int(got.isnan().sum())} ref {int(ref.isnan().sum())}"
        )


def test_fused_weights_keep_the_checkpoint_layout():
    """The fast path's fused weights are views: state_dict, loading and casting work as
    before, and a cast model fuses again."""
    fast, ref = _models()
    before = {k: v.clone() for k, v in fast.state_dict().items()}
    cache = ContiguousCache(fast, 3, 64)
    step = _graph_step(cache, [15, 3, 0], 64)
    ids = torch.tensor([5, 7, 0], device=DEVICE)
    with torch.inference_mode():
        fast(ids, step, cache.tensors)
    after = fast.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert after[k].shape == v.shape and torch.equal(after[k], v), k
    attn, moe = fast.model.layers[1].attn, fast.model.layers[1].ffn
    fused = attn._fusion("x", attn._x_linears()).fused
    assert fused is not None and attn.wq_a.weight.data_ptr() == fused.data_ptr()
    assert moe.shared_experts.w2.weight.data_ptr() == moe._with_shared()[1].fused[-1].data_ptr()
    state = ref.state_dict()
    state["model.layers.1.attn.wkv.weight"] = torch.zeros_like(attn.wkv.weight)
    fast.load_state_dict(state)  # copies into the views
    assert attn._fusion("x", attn._x_linears()).intact()
    q_lora = attn.wq_a.out_features
    assert (attn._fusion("x", attn._x_linears()).get()[q_lora : q_lora + attn.head_dim] == 0).all()
    fast.cast(torch.bfloat16)  # fuses again at once: loading then copies into the views
    assert (
        attn._fusion("x", attn._x_linears()).intact()
        and attn._fusion("x", attn._x_linears()).get().dtype == torch.bfloat16
    )
    attn.wkv.weight.data = attn.wkv.weight.data.clone()  # as .to() would: no longer a view
    assert not attn._fusion("x", attn._x_linears()).intact()
    cache = ContiguousCache(fast, 3, 64)
    with torch.inference_mode():
        hidden, _ = fast(ids, step, cache.tensors)
    assert (
        attn._fusion("x", attn._x_linears()).intact()
        and attn._fusion("x", attn._x_linears()).get().dtype == torch.bfloat16
    )
    assert not hidden.isnan().any()
