"""What a decode CUDA graph captures, counted on the CPU (Triton's interpreter): the captured
region (``DecodeGraphs.forward``: metadata, forward, logits at the padded batch and context
bucket) launches no more kernels than the eager step, scope by scope; the metadata
kernel (``ops/triton/step_meta.py``) equals ``StepMetadata.build`` field by field; and
sampling inside the graphs leaves the host only the copies of the step's sampling rows
(tiny model, 3 requests: 0 / 4 / 7 launches for greedy / random / filtered steps, against
1 / 61 / 82 launched after the forward when sampling eagerly).

On the H200 the batch-1 graph replayed 227 kernels against the eager forward's 100
(2026-12-01-h200-s3-final-graph-gap.json): ~115 of them were the torch ops of
``StepMetadata.build`` captured with the forward (the eager profile builds it outside)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from rackserve.bench.forward import BatchSpec, synthetic_step
from rackserve.config import SLIDING
from rackserve.kv.spec import cache_groups_for
from rackserve.model.batch import StepMetadata
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import default_layer_types, tiny_config, v4_flash_config
from rackserve.ops.launches import LaunchCounter, count_step_launches
from rackserve.runner.cuda_graph import DecodeGraphs
from rackserve.runner.step_buffers import StepBuffers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernels (interpreter on CPU)",
)


def _bench_like_model() -> DeepseekV4ForCausalLM:
    """The bench model's layer schedule (HCA, HCA, HCA, CSA; hash MoE first) at tiny dims."""
    cfg = dataclasses.replace(
        tiny_config(4, 8),
        layer_types=default_layer_types(4),
        mlp_layer_types=("hash_moe",) * 3 + ("moe",),
    )
    with torch.device(DEVICE):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="triton")
    init_model_(model.cast(torch.bfloat16), seed=0)
    return model.eval()


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="counts interpreted Triton launches"
)
@torch.inference_mode()
def test_captured_step_launches_no_more_than_eager():
    """decode:1 at context 35 (tiny ratios 4 / 16: the CSA window closes, HCA's does not).
    Per scope, the captured region launches at most what the eager step does, except one
    compression launch per layer whose window did not close (the graph cannot skip it);
    its metadata is one launch per cache group and compression plan (the first writes the
    token mask and zeroes the expert counts), less one per state group (its compression plan
    writes its slot mapping)."""
    model = _bench_like_model()
    s = synthetic_step(model, BatchSpec.parse("decode:1@35"))
    buffers = StepBuffers(s.groups, s.input_batch.block_tables, DEVICE)
    graphs = DecodeGraphs(model, s.caches, buffers, s.groups, [1], [64])
    key = graphs.key_for(s.step.inputs)
    counts = count_step_launches(graphs, key, s.step.inputs, s.step.table_writes)
    totals = {m: {k: sum(c.values()) for k, c in v.items()} for m, v in counts.items()}
    print(totals)
    eager, graph = totals["eager"], totals["graph"]
    # one launch per group and per compression plan, less the state groups' slot mappings,
    # which their compression plans write (the token mask and the counts' zeroing: the first)
    bound = len(s.groups)
    assert graph["metadata"] <= bound, counts["graph"]["metadata"]
    assert graph["outside"] <= eager["outside"], counts
    position = 35
    for i, layer in enumerate(model.model.layers):
        name = f"{i}:{layer.attn.kind}"
        ratio = layer.attn.ratio
        skipped = layer.attn.kind != SLIDING and (position + 1) % ratio != 0
        assert graph[name] <= eager[name] + skipped, (name, counts["graph"][name])
    assert sum(graph.values()) < sum(eager.values())


