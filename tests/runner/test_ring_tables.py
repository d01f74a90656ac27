"""Sliding-window block tables as rings (slot j in column j % R): the tables do not grow with
max_model_len, and every engine path computes exactly what linear tables compute.

The linear baseline is the same engine with ``CacheGroupSpec.ring_blocks`` patched wide, so
that every table is linear (``table_widths``): both engines schedule the same steps over
the same blocks, only the table indirection differs, so logits must be bitwise equal.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rackserve.config import (
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import (
    CachedRequestData,
    EngineCoreRequest,
    NewRequestData,
    SchedulerOutput,
)
from rackserve.kv.spec import CacheGroupSpec, cache_groups_for, plan_num_blocks
from rackserve.model.create import create_checkpoint
from rackserve.model.generate import ContiguousCache, generate_tokens
from rackserve.model.loader import load_model
from rackserve.model.presets import tiny_config, v4_flash_config
from rackserve.request import KVTransferParams, SamplingParams
from rackserve.runner import model_runner
from rackserve.runner.cuda_graph import DecodeGraphs
from rackserve.runner.input_batch import InputBatch
from rackserve.runner.inputs import BlockTables, ring_widths, table_widths
from rackserve.spec_decode.checkpoint import spec_cache_groups

MAX_STEP = 40  # max_num_batched_tokens: chunks wider than the tiny model's window (16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny_ring"), seed=0)


def _prompts(lengths: list[int], seed: int = 1) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"r{i}": torch.randint(10, 4000, (n,), generator=g).tolist() for i, n in enumerate(lengths)
    }


# ---- units ----------------------------------------------------------------------------------


def test_ring_blocks_bounds_every_step_exactly():
    """R covers the live slots of every step (window behind the first query + the new
    positions), and is reached: no step needs more, some step needs all of it."""
    for window, block in ((16, 8), (8, 8), (128, 64), (10, 3)):
        spec = CacheGroupSpec("w", (0,), block, 1, window, 4, 2)
        for max_step in (1, 4, 17, 40):
            live = [
                (length + n - 1) // block - spec.first_live_slot(length) + 1
                for length in range(200)
                for n in range(1, max_step + 1)
            ]
            assert max(live) == spec.ring_blocks(max_step), (window, block, max_step)
    with pytest.raises(ValueError, match="max_step_tokens"):
        spec.ring_blocks(0)


def test_block_tables_ring_writes_and_replay():
    """Appends land in column slot % R; a delta longer than the ring writes its last R
    slots only; the drained writes (unique indices) replayed on a zero buffer rebuild the
    host tables, also when one row is appended twice between drains."""
    tables = BlockTables({"swa": 4, "kv": 8}, max_num_reqs=2, max_len=64, ring_widths={"swa": 3})
    assert tables.num_cols == [3, 9] and tables.is_ring == [True, False]
    flat = np.zeros(int(tables.flat_offsets[-1]), dtype=np.int64)

    def replay() -> None:
        index, values = tables.drain_writes()
        assert len(np.unique(index)) == len(index)
        flat[index] = values
        for g, name in enumerate(tables.names):
            view = flat[tables.flat_offsets[g] : tables.flat_offsets[g + 1]].reshape(3, -1)
            assert (view[:2] == tables.tables[name].numpy()).all(), name
            assert not view[2].any()  # the null row stays null

    tables.add("a", ([0, 0, 11, 12, 13], [5, 6]))  # slots 0..4: 0, 1 left the window
    assert tables.tables["swa"][0].tolist() == [12, 13, 11]  # slots 3, 4, 2
    replay()
    tables.append("a", ([14], []))  # slot 5 -> column 2
    tables.append("a", ([15, 16], [7]))  # the same row again before a drain
    assert tables.tables["swa"][0].tolist() == [15, 16, 14]  # slots 6, 7, 5
    assert tables.lengths["swa"][0] == 8 and tables.tables["kv"][0, :3].tolist() == [5, 6, 7]
    replay()
    with pytest.raises(ValueError, match="unknown groups"):
        BlockTables({"swa": 4}, 2, 64, ring_widths={"nope": 3})


def test_step_past_the_ring_bound_is_refused():
    """A request scheduled more tokens in one step than the rings were sized for would
    alias its own slots: the runner's batch refuses it with a message, not bad logits."""
    batch = InputBatch(
        {"swa": 4}, 2, 64, 100, (1,), "cpu", ring_widths={"swa": 3}, max_step_tokens=6
    )
    params = SamplingParams(temperature=0, max_tokens=1)

    def step(n: int) -> SchedulerOutput:
        new = NewRequestData("a", list(range(10, 10 + n)), n, params, ([1, 2],), 0)
        return SchedulerOutput([new], CachedRequestData(), {"a": n}, n)

    assert batch.prepare(step(6)) is not None
    batch.update(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"a"}))
    with pytest.raises(ValueError, match="at most 6"):
        batch.prepare(step(7))


