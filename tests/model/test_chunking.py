"""Chunked prefill is invisible: the tiny model (fp32, CPU) gives the same logits and writes
the same caches whether a prompt runs whole, in 512-token or in 97-token chunks, after a
prefix hit at a 256-aligned boundary, or on the fast kernels (the Triton prefill and decode
attention and indexer under the interpreter, the grouped-GEMM MoE) instead of the
references.

Positions of the 600-token prompt, chunked::

    0 ........ 256 ........ 512 ........ 600
    |----------- whole -----------------|
    |-------- 512 ---------|--- 88 -----|
    |-97-|-97-|-97-|-97-|-97-|-97-|-18-|
    |- prefix hit -|------ 344 ---------|   (blocks of [0, 256) copied from another request)
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from rackserve import ops
from rackserve.kv.spec import prefix_alignment
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.generate import ContiguousCache
from rackserve.model.presets import tiny_config
from rackserve.ops.grouped_moe import moe_experts_grouped

PROMPT = 600
TOL = 1e-4  # fp32: max |diff| / logit scale (summation orders differ between chunkings)


def tiny_model(num_layers: int = 6) -> DeepseekV4ForCausalLM:
    cfg = tiny_config(num_layers, vocab_size=1024)
    model = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="reference")
    init_model_(model, seed=0)
    return model.eval()


def use_kernels(model: DeepseekV4ForCausalLM, table: ops.Kernels) -> DeepseekV4ForCausalLM:
    """Point every module that holds the op table at ``table``."""
    for module in model.modules():
        if isinstance(getattr(module, "kernels", None), ops.Kernels):
            module.kernels = table
    return model


def fast_table(min_prefill_tokens: int = 8) -> ops.Kernels:
    """The references, with the Triton attention and indexer (prefill kernels from
    ``min_prefill_tokens`` queries, decode kernels below) and the grouped MoE: the fast
    path as far as the CPU runs it (the interpreter runs the kernels on CPU tensors)."""

    def triton_op(name: str, prefill: str, decode: str):
        return ops._by_num_tokens(
            getattr(importlib.import_module(f"rackserve.ops.triton.{decode}"), name),
            getattr(importlib.import_module(f"rackserve.ops.triton.{prefill}"), name),
            min_prefill_tokens,
        )

    return dataclasses.replace(
        ops.kernels("reference"),
        name="auto",
        paged_sparse_attention=triton_op("paged_sparse_attention", "prefill_attn", "sparse_attn"),
        paged_indexer_topk=triton_op("paged_indexer_topk", "prefill_indexer", "indexer"),
        moe_experts=moe_experts_grouped,
    )


def prompt(length: int = PROMPT) -> torch.Tensor:
    return torch.randint(2, 1024, (length,), generator=torch.Generator().manual_seed(0))


@torch.inference_mode()
def run_chunks(
    model, ids: torch.Tensor, chunks: list[int], cache=None, req: int = 0, start: int = 0
) -> tuple[torch.Tensor, ContiguousCache]:
    """Logits [sum(chunks), V] of request ``req`` fed ``ids[start:]`` in ``chunks``."""
    cache = cache or ContiguousCache(model, 1, len(ids))
    done, logits = start, []
    for n in chunks:
        hidden, _ = model(ids[done : done + n], cache.batch([done], [n], [req]), cache.tensors)
        logits.append(model.compute_logits(hidden))
        done += n
    assert done == len(ids)
    return torch.cat(logits), cache


def chunks_of(size: int, total: int) -> list[int]:
    return [min(size, total - a) for a in range(0, total, size)]


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def request_blocks(cache: ContiguousCache, req: int, group: str, layer: int) -> torch.Tensor:
    """The cache rows of request ``req`` in one (group, layer): [blocks, per block, width]."""
    return cache.tensors.tensors[group][layer][cache.block_tables[group][req]]


def assert_same_caches(got: ContiguousCache, ref: ContiguousCache, got_req=0, ref_req=0):
    for group, per_layer in ref.tensors.tensors.items():
        for layer in per_layer:
            expected = request_blocks(ref, ref_req, group, layer)
            rel = relative(request_blocks(got, got_req, group, layer), expected)
            assert rel <= TOL, f"{group} layer {layer}: {rel:.2e}"


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def whole(model):
    return run_chunks(model, prompt(), [PROMPT])


@pytest.mark.parametrize("size", [512, 97])
def test_chunking_invariance_reference(model, whole, size):
    logits, cache = run_chunks(model, prompt(), chunks_of(size, PROMPT))
    assert relative(logits, whole[0]) <= TOL
    assert torch.equal(logits.argmax(-1), whole[0].argmax(-1))
    assert_same_caches(cache, whole[1])


def prefix_hit(model, ids: torch.Tensor, hit: int) -> tuple[torch.Tensor, ContiguousCache]:
    """Request 1 starts from request 0's blocks of positions [0, ``hit``) (what a prefix-cache
    hit maps in) and prefills the rest: its logits [len(ids) - hit, V] and the cache."""
    cache = ContiguousCache(model, 2, len(ids))
    assert hit % prefix_alignment(cache.groups) == 0
    run_chunks(model, ids, [len(ids)], cache, req=0)
    for group, per_layer in cache.tensors.tensors.items():
        spec = next(g for g in cache.groups if g.name == group)
        blocks = hit // spec.block_tokens
        src, dst = cache.block_tables[group][0, :blocks], cache.block_tables[group][1, :blocks]
        for tensor in per_layer.values():
            tensor[dst] = tensor[src]
    logits, _ = run_chunks(model, ids, [len(ids) - hit], cache, req=1, start=hit)
    return logits, cache


def test_prefix_hit_at_256_equals_cold_prefill(model, whole):
    """The hit's logits and caches equal the cold prefill's."""
    logits, cache = prefix_hit(model, prompt(), 256)
    assert relative(logits, whole[0][256:]) <= TOL
    assert torch.equal(logits.argmax(-1), whole[0][256:].argmax(-1))
    assert_same_caches(cache, whole[1], got_req=1)


@pytest.mark.parametrize("hit", [32, 64])
def test_fast_kernels_prefix_hit_equals_cold_prefill(hit):
    """fp32, the fast kernels (prefill attention and indexer with cached rows, the grouped
    MoE): a hit at an aligned boundary gives the cold prefill's logits and caches, and both
    match the references'. 80 tokens, 3 layers (one of each kind): past a CSA window of 4
    and an HCA window of 16 entries, with a swa ring of 16 tokens."""
    ref = tiny_model(3)
    fast = use_kernels(tiny_model(3), fast_table())
    ids = prompt(80)
    cold_ref, cache_ref = run_chunks(ref, ids, [80])
    cold, cache_cold = run_chunks(fast, ids, [80])
    assert relative(cold, cold_ref) <= 1e-3
    logits, cache = prefix_hit(fast, ids, hit)
    assert relative(logits, cold[hit:]) <= TOL
    assert torch.equal(logits.argmax(-1), cold_ref[hit:].argmax(-1))
    assert_same_caches(cache, cache_cold, got_req=1)
    assert_same_caches(cache, cache_ref, got_req=1)


@pytest.mark.parametrize(
    "num_layers,length,chunk,steps",
    [(3, 48, 17, 2), pytest.param(6, 160, 97, 4, marks=pytest.mark.slow)],  # slow: ~3 min
)
def test_fast_kernels_match_reference_and_are_chunking_invariant(num_layers, length, chunk, steps):
    """fp32: the Triton attention kernels + grouped MoE against the references (a prompt
    whole, then in chunks, then greedy decode steps; 3 layers: one of each kind), logits
    within 1e-3 of the logit scale, the same greedy tokens, the same caches."""
    ref = tiny_model(num_layers)
    fast = use_kernels(tiny_model(num_layers), fast_table())
    ids = prompt(length + steps)
    ref_logits, ref_cache = run_chunks(ref, ids[:length], [length])
    for chunks in ([length], chunks_of(chunk, length)):
        logits, cache = run_chunks(fast, ids[:length], chunks)
        assert relative(logits, ref_logits) <= 1e-3
        assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
        assert_same_caches(cache, ref_cache)
    # decode steps on top (the decode kernel: one query per step)
    tokens = [int(ref_logits[-1].argmax())]
    big = {m: ContiguousCache(x, 1, length + steps) for m, x in (("ref", ref), ("fast", fast))}
    for name, m in (("ref", ref), ("fast", fast)):
        run_chunks(m, ids[:length], [length], big[name])
    for step in range(steps):
        pos = length + step
        token = torch.tensor(tokens[-1:])
        out = {}
        for name, m in (("ref", ref), ("fast", fast)):
            with torch.inference_mode():
                hidden, _ = m(token, big[name].batch([pos], [1], [0]), big[name].tensors)
                out[name] = m.compute_logits(hidden)
        assert relative(out["fast"], out["ref"]) <= 1e-3, f"decode step {step}"
        assert torch.equal(out["fast"].argmax(-1), out["ref"].argmax(-1))
        tokens.append(int(out["ref"][-1].argmax()))


@torch.inference_mode()
def test_mixed_step_fast_matches_reference():
    """One step holding a 23-token prefill chunk of request 0 and a decode of request 1 (40
    tokens cached): the indexer's 4-query tile of tokens 20..23 straddles the two requests
    (its per-query fallback); logits and caches match the references."""
    ref = tiny_model(3)
    fast = use_kernels(tiny_model(3), fast_table())
    ids0 = prompt(23)
    ids1 = torch.randint(2, 1024, (41,), generator=torch.Generator().manual_seed(1))
    out, caches = {}, {}
    for name, m in (("ref", ref), ("fast", fast)):
        cache = ContiguousCache(m, 2, 64)
        m(ids1[:40], cache.batch([0], [40], [1]), cache.tensors)
        step = cache.batch([0, 40], [23, 1], [0, 1])
        hidden, _ = m(torch.cat([ids0, ids1[40:]]), step, cache.tensors)
        out[name], caches[name] = m.compute_logits(hidden), cache
    assert relative(out["fast"], out["ref"]) <= 1e-3
    assert torch.equal(out["fast"].argmax(-1), out["ref"].argmax(-1))
    for req in (0, 1):
        assert_same_caches(caches["fast"], caches["ref"], req, req)


@torch.inference_mode()
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_head_rows_are_those_rows_of_the_whole_head(kernels):
    """``head_rows``: the hyper head and norm on the rows that need logits only (the
    runner's and bench forward's prefill path) give those rows of the whole hidden state
    (the Triton mHC bitwise; the reference's matmul within fp32 rounding) and the same
    streams and caches."""
    model = use_kernels(tiny_model(3), ops.kernels(kernels))
    ids = prompt(40)
    rows = torch.tensor([0, 21, 39])
    out = {}
    for name, head_rows in (("whole", None), ("rows", rows)):
        cache = ContiguousCache(model, 1, 40)
        hidden, streams = model(ids, cache.batch([0], [40], [0]), cache.tensors, None, head_rows)
        out[name] = hidden, streams, cache
    (whole, streams, cache), (got, got_streams, got_cache) = out["whole"], out["rows"]
    assert got.shape == (3, whole.shape[1]) and torch.equal(got_streams, streams)
    if kernels == "triton":
        assert torch.equal(got, whole[rows])
    assert relative(got, whole[rows]) <= 1e-6
    assert_same_caches(got_cache, cache)