def _random_step(seed: int):
    """Groups, the full device tables, and a graph-shaped step: T tokens of T requests (the
    last ones padded: null row, position 0, masked), a context bucket."""
    g = torch.Generator().manual_seed(seed)
    cfg = v4_flash_config(4, 8) if seed % 4 == 3 else tiny_config(3 + seed % 3, 4)
    groups = cache_groups_for(cfg, dtype_bytes=2)
    t = 1 + seed % 9
    max_reqs = t + 3
    null_row = max_reqs
    bucket = [64, 96, 4096][seed % 3] if seed % 4 != 3 else 4096
    if seed == 6:  # shorter than the HCA ratio: no entries yet
        bucket = 12
    positions = torch.randint(0, bucket, (t,), generator=g)
    positions[0] = [0, 3, bucket - 1, 15][seed % 4]  # window start, first closes, the end
    if seed % 5 == 0:  # the last position where every group's window closes
        positions[0] = bucket // cfg.hca_ratio * cfg.hca_ratio - 1
    rows = torch.randperm(max_reqs, generator=g)[:t]
    num_pad = seed % 3 if t > 2 else 0
    if num_pad:
        rows[-num_pad:] = null_row
        positions[-num_pad:] = 0
    tables = {}
    for grp in groups:
        # short tables now and then: paged_slots clamps columns past the end of a linear
        # table and wraps around a sliding group's ring
        cols = max(1, -(-bucket // grp.block_tokens) - (seed % 2))
        if grp.is_sliding and seed % 3:  # a ring narrower than the bucket: columns wrap
            cols = min(cols, 2 + seed % 4)
        table = torch.randint(1, 1000, (max_reqs + 1, cols), generator=g)
        table[null_row] = 0
        tables[grp.name] = table
    return cfg, groups, positions, torch.arange(t), rows, tables, bucket, rows != null_row


def _assert_same(got, want, what) -> None:
    if want is None:
        assert got is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(got, want), what


def _assert_same_metadata(got: StepMetadata, want: StepMetadata, combined) -> None:
    assert got.slot_mapping.keys() == want.slot_mapping.keys()
    for name, slots in want.slot_mapping.items():
        _assert_same(got.slot_mapping[name], slots, ("slot_mapping", name))
    assert got.gather.keys() == want.gather.keys()
    for name, gw in want.gather.items():
        for f in ("slots", "valid", "num_visible"):
            _assert_same(getattr(got.gather[name], f), getattr(gw, f), (name, f))
    assert got.compression.keys() == want.compression.keys()
    for name, cw in want.compression.items():
        for f in ("src", "missing", "dst", "positions"):
            _assert_same(getattr(got.compression[name], f), getattr(cw, f), (name, f))
    for name in combined:
        _assert_same(got.window_and_entries_valid(name), want.window_and_entries_valid(name), name)
    assert got.max_seq_len == want.max_seq_len
    if want.token_mask is None:
        assert got.token_mask is None
    else:
        assert torch.equal(got.token_mask, want.token_mask)


@needs_triton
@pytest.mark.parametrize("seed", range(24))
def test_step_metadata_matches_build(seed, monkeypatch):
    from rackserve.ops.triton import step_meta

    cfg, groups, positions, req, rows, tables, bucket, mask = _random_step(seed)
    args = [x.to(DEVICE) for x in (positions, req, rows, mask)]
    tables = {k: v.to(DEVICE) for k, v in tables.items()}
    hca = {grp.name for grp in groups if grp.ratio > 1 and grp.ratio == cfg.hca_ratio}
    real_empty = torch.empty

    def poisoned(*a, **kw):
        out = real_empty(*a, **kw)
        return out.fill_(True) if out.dtype == torch.bool else out.fill_(-7)

    monkeypatch.setattr(step_meta.torch, "empty", poisoned)
    pos, req, rows, mask = args
    counts = torch.full((3, 5), 9, dtype=torch.int64, device=DEVICE)
    null_row = next(iter(tables.values())).shape[0] - 1  # the tables' last row
    if seed % 5 == 4:  # no padding rows: no mask
        null_row, mask = None, None
    got = step_meta.step_metadata(groups, pos, req, rows, tables, bucket, null_row, hca, counts)
    assert not counts.any()  # the first launch clears it
    ratios = sorted({grp.ratio for grp in groups if grp.ratio > 1})
    want = StepMetadata.build(
        groups, pos, req, {k: v[rows] for k, v in tables.items()}, bucket,
        {r: req for r in ratios}, token_mask=mask,
    )  # fmt: skip
    _assert_same_metadata(got, want, hca)


@needs_triton
@pytest.mark.parametrize("seed", range(12))
def test_graph_metadata_of_speculation_steps_matches_build(seed):
    """The speculation graphs' shapes (``spec_decode/graphs.py``): a verify step of R
    requests x (1 + K) consecutive tokens, the padded requests' tokens on the null row at
    position 0 (every group, masked), and the MTP proposal's passes (the sliding group
    alone: the first over those rows unmasked, a chained one of a token a request masked).
    ``GraphMetadata``'s metadata kernels equal its torch path field by field."""
    from rackserve.runner.cuda_graph import GraphMetadata

    cfg, groups, start, _, rows, tables, bucket, _ = _random_step(seed)
    null_row = next(iter(tables.values())).shape[0] - 1
    width = 2 + seed % 3
    req = torch.arange(len(rows)).repeat_interleave(width)
    positions = (start[req] + torch.arange(width).repeat(len(rows))).clamp(max=bucket - 1)
    positions[rows[req] == null_row] = 0
    with torch.device("meta"):  # the layers' kinds and groups only: no weights
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="triton")
    tables = {k: v.to(DEVICE) for k, v in tables.items()}
    swa = [g for g in groups if g.name == "swa"]
    positions, req, rows = (x.to(DEVICE) for x in (positions, req, rows))
    every = torch.arange(len(req), device=DEVICE)
    one = torch.arange(len(rows), device=DEVICE)
    cases = [  # (groups, positions, token_req, every token, masked, counts)
        (groups, positions, req, every, True, True),
        (swa, positions, req, None, False, False),
        (swa, start.to(DEVICE).clamp(max=bucket - 2) + 1, one, None, True, False),
    ]
    for case_groups, pos, token_req, every_token, masked, with_counts in cases:
        meta = GraphMetadata(model, case_groups, tables, null_row, torch.device(DEVICE))
        assert meta.fast
        got_want = []
        for fast in (True, False):
            meta.fast = fast
            counts = torch.full((3, 5), 9, dtype=torch.int64, device=DEVICE)
            clear = counts if with_counts else None
            got_want.append(meta(pos, token_req, rows, bucket, every_token, clear, masked))
            assert not counts.any() if with_counts else counts.eq(9).all()
        got, want = got_want
        _assert_same_metadata(got, want, meta.combined)
        if masked:
            real = int((rows[token_req] != null_row).sum())
            assert int(got.token_mask.sum()) == real
        else:
            assert got.token_mask is None


@needs_triton
def test_step_metadata_rejects_bad_tables():
    from rackserve.ops.triton import step_meta

    groups = cache_groups_for(tiny_config(3, 4), dtype_bytes=2)
    tables = {grp.name: torch.zeros(3, 4, dtype=torch.int32) for grp in groups}
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        step_meta.step_metadata(groups, one, one, one, tables, 64)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="reads interpreted Triton launches"
)
@pytest.mark.parametrize("tokens", [1, 4])
@torch.inference_mode()
def test_eager_compile_keys_do_not_follow_the_context(tokens):
    """Eager steps (speculative drafts, prefill chunks, steps no graph fits) at three
    context lengths inside one power-of-two bucket of every width compile the same kernel
    variants: a constexpr that follows the context is a JIT compile per step on a GPU.
    The tiny CSA picks min(E, top-k = 8) entries, so K = E = 5, 6, 7 here (the selection
    kernel's compile-time K cost the H200's speculative step ~85 ms, every step)."""
    model = _bench_like_model()
    keys = []
    for context in (20, 24, 28) if tokens == 1 else (17, 21, 24):
        s = synthetic_step(model, BatchSpec.parse(f"decode:1@{context}x{tokens}"))
        buffers = StepBuffers(s.groups, s.input_batch.block_tables, DEVICE)
        with LaunchCounter() as counter:
            ids, meta, idx = buffers.eager_step(s.step.inputs, s.step.table_writes)
            hidden, _ = model(ids, meta, s.caches)
            model.compute_logits(hidden[idx])
        assert counter.compile_keys
        keys.append(counter.compile_keys)
    for other in keys[1:]:
        assert other == keys[0], sorted(other ^ keys[0])