def test_sliding_tables_do_not_grow_with_max_model_len():
    """V4-Flash, 2048-token steps: the sliding groups' width is R at max_model_len 4096 and
    65536 alike; the full-history groups grow. And the device tables' bytes at max_model_len
    1M (256 requests, 8192-token steps), linear vs ring, printed for the record."""
    groups = cache_groups_for(v4_flash_config())
    block_tokens = {g.name: g.block_tokens for g in groups}
    rings = ring_widths(groups, 2048)
    assert rings == {g.name: g.ring_blocks(2048) for g in groups if g.is_sliding}
    assert {"swa": 35, "csa_state": 258}.items() <= rings.items()
    small = BlockTables(block_tokens, 2, 4096, rings)
    large = BlockTables(block_tokens, 2, 65536, rings)
    for g, spec in enumerate(groups):
        if spec.is_sliding:
            assert small.num_cols[g] == large.num_cols[g] == rings[spec.name]
            assert large.tables[spec.name].shape[1] == rings[spec.name]
        else:
            assert large.num_cols[g] > small.num_cols[g]
    rings = ring_widths(groups, 8192)
    assert {"swa": 131, "csa_state": 1026}.items() <= rings.items()

    def table_bytes(max_len: int, with_rings: bool) -> int:
        widths = table_widths(block_tokens, max_len, rings if with_rings else None)
        return sum((256 + 1) * cols * 8 for cols, _ in widths)

    linear, ring = table_bytes(1 << 20, False), table_bytes(1 << 20, True)
    print(f"\nv4-flash device block tables at 1M, 256 requests: linear {linear / 1e6:.1f} MB, "
          f"rings {ring / 1e6:.1f} MB")  # fmt: skip
    assert ring < linear / 10


# ---- engines: ring vs linear tables ----------------------------------------------------------


def _engine(
    model_dir: Path,
    max_model_len: int = 512,
    kv_tokens: int | None = None,
    max_num_seqs: int = 8,
    speculative: SpecConfig | None = None,
    kv_transfer: DisaggConfig | None = None,
    device: str = "cpu",
) -> EngineCore:
    """A CPU engine with 40-token steps; KV: the sliding groups' minimum plus full-history
    groups for ``kv_tokens`` (default 4 * max_model_len: a small cache builds fast)."""
    cfg = ModelConfig.from_pretrained(model_dir)
    groups = spec_cache_groups(speculative, cfg, dtype_bytes=4)
    minimum = plan_num_blocks(groups, 1 << 40, max_num_seqs, MAX_STEP)
    full = [g for g in groups if not g.is_sliding]
    tokens = 4 * max_model_len if kv_tokens is None else kv_tokens
    kv = int(
        sum(minimum[g.name] * g.bytes_per_block for g in groups if g.is_sliding)
        + sum(2 * g.bytes_per_block + tokens * g.bytes_per_token for g in full)
    )
    config = EngineConfig(
        model=str(model_dir),
        model_config=cfg,
        cache=CacheConfig(kv_cache_memory=kv),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_STEP, max_model_len=max_model_len
        ),
        device=device,
        speculative=speculative,
        kv_transfer=kv_transfer,
    )
    return EngineCore(config, log_stats=False)


