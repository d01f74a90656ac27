"""The decode-graph step on the CPU: the padded, graph-shaped step (null rows, every token
a closing candidate, a context bucket) computes what the eager step computes, and the
device block tables follow the host tables by deltas."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch

from rackserve.bench.forward import BatchSpec, synthetic_step
from rackserve.model.batch import KVCacheTensors
from rackserve.model.create import create_checkpoint
from rackserve.model.loader import load_model
from rackserve.model.presets import tiny_config
from rackserve.runner.cuda_graph import (
    PREFILL_GRAPH_TOKENS,
    DecodeGraphs,
    PrefillGraphs,
    context_buckets,
    frozen_gc,
    graph_batch_sizes,
    graph_serves,
    prefill_graph_sizes,
)
from rackserve.runner.inputs import BlockTables
from rackserve.runner.step_buffers import StaticInputs, StepBuffers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0))


def _random_caches(synthetic, seed: int) -> KVCacheTensors:
    caches = synthetic.caches
    gen = torch.Generator().manual_seed(seed)
    for per_layer in caches.tensors.values():
        for t in per_layer.values():
            t.copy_(torch.randn(t.shape, generator=gen))
    return caches


def test_capture_sizes_and_buckets():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_batch_sizes(100)[-2:] == [96, 128]
    assert context_buckets(8192) == [4096, 8192]
    assert context_buckets(4096) == [4096]


# context 37: no window closes; 35: CSA windows close; 63 and 143: CSA and HCA windows close
@pytest.mark.parametrize("num_reqs,context", [(5, 37), (5, 35), (3, 63), (8, 143)])
@torch.inference_mode()
def test_padded_graph_step_equals_eager(model, num_reqs, context):
    """R requests padded to the next graph size and a context bucket: same logits, same
    cache rows, no expert load from the padding."""
    spec = BatchSpec("decode", num_reqs, 1, context)
    eager, padded = (synthetic_step(model, spec, seed=1) for _ in range(2))
    for s in (eager, padded):
        _random_caches(s, seed=7)
    inputs = eager.step.inputs
    closes = [r for r in (4, 16) if (context + 1) % r == 0]
    assert closes == {37: [], 35: [4], 63: [4, 16], 143: [4, 16]}[context]

    buffers = StepBuffers(eager.groups, eager.input_batch.block_tables, "cpu")
    input_ids, meta, logits_indices = buffers.eager_step(inputs, eager.step.table_writes)
    counts = torch.zeros(model.cfg.num_hidden_layers, model.cfg.n_routed_experts, dtype=torch.int64)
    hidden, _ = model(input_ids, meta, eager.caches, counts)
    expected = model.compute_logits(hidden[logits_indices])

    size = graph_batch_sizes(num_reqs)[-1]
    buffers = StepBuffers(padded.groups, padded.input_batch.block_tables, "cpu")
    graphs = DecodeGraphs(model, padded.caches, buffers, padded.groups, [size], [context + 40])
    key = graphs.key_for(inputs)
    assert key == (size, context + 40)
    decoded = graphs.run(key, inputs, padded.step.table_writes)
    assert decoded.token_ids is None  # nothing sampled in the graph: asked no sampling
    torch.testing.assert_close(decoded.logits, expected, rtol=1e-5, atol=1e-5)
    assert decoded.logits.data_ptr() == graphs.logits.data_ptr()  # every size's one buffer
    assert torch.equal(decoded.expert_counts, counts)  # padded tokens route but are not counted
    for name, per_layer in eager.caches.tensors.items():
        for layer, t in per_layer.items():  # block 0 (null) takes the padding's writes
            torch.testing.assert_close(padded.caches.tensors[name][layer][1:], t[1:])


# a prompt after a cached prefix (CSA and HCA windows close inside it), a cold prompt, and a
# mixed step (a prefill chunk beside three decodes)
@pytest.mark.parametrize("batch", ["prefill:100@37", "prefill:45", "mixed:60@21+3@70"])
@torch.inference_mode()
def test_padded_prefill_graph_step_equals_eager(model, batch):
    """A prefill / mixed step padded to the next prefill-graph size and a context bucket,
    every token a closing candidate with its request's table row (``PrefillGraphs``): the
    sampled rows' logits, the caches and the expert counts of the eager step."""
    spec = BatchSpec.parse(batch)
    eager, padded = (synthetic_step(model, spec, seed=1) for _ in range(2))
    for s in (eager, padded):
        _random_caches(s, seed=7)
    inputs = eager.step.inputs
    assert not inputs.is_uniform_decode and graph_serves(inputs)

    buffers = StepBuffers(eager.groups, eager.input_batch.block_tables, "cpu")
    input_ids, meta, logits_indices = buffers.eager_step(inputs, eager.step.table_writes)
    counts = torch.zeros(model.cfg.num_hidden_layers, model.cfg.n_routed_experts, dtype=torch.int64)
    hidden, _ = model(input_ids, meta, eager.caches, counts)
    expected = model.compute_logits(hidden[logits_indices])

    buffers = StepBuffers(padded.groups, padded.input_batch.block_tables, "cpu")
    bucket = inputs.max_seq_len + 40
    graphs = PrefillGraphs(model, padded.caches, buffers, padded.groups, [256], [bucket, 1 << 20])
    assert graphs.buckets == [bucket]  # no graph past PREFILL_GRAPH_MAX_CONTEXT
    key = graphs.key_for(inputs)
    assert key == (256, bucket)
    # the hyper head on the sampled rows only: their hidden states, in logits_indices order
    assert graphs.max_sampled == 256 and len(logits_indices) < len(inputs.input_ids)
    got, graph_counts = graphs.run(key, inputs, padded.step.table_writes)
    assert got.shape == (len(logits_indices), hidden.shape[1])
    torch.testing.assert_close(got, hidden[logits_indices], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(got), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(graph_counts, counts)  # padded tokens route but are not counted
    for name, per_layer in eager.caches.tensors.items():
        for layer, t in per_layer.items():  # block 0 (null) takes the padding's writes
            torch.testing.assert_close(padded.caches.tensors[name][layer][1:], t[1:])


def test_prefill_graphs_leave_decode_and_long_steps(model):
    """Uniform decode belongs to DecodeGraphs; a step past the largest size runs eager."""
    assert prefill_graph_sizes(8192) == list(PREFILL_GRAPH_TOKENS)
    assert prefill_graph_sizes(600) == [256, 512, 768]
    assert prefill_graph_sizes(100) == [256]
    decode = synthetic_step(model, BatchSpec("decode", 2, 1, 30))
    buffers = StepBuffers(decode.groups, decode.input_batch.block_tables, "cpu")
    graphs = PrefillGraphs(model, decode.caches, buffers, decode.groups, [256], [4096])
    assert graph_serves(decode.step.inputs) and graphs.key_for(decode.step.inputs) is None
    longer = synthetic_step(model, BatchSpec.parse("prefill:300")).step.inputs
    assert graph_serves(longer) and graphs.key_for(longer) is None  # past this one's 256
    longest = synthetic_step(model, BatchSpec.parse("prefill:2100")).step.inputs
    assert not graph_serves(longest)
    # more sampled rows than the graphs' bound (the runner's requests a step): eager
    mixed = synthetic_step(model, BatchSpec.parse("mixed:60@21+3@70"))
    assert len(mixed.step.inputs.logits_indices) == 4
    for bound, served in ((3, False), (4, True)):
        buffers = StepBuffers(mixed.groups, mixed.input_batch.block_tables, "cpu")
        graphs = PrefillGraphs(
            model, mixed.caches, buffers, mixed.groups, [256], [4096], max_sampled_rows=bound
        )
        assert (graphs.key_for(mixed.step.inputs) is not None) == served


def test_captures_run_with_the_collector_frozen():
    """``frozen_gc``: what is alive before the captures is frozen (each capture's
    ``gc.collect()`` skips it) and thawed after, also when a capture raises."""
    alive = [object() for _ in range(100)]
    with frozen_gc():
        assert gc.get_freeze_count() >= len(alive)
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_gc():
        raise RuntimeError("capture failed")
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_upload_writes_fields_back_to_back_into_static_inputs(device):
    host = BlockTables({"a": 4}, max_num_reqs=2, max_len=64)
    buffers = StepBuffers([], host, device)
    static = StaticInputs(12, device)
    static.buffer.fill_(-1)
    fields = [np.array([5, 6, 7]), np.array([1]), np.array([8, 9])]
    index, values = np.array([3, 4]), np.array([10, 11])
    for writes in ((index, values), (index[:0], values[:0])):
        out = buffers.upload(writes, static.buffer, fields)
        assert [a.tolist() for a in out] == [a.tolist() for a in writes]
        assert all(a.device.type == device for a in out)
        ids, one, rows = static.views([3, 1, 2])
        assert (ids.tolist(), one.tolist(), rows.tolist()) == ([5, 6, 7], [1], [8, 9])
        assert static.buffer[6:].tolist() == [-1] * 6  # nothing past the fields
    assert buffers.upload([], static.buffer, []) == []
    with pytest.raises(ValueError, match="past 12"):
        static.views([10, 3])


def test_device_tables_follow_host_tables_by_deltas():
    rng = random.Random(0)
    host = BlockTables({"a": 4, "b": 16}, max_num_reqs=6, max_len=200)
    dev = StepBuffers([], host, "cpu")
    live: list[str] = []
    for step in range(200):
        if live and rng.random() < 0.2:
            host.remove(live.pop(rng.randrange(len(live))))
        elif len(live) < 6 and rng.random() < 0.3:
            rid = f"r{step}"
            n = rng.randrange(1, 10)
            host.add(rid, ([rng.randrange(1, 99) for _ in range(n)], [rng.randrange(1, 99)]))
            live.append(rid)
        for rid in live:
            row = host.row_of[rid]
            if rng.random() < 0.5 and host.lengths["a"][row] < 50:
                host.append(rid, ([rng.randrange(1, 99)], []))
        index, values = host.drain_writes()
        dev.apply_writes(*dev.upload([index, values]))
        for rid in live:
            row = host.row_of[rid]
            for name in ("a", "b"):
                n = host.lengths[name][row]
                assert np.array_equal(dev.tables[name][row, :n], host.tables[name][row, :n])
        assert not dev.tables["a"][dev.null_row].any()  # the null row stays null