def _host_launches(graphs: DecodeGraphs, run) -> dict[str, int]:
    """Launches of ``run()`` per region: "forward" and "sample" (what the forward and
    sampler graphs capture) and "outside" (what the host launches itself)."""
    counter = LaunchCounter()

    def scoped(real, name: str):
        def call(*args):
            with counter.scope(name):
                return real(*args)

        return call

    graphs.forward = scoped(graphs.forward, "forward")
    graphs.sampling.sample = scoped(graphs.sampling.sample, "sample")
    try:
        with counter:
            run()
    finally:
        del graphs.forward, graphs.sampling.sample
    return {scope: counter.total(scope) for scope in ("outside", "forward", "sample")}


@pytest.mark.parametrize("kind", ["greedy", "random", "filters"])
@torch.inference_mode()
def test_sampling_in_the_graph_leaves_the_host_only_the_staging_copies(kind, tmp_path):
    """A decode step of 3 requests padded to 4. Sampling eagerly, the host launches every
    kernel of the logits processors and ``sample`` after the forward (~50 for a random
    step); sampling in the graph it launches only the copies of the step's rows into the
    static buffers, before the replay, and the sampler graph captures what ``sample``
    launches, plus the greedy pick of mixed batches and the copy of the ids."""
    from rackserve.model.create import create_checkpoint
    from rackserve.model.loader import load_model
    from rackserve.request import SamplingParams
    from rackserve.runner.graph_sampling import in_graph_sampling
    from rackserve.runner.logits_processors import apply_logits_processors
    from rackserve.runner.sampler import sample
    from rackserve.runner.sampling_tensors import SamplingTensors

    model = load_model(create_checkpoint(tiny_config(3, 4), tmp_path, seed=0))
    s = synthetic_step(model, BatchSpec.parse("decode:3@35"))
    buffers = StepBuffers(s.groups, s.input_batch.block_tables, "cpu")
    graphs = DecodeGraphs(model, s.caches, buffers, s.groups, [4], [64])
    inputs, writes = s.step.inputs, s.step.table_writes
    key = graphs.key_for(inputs)
    params = {
        "greedy": [SamplingParams(temperature=0)] * 3,
        "random": [SamplingParams(temperature=0.7, seed=i) for i in range(3)],
        "filters": [  # every filter used: the eager step runs each of them too
            SamplingParams(temperature=0.7, top_k=5, seed=0),
            SamplingParams(temperature=0.7, top_p=0.9, seed=1),
            SamplingParams(temperature=0.7, min_p=0.1, seed=2),
        ],
    }[kind]
    tensors = SamplingTensors.from_params(
        params,
        prompt_token_ids=[[2] * 35] * 3,
        output_token_ids=[[]] * 3,
        vocab_size=model.cfg.vocab_size,
        eos_token_ids=[1],
    )
    in_graph = in_graph_sampling(tensors, params)
    assert in_graph is not None

    def eager() -> None:
        logits = graphs.run(key, inputs, writes).logits
        sample(apply_logits_processors(logits, params), tensors)

    base = _host_launches(graphs, lambda: graphs.run(key, inputs, writes))
    eagerly = _host_launches(graphs, eager)
    in_graphs = _host_launches(graphs, lambda: graphs.run(key, inputs, writes, None, in_graph))
    print(kind, {"base": base, "eager": eagerly, "in graph": in_graphs})
    eager_sampling = eagerly["outside"] - base["outside"]
    staging = in_graphs["outside"] - base["outside"]
    assert eagerly["sample"] == 0 and base["sample"] == 0
    assert staging == {"greedy": 0, "random": 4, "filters": 7}[kind]  # row copies, fills
    assert eager_sampling >= {"greedy": 1, "random": 50, "filters": 60}[kind]
    assert in_graphs["sample"] <= eager_sampling + 3
    assert in_graphs["forward"] == base["forward"]