def _record_logits(core: EngineCore, patch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every logits tensor the core samples from (eager steps and CUDA-graph replays) and
    every compute_logits output of its model outside a graph (MTP drafts too), in order."""
    model, calls = core.runner.model, []
    compute, sample = model.compute_logits, model_runner.sample

    def computed(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        calls.append(out.detach().clone())
        return out

    def sampled(logits: torch.Tensor, *args, **kwargs):
        calls.append(logits.detach().clone())
        return sample(logits, *args, **kwargs)

    run = DecodeGraphs.run

    def replayed(graphs: DecodeGraphs, *args, **kwargs):
        decoded = run(graphs, *args, **kwargs)
        if decoded.token_ids is not None:  # sampled inside the graphs: no sample() call
            calls.append(decoded.logits.detach().clone())
        return decoded

    patch.setattr(model, "compute_logits", computed)
    patch.setattr(model_runner, "sample", sampled)
    patch.setattr(DecodeGraphs, "run", replayed)
    return calls


def _run(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    """Add ``prompts``, step until nothing is left; the output token ids of every request."""
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    outputs: dict[str, list[int]] = {req_id: [] for req_id in prompts}
    deadline = time.monotonic() + 300
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for out in core.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


def _ring_vs_linear(
    monkeypatch, make: Callable[[], EngineCore], drive: Callable[[EngineCore], object]
) -> tuple[EngineCore, object]:
    """Run ``drive`` on a ring-table engine and on a linear-table one; assert their logits
    are bitwise equal and their outputs the same; returns the ring engine and its result."""
    results = []
    for linear in (False, True):
        with monkeypatch.context() as patch:
            if linear:
                patch.setattr(CacheGroupSpec, "ring_blocks", lambda self, n: 1 << 30)
            core = make()
            tables = core.runner.input_batch.block_tables
            swa = tables.names.index("swa")
            assert tables.is_ring[swa] != linear  # the ring engine really wraps its tables
            logits = _record_logits(core, patch)
            results.append((core, drive(core), logits))
    (ring_core, ring_out, ring_logits), (_, linear_out, linear_logits) = results
    assert ring_out == linear_out
    assert len(ring_logits) == len(linear_logits) > 0
    for a, b in zip(ring_logits, linear_logits, strict=True):
        assert torch.equal(a, b)
    return ring_core, ring_out


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "device"),
    [
        ([100, 3], 40, "cpu"),
        pytest.param([130, 57, 3], 200, "cpu", marks=pytest.mark.slow),
        # decode steps replay CUDA graphs: the ring indexing is captured
        pytest.param([130, 57, 3], 200, "cuda", marks=pytest.mark.gpu),
    ],
)
def test_long_generation_and_wide_chunks_equal_linear(
    tiny, monkeypatch, lengths, max_tokens, device
):
    """Prompts chunked 40 tokens a step (window 16) and generations wrapping the 8-column
    (64-token) swa ring 2-5 times: logits equal linear tables'."""
    prompts = _prompts(lengths)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    core, out = _ring_vs_linear(
        monkeypatch, lambda: _engine(tiny, device=device), lambda c: _run(c, prompts, params)
    )
    tables = core.runner.input_batch.block_tables
    assert tables.num_cols[tables.names.index("swa")] == 8
    assert all(len(o) == max_tokens for o in out.values())


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "kv_tokens"),
    [
        ([40, 33, 60], 16, 150),
        pytest.param([70, 45, 90, 33, 64, 100], 60, 300, marks=pytest.mark.slow),
    ],
)
def test_prefix_hits_and_preemption_equal_linear(tiny, monkeypatch, lengths, max_tokens, kv_tokens):
    """Turn 2 of each session (prompt + output + new text) hits the finish checkpoints of
    turn 1 at 32-token boundaries; a KV budget too small for all sessions at once forces
    preemptions, resumed through prefix hits. Logits equal linear tables'."""
    turn1 = _prompts(lengths, seed=2)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    extra = _prompts([12] * len(lengths), seed=3)

    def drive(core: EngineCore) -> object:
        out1 = _run(core, turn1, params)
        turn2 = {f"{k}b": turn1[k] + out1[k] + extra[k] for k in turn1}
        out2 = _run(core, turn2, params)
        stats = core.scheduler.kv.stats
        return out1, out2, stats.num_hit_tokens, core.scheduler.num_preemptions

    _, (_, _, num_hit, num_preempted) = _ring_vs_linear(
        monkeypatch, lambda: _engine(tiny, max_model_len=kv_tokens - 40, kv_tokens=kv_tokens), drive
    )
    assert num_hit > 0 and num_preempted > 0


@pytest.mark.parametrize(
    ("method", "lengths", "max_tokens"),
    [
        ("mtp", [30], 24),
        ("draft_model", [30], 16),
        pytest.param("mtp", [50, 23], 80, marks=pytest.mark.slow),
    ],
)
def test_spec_decode_equals_linear(tiny, monkeypatch, method, lengths, max_tokens):
    """K=3: verify steps of 4 tokens plus drafts written 3 positions ahead (the rings are
    sized with the lookahead), by the MTP layer (target's swa ring) or a draft model (its
    own rings: here the target itself); target and draft logits equal linear tables'."""
    prompts = _prompts(lengths, seed=4)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    model = str(tiny) if method == "draft_model" else None
    spec = SpecConfig(method=method, num_speculative_tokens=3, model=model)
    core, _ = _ring_vs_linear(
        monkeypatch, lambda: _engine(tiny, speculative=spec), lambda c: _run(c, prompts, params)
    )
    assert core.scheduler.spec_stats is not None and core.scheduler.spec_stats.num_drafts > 0
    if method == "draft_model":
        tables = core.runner.input_batch.block_tables
        assert tables.is_ring[tables.names.index("draft_swa")]


def test_pd_export_import_equals_linear(tiny, monkeypatch):
    """P/D over TCP: the prefill side exports each request's blocks (block ids, not table
    columns), the decode side imports them into its own blocks and decodes on ring tables;
    the decode side's logits equal linear tables'. One request: loads finish on a thread,
    so two requests could batch differently from run to run (other bits, same tokens)."""
    prompts = _prompts([60], seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def make() -> EngineCore:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        producer = _engine(tiny, kv_transfer=DisaggConfig("kv_producer", "tcp", kv_port=port))
        consumer = _engine(tiny, kv_transfer=DisaggConfig("kv_consumer", "tcp"))
        consumer.producer = producer  # for drive(); both share the patched ring width
        return consumer

    def drive(consumer: EngineCore) -> object:
        producer = consumer.producer
        try:
            for req_id, ids in prompts.items():  # the router's first step: prefill only
                kv = KVTransferParams(do_remote_decode=True, transfer_id=req_id)
                p = replace(params, max_tokens=1, kv_transfer_params=kv)
                producer.add_request(EngineCoreRequest(req_id, ids, p, time.time()))
            _run(producer, {}, params)
            host, port = producer.kv_connector.server.address
            for req_id, ids in prompts.items():  # then decode, pulling the KV
                kv = KVTransferParams(
                    do_remote_prefill=True, transfer_id=req_id, remote_host=host, remote_port=port
                )
                p = replace(params, kv_transfer_params=kv)
                consumer.add_request(EngineCoreRequest(req_id, ids, p, time.time()))
            return _run(consumer, {}, params), consumer.kv_connector.num_loads
        finally:
            producer.shutdown()
            consumer.shutdown()

    _, (out, num_loads) = _ring_vs_linear(monkeypatch, make, drive)
    assert num_loads == len(prompts) and all(len(o) == 12 for o in out.values())


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens"), [(9, 30), pytest.param(20, 120, marks=pytest.mark.slow)]
)
def test_generate_tokens_rings_equal_linear(tiny, monkeypatch, prompt_len, max_tokens):
    """model/generate.py: one request's private sliding blocks are a ring as wide as its
    prompt step needs (9 tokens: 4 blocks, 32 tokens), wrapped by the generation; logits
    equal a linear ContiguousCache's."""
    model = load_model(tiny)
    assert ContiguousCache(model, 1, 90, max_step_tokens=9).block_tables["swa"].shape == (1, 4)
    prompt = _prompts([prompt_len], seed=6)["r0"]
    runs = []
    for linear in (False, True):
        with monkeypatch.context() as patch:
            if linear:
                patch.setattr(CacheGroupSpec, "ring_blocks", lambda self, n: 1 << 30)
            calls: list[torch.Tensor] = []
            compute = model.compute_logits

            def recorded(hidden, calls=calls, compute=compute):
                calls.append(compute(hidden))
                return calls[-1]

            patch.setattr(model, "compute_logits", recorded)
            tokens = generate_tokens(model, prompt, max_tokens)
        runs.append((tokens, calls))
    (ring_tokens, ring_logits), (linear_tokens, linear_logits) = runs
    assert ring_tokens == linear_tokens and len(ring_logits) == max_tokens
    assert all(torch.equal(a, b) for a, b in zip(ring_logits, linear_logits, strict=True))
